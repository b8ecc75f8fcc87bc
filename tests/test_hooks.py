"""Convergence tooling (ortfx.hooks): layout, exact summaries, step windows, the merge CLI, and
ortfx/PyTorch parity of the in-graph statistics."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch
from torch import nn

import ortfx
from ortfx import export as ortfx_export
from ortfx import io
from ortfx.hooks import (
    GlobalSubscriberManager,
    StatisticsSubscriber,
    SubscriberManager,
    inspect_activation,
)
from ortfx.hooks.merge_activation_summary import main, merge
from ortfx.hooks.summary import Summary, parse, render, summarize
from ortfx.options import ExportOptions
from ortfx.schema import ModelSchema

ROOT = Path(__file__).resolve().parents[1]


class Pair(nn.Module):
    """Two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), torch.tanh(self.b(x))


class Scaled(nn.Module):
    """A linear layer whose output is scaled: the place to plant a divergence."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class Net(nn.Module):
    """Nested modules; the root returns two tensors; one activation marked by name."""

    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()
        self.head = nn.Sequential(Scaled(), nn.ReLU())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p, q = self.pair(x)
        h = self.head(inspect_activation("product", p * q))
        return h, p.sum()


# Module indices, depth-first: Net 0, Pair 1, Linear a 2, Linear b 3, Sequential 4, Scaled 5,
# Linear lin 6, ReLU 7.
FORWARD_ORDER = [
    "Linear_2_0th_output_forward",
    "Linear_3_0th_output_forward",
    "Pair_1_0th_output_forward",
    "Pair_1_1th_output_forward",
    "product_forward",
    "Linear_6_0th_output_forward",
    "Scaled_5_0th_output_forward",
    "ReLU_7_0th_output_forward",
    "Sequential_4_0th_output_forward",
    "Net_0_0th_output_forward",
    "Net_0_1th_output_forward",
]
BACKWARD = {n.replace("_forward", "_backward") for n in FORWARD_ORDER}


@pytest.fixture(autouse=True)
def _unsubscribe() -> Iterator[None]:
    yield
    GlobalSubscriberManager.unsubscribe()


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h, s = model(x)
    (h.sum() + s).backward()
    return h.detach(), s.detach()


def _inputs(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 4, generator=g) for _ in range(steps)]


def _listing(out: Path) -> dict[str, tuple[list[str], set[str]]]:
    """step folder -> (order.txt lines, files other than order.txt)."""
    return {
        d.name: (
            (d / "order.txt").read_text().split(),
            {f.name for f in d.iterdir() if f.name != "order.txt"},
        )
        for d in sorted(out.iterdir())
    }


def _export_trace(model: nn.Module, x: torch.Tensor) -> None:
    """Run ortfx's export (the TorchScript trace) on ``model``."""
    leaves, spec = io.flatten(io.call_tree((x,), {}))
    ortfx_export.export(
        model, leaves, ModelSchema.from_flat(leaves, spec), ExportOptions("torchscript", 17, True)
    )


def test_layout_per_step_and_nothing_from_an_export_trace(tmp_path: Path) -> None:
    """Each step folder holds exactly one forward and one backward summary per module output
    tensor and per inspected activation, forward ones in execution order; an export trace in
    the middle neither writes nor counts as a step; values and gradients are untouched."""
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model)
    xs = _inputs(3)
    # PyTorch alone first: inspect_activation reports to the global manager from any model.
    expected = [_step(plain, x) for x in xs]
    out = tmp_path / "pt"
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(out)])
    for i, x in enumerate(xs):
        assert all(torch.equal(a, b) for a, b in zip(_step(model, x), expected[i], strict=True))
        if i == 0:
            _export_trace(model, x)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad)
    listing = _listing(out)
    assert list(listing) == ["step_0", "step_1", "step_2"]
    for order, files in listing.values():
        assert order[: len(FORWARD_ORDER)] == FORWARD_ORDER
        assert set(order[len(FORWARD_ORDER) :]) == BACKWARD
        assert len(order) == len(FORWARD_ORDER) + len(BACKWARD)
        assert files == set(FORWARD_ORDER) | BACKWARD
    assert GlobalSubscriberManager.get_run_context().global_states.execution_step == 3


def test_a_module_called_twice_gets_one_file_per_call(tmp_path: Path) -> None:
    """A module reused within a step writes one summary per call, not one over the other."""
    lin = nn.Linear(3, 3)
    model = nn.Sequential()
    model.forward = lambda x: lin(lin(x))  # type: ignore[method-assign]
    model.add_module("lin", lin)
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / "o")])
    model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    order, _ = _listing(tmp_path / "o")["step_0"]
    assert order[:3] == [
        "Linear_1_0th_output_forward",
        "Linear_1_0th_output_call1_forward",
        "Sequential_0_0th_output_forward",
    ]


def _reference(t: torch.Tensor) -> Summary:
    d = t.detach().double().reshape(-1)
    return Summary(
        shape=tuple(t.shape),
        dtype=str(t.dtype),
        numel=t.numel(),
        min=float(d.min()),
        max=float(d.max()),
        mean=float(d.mean()),
        std=float(d.std()) if d.numel() > 1 else math.nan,
        nan=int(torch.isnan(d).sum()),
        inf=int(torch.isinf(d).sum()),
        neg=int((d < 0).sum()),
        pos=int((d > 0).sum()),
        zero=int((d == 0).sum()),
    )


def _same(a: Summary, b: Summary, rel: float) -> bool:
    def close(x: float, y: float) -> bool:
        if math.isnan(x) or math.isnan(y):
            return math.isnan(x) and math.isnan(y)
        return x == y or abs(x - y) <= rel * abs(y)

    ints = ("shape", "dtype", "numel", "nan", "inf", "neg", "pos", "zero")
    return all(getattr(a, k) == getattr(b, k) for k in ints) and all(
        close(getattr(a, k), getattr(b, k)) for k in ("min", "max", "mean", "std")
    )


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shifted = torch.randn(1000, generator=g) * 0.5 + 1000.0  # upstream's std fails here
    mixed = torch.randn(37, 11, generator=g) * 3 + 5
    mixed[0, 0] = 0.0
    mixed[1, :3] = -2.0
    with_nan = mixed.clone()
    with_nan[4, 4] = float("nan")
    with_inf = mixed.clone()
    with_inf[2, 2] = float("inf")
    both_inf = with_inf.clone()
    both_inf[3, 3] = float("-inf")
    return {
        "shifted": shifted,
        "mixed": mixed,
        "nan": with_nan,
        "inf": with_inf,
        "both_inf": both_inf,
        "half": mixed.half(),
        "int": torch.arange(-7, 20).reshape(3, 9),
        "bool": torch.tensor([True, False, True]),
        "one": torch.tensor([2.5]),
        "empty": torch.zeros(0, 3),
    }


@pytest.mark.parametrize("bucket_size", [1 << 24, 7, 1])
@pytest.mark.parametrize("name", list(_tensors()))
def test_summary_matches_torch(name: str, bucket_size: int) -> None:
    """Counts are exact and min/max/mean/std equal torch's float64 values (to 1e-12 relative)
    whatever the bucketing, for nonzero means, NaN, Inf and unusual dtypes; render/parse is a
    round trip."""
    t = _tensors()[name]
    got = summarize(t, bucket_size=bucket_size)
    if t.numel() == 0:
        assert (got.numel, got.nan, got.neg, got.pos, got.zero) == (0, 0, 0, 0, 0)
        assert all(math.isnan(getattr(got, k)) for k in ("min", "max", "mean", "std"))
    else:
        assert _same(got, _reference(t), 1e-12), (got, _reference(t))
    assert _same(parse(render(">>x_forward", got)), got, 0.0)


def test_std_with_large_mean_is_right() -> None:
    """The case where upstream reported 5962 for a true std near 1: ours matches torch.std of
    the float32 tensor to float32 precision, with many buckets."""
    t = torch.randn(100_000, generator=torch.Generator().manual_seed(0)) + 500.0
    got = summarize(t, bucket_size=1000)
    assert abs(got.std - float(t.std())) <= 1e-5 * float(t.std())
    assert abs(got.std - 1.0) < 0.02


def test_window_is_honoured_by_modules_and_inspect_activation(tmp_path: Path) -> None:
    """Only steps in [start_step, end_step) are written, both for module outputs and for
    inspect_activation; steps outside still count."""
    model = Net()
    out = tmp_path / "w"
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(out, start_step=2, end_step=4)])
    for x in _inputs(6):
        _step(model, x)
    listing = _listing(out)
    assert list(listing) == ["step_2", "step_3"]
    for order, _ in listing.values():
        assert "product_forward" in order and "product_backward" in order
        assert len(order) == len(FORWARD_ORDER) + len(BACKWARD)


def test_inspect_activation_without_subscriber_is_the_identity() -> None:
    t = torch.randn(3, requires_grad=True)
    assert inspect_activation("x", t) is t


def test_output_dir_must_be_new_unless_overridden(tmp_path: Path) -> None:
    out = tmp_path / "exists"
    out.mkdir()
    (out / "old").write_text("x")
    with pytest.raises(ortfx.OrtfxOutputExistsError, match=r"already exists.*override_output_dir"):
        StatisticsSubscriber(out)
    with pytest.raises(FileExistsError):  # upstream's type, for scripts that catch it
        StatisticsSubscriber(out)
    with pytest.warns(UserWarning, match="deleting the existing"):
        StatisticsSubscriber(out, override_output_dir=True)
    assert list(out.iterdir()) == []


def test_resubscribing_replaces_hooks(tmp_path: Path) -> None:
    """A second subscribe removes the first one's hooks and restarts the step count."""
    model = Net()
    manager = SubscriberManager()
    manager.subscribe(model, [StatisticsSubscriber(tmp_path / "a")])
    _step(model, _inputs(1)[0])
    manager.subscribe(model, [StatisticsSubscriber(tmp_path / "b")])
    _step(model, _inputs(1)[0])
    manager.unsubscribe()
    _step(model, _inputs(1)[0])
    assert list(_listing(tmp_path / "a")) == ["step_0"]
    assert list(_listing(tmp_path / "b")) == ["step_0"]
    order, _ = _listing(tmp_path / "b")["step_0"]
    assert len(order) == len(FORWARD_ORDER) - 1 + len(BACKWARD) - 1  # no global inspect


def _train(model: nn.Module, out: Path, steps: int, plant_at: int | None = None) -> None:
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(out)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, x in enumerate(_inputs(steps)):
        if plant_at is not None and i == plant_at:
            model.head[0].scale = 1.001  # type: ignore[index]
        opt.zero_grad()
        _step(model, x)
        opt.step()
    GlobalSubscriberManager.unsubscribe()


def test_cli_finds_a_planted_divergence(tmp_path: Path) -> None:
    """Two runs identical up to step 3, where one layer's output changes by 0.1 %: the merge
    names step 3 and that layer's forward output, with both values; merged files, report and a
    valid PNG are written; an existing output needs --overwrite."""
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    _train(model, tmp_path / "pt", 6)
    _train(twin, tmp_path / "ort", 6, plant_at=3)

    out = tmp_path / "merged"
    comparison = merge(tmp_path / "pt", tmp_path / "ort", out)
    d = comparison.divergence
    assert d is not None
    assert (d.step, d.name) == (3, "Scaled_5_0th_output_forward")
    assert "mean" in d.fields and d.pytorch.mean != d.ortfx.mean
    text = (out / "divergence.txt").read_text()
    assert text.startswith("first divergence: step 3, activation Scaled_5_0th_output_forward\n")
    assert repr(d.pytorch.mean) in text and repr(d.ortfx.mean) in text
    for side in ("merge_pt", "merge_ort"):
        assert sorted(p.name for p in (out / side).iterdir()) == [
            f"step_{i}_.txt" for i in range(6)
        ]
    merged = (out / "merge_pt" / "step_0_.txt").read_text()
    assert merged.index(">>>Linear_2_0th_output_forward") < merged.index(
        ">Net_0_0th_output_forward"
    )

    png = (out / "divergence.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(str(out / "divergence.png"))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100

    # Identical runs: no divergence.
    same = merge(tmp_path / "pt", tmp_path / "pt", tmp_path / "same")
    assert same.divergence is None and len(same.steps) == 6
    assert (tmp_path / "same" / "divergence.txt").read_text().startswith("no divergence")

    # An existing output directory is an error without --overwrite, replaced with it.
    argv = ["--pt_dir", str(tmp_path / "pt"), "--ort_dir", str(tmp_path / "ort")]
    assert main([*argv, "--output_dir", str(out)]) == 2
    (out / "stale").write_text("x")
    assert main([*argv, "--output_dir", str(out), "--overwrite", "--rtol", "0.5"]) == 0
    assert not (out / "stale").exists()
    assert (out / "divergence.txt").read_text().startswith("no divergence beyond rtol=0.5")


def test_cli_as_a_module_and_its_errors(tmp_path: Path) -> None:
    """``python -m ortfx.hooks.merge_activation_summary`` runs; an empty ortfx directory (a run
    that recorded nothing) is reported with exit code 2, not merged."""
    model = Net()
    _train(model, tmp_path / "pt", 2)
    (tmp_path / "ort").mkdir()
    cmd = [sys.executable, "-m", "ortfx.hooks.merge_activation_summary"]
    cmd += ["--pt_dir", str(tmp_path / "pt")]
    empty = subprocess.run(
        [*cmd, "--ort_dir", str(tmp_path / "ort"), "--output_dir", str(tmp_path / "m")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert empty.returncode == 2 and "holds no step_<n> folders" in empty.stderr
    ok = subprocess.run(
        [*cmd, "--ort_dir", str(tmp_path / "pt"), "--output_dir", str(tmp_path / "m")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "no divergence beyond rtol=0.0001, atol=1e-06: 2 steps" in ok.stdout


# ---- ortfx ----------------------------------------------------------------------------------


def test_subscribing_an_exported_ortmodule_reexports_and_keeps_values(tmp_path: Path) -> None:
    """Subscribing to an ORTModule that already exported forces one re-export (so the graph can
    hold the statistics Functions); outputs and gradients still equal PyTorch's."""
    torch.manual_seed(0)
    plain = Net()
    model = ortfx.ORTModule(copy.deepcopy(plain))
    xs = _inputs(3)
    _step(model, xs[0])
    _step(plain, xs[0])
    assert ortfx.stats(model).exports == 1
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / "o")])
    for x in xs[1:]:
        for a, b in zip(_step(model, x), _step(plain, x), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ortfx.stats(model).exports == 2
    assert ortfx.stats(model).fallback is None
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    GlobalSubscriberManager.unsubscribe()
    _step(model, xs[0])
    assert ortfx.stats(model).exports == 3  # the hooks left the graph


def _summaries(out: Path) -> dict[str, dict[str, Summary]]:
    return {
        d.name: {f.name: parse(f.read_text()) for f in d.iterdir() if f.name != "order.txt"}
        for d in sorted(out.iterdir())
    }


@pytest.mark.parametrize("when", ["before_wrapping", "after_wrapping"])
def test_ortfx_summaries_equal_pytorch(tmp_path: Path, when: str) -> None:
    """The same model, weights and inputs through ortfx and through PyTorch write the same
    files, and every summary agrees within float tolerance, forward and backward."""
    torch.manual_seed(0)
    plain = Net()
    inner = copy.deepcopy(plain)
    _train(plain, tmp_path / "pt", 3)
    if when == "before_wrapping":
        GlobalSubscriberManager.subscribe(inner, [StatisticsSubscriber(tmp_path / "ort")])
        model = ortfx.ORTModule(inner)
    else:
        model = ortfx.ORTModule(inner)
        _step(model, _inputs(1)[0])  # exported once without hooks
        GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(tmp_path / "ort")])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in _inputs(3):
        opt.zero_grad()
        _step(model, x)
        opt.step()
    assert ortfx.stats(model).fallback is None
    pt, ort = _summaries(tmp_path / "pt"), _summaries(tmp_path / "ort")
    assert {k: set(v) for k, v in ort.items()} == {k: set(v) for k, v in pt.items()}
    for step, files in pt.items():
        for name, ref in files.items():
            got = ort[step][name]
            assert attrs.evolve(got, min=0.0, max=0.0, mean=0.0, std=0.0, neg=0, pos=0, zero=0) == (
                attrs.evolve(ref, min=0.0, max=0.0, mean=0.0, std=0.0, neg=0, pos=0, zero=0)
            ), (step, name)
            for k in ("min", "max", "mean", "std"):
                a, b = getattr(got, k), getattr(ref, k)
                # The std of one element is nan in torch; both sides must agree on that too.
                assert (math.isnan(a) and math.isnan(b)) or math.isclose(
                    a, b, rel_tol=1e-4, abs_tol=1e-6
                ), (
                    step,
                    name,
                    k,
                )
