"""Random streams through ortfx, and reentrant checkpoints whose inputs do not require grad.

Randomness: an export draws from no stream of the user's (torch's default generators, a
module's own ``torch.Generator``, one given to an op, Python's and numpy's); ORT's random nodes
(Dropout, ``torch.rand``, ...) are seeded from torch's state so that the same torch seed gives
the same numbers, run to run, and a new session (a re-process) or the convergence hooks never
repeat or shift a stream. Checkpoints: ``checkpoint(fn, h, use_reentrant=True)`` with no input
requiring grad gives, as in eager, outputs without gradients and torch's warning.
"""

from __future__ import annotations

import copy
import logging
import random
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import ortfx
from ortfx.export import rewrites
from ortfx.hooks import GlobalSubscriberManager, StatisticsSubscriber

from .models import max_diff

EXPORTERS = ["torchscript", "dynamo"]


# ---- the export draws from no generator ----------------------------------------------------


def _closure_over(generator: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    """A helper holding a generator the module does not hold (only the op sees it)."""
    return lambda h: torch.rand(h.shape, generator=generator)


DRAWS: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    "rand": lambda m, h: torch.rand(h.shape, generator=m.gen),
    "rand_fixed_size": lambda m, h: torch.rand(2, 4, generator=m.gen),
    "uniform_": lambda m, h: torch.empty_like(h).uniform_(generator=m.gen),
    "normal": lambda m, h: torch.normal(0.0, 1.0, (2, 4), generator=m.gen),
    "randperm": lambda m, h: h[torch.randperm(2, generator=m.gen)],
    "closure": lambda m, h: m.noise(h),
}


class OwnGenerator(nn.Module):
    """Noise from the module's own generator (an attribute) or from a closure's."""

    def __init__(self, draw: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gen = torch.Generator().manual_seed(0)
        self.noise = _closure_over(torch.Generator().manual_seed(1))
        self.draw = draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h + DRAWS[self.draw](self, h)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("draw", list(DRAWS))
def test_the_export_draws_nothing_from_a_generator_the_forward_uses(
    exporter: str, draw: str
) -> None:
    """Every call draws what the same call draws in eager (ORT cannot take a generator: the
    calls run in PyTorch), and the generators end where eager's do."""
    torch.manual_seed(0)
    eager = OwnGenerator(draw)
    torch.manual_seed(0)  # built alike, not copied: a deepcopy would share the closure
    wrapped = ortfx.ORTModule(OwnGenerator(draw), options=ortfx.Options(exporter=exporter))
    x = torch.randn(2, 4)
    for _ in range(3):
        assert torch.equal(wrapped(x), eager(x))
    inner = wrapped.module
    assert torch.equal(inner.gen.get_state(), eager.gen.get_state())
    assert torch.equal(inner.noise(x), eager.noise(x))  # the closure's generator too
    assert ortfx.stats(wrapped).fallback_calls == 3


def test_streams_the_module_holds_are_put_back() -> None:
    """``preserved_random_state(module)`` restores the torch, Python and numpy generators held
    as attributes (directly or in a list or dict), however the forward moved them."""

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gen = torch.Generator().manual_seed(0)
            self.py = random.Random(0)
            self.streams = [np.random.default_rng(0), np.random.RandomState(0)]
            self.by_name = {"bits": np.random.PCG64(0)}

    outer = nn.Sequential(Holder())
    holder = outer[0]

    def draws() -> tuple[Any, ...]:
        return (
            torch.rand(3, generator=holder.gen).tolist(),
            holder.py.random(),
            holder.streams[0].random(),
            holder.streams[1].rand(),
            holder.by_name["bits"].random_raw(),
        )

    with rewrites.preserved_random_state(outer):
        first = draws()
        holder.gen.manual_seed(5)
    assert draws() == first


# ---- ORT's random nodes: seeds ------------------------------------------------------------


class Noisy(nn.Module):
    """Dropout and the random ops the exporters write as ONNX random nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 256)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.drop(self.fc(x))
        return (
            h,
            torch.rand_like(h),
            torch.rand_like(h),
            torch.randn(h.shape),
            torch.bernoulli(torch.full_like(h, 0.5)),
        )


def _masks(steps: int = 6, freeze_at: int = 3) -> list[tuple[torch.Tensor, ...]]:
    """What a training run draws per step; a bias is frozen at ``freeze_at`` (a re-process)."""
    torch.manual_seed(0)
    model = Noisy()
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(32, 64) + 5.0  # the linear output is never exactly 0: zeros are dropout's
    drawn = []
    for step in range(steps):
        if step == freeze_at:
            model.fc.bias.requires_grad_(False)
        h, *rest = wrapped(x)
        h.sum().backward()
        drawn.append((h.detach() == 0, *(t.detach() for t in rest)))
    s = ortfx.stats(wrapped)
    assert (s.exports, s.reprocesses, s.sessions, s.fallback) == (1, 1, 2, None)
    return drawn


def test_a_new_session_never_replays_the_draws_of_earlier_steps() -> None:
    """After a re-process (a frozen layer: a new gradient graph and session), every random node
    draws new numbers: no step's dropout mask or noise equals another's."""
    drawn = _masks()
    for i in range(len(drawn)):
        assert 0.45 < float(drawn[i][0].float().mean()) < 0.55  # p=0.5
        for j in range(i):
            for a, b in zip(drawn[i], drawn[j], strict=True):
                assert not torch.equal(a, b), (i, j)


def test_the_same_torch_seed_gives_the_same_draws_run_to_run() -> None:
    """Two runs from the same torch seed draw the same masks and noise at every step, across
    the re-process; two random nodes of one graph draw different numbers."""
    first, second = _masks(), _masks()
    for a, b in zip(first, second, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    assert float((first[0][1] == first[0][2]).float().mean()) < 0.01  # two rand_like nodes


SCRIPT = """
import hashlib, torch, ortfx
class Noisy(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.dropout(x, 0.5, True) == 0, torch.rand_like(x), torch.randn(3)
torch.manual_seed(0)
wrapped = ortfx.ORTModule(Noisy())
x = torch.randn(4, 8) + 5.0
drawn = [t.numpy().tobytes() for _ in range(3) for t in wrapped(x)]
print(hashlib.sha256(b"".join(drawn)).hexdigest())
"""


def test_the_draws_do_not_depend_on_the_process() -> None:
    """Two processes draw the same masks and noise (no per-process salt, no clock: ORT seeds
    an unseeded random node from the clock at process start)."""
    root = Path(__file__).resolve().parents[1]
    here = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=root, check=True
    )
    again = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=root, check=True
    )
    assert here.stdout == again.stdout
    assert len(here.stdout.strip()) == 64


@pytest.fixture
def _unsubscribe() -> Iterator[None]:
    yield
    GlobalSubscriberManager.unsubscribe()


def _dropout_run(out: Path | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4))
    if out is not None:
        GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(out)])
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(8, 16)
    outputs = []
    for _ in range(3):
        y = wrapped(x)
        y.sum().backward()
        outputs.append(y.detach())
    assert ortfx.stats(wrapped).fallback is None
    GlobalSubscriberManager.unsubscribe()
    return outputs


@pytest.mark.usefixtures("_unsubscribe")
def test_the_convergence_hooks_change_no_dropout_mask(tmp_path: Path) -> None:
    """Subscribing the statistics hooks adds PythonOp nodes to the graph; the run with them
    draws the masks of the run without them, from step 0."""
    plain, observed = _dropout_run(None), _dropout_run(tmp_path / "o")
    assert (tmp_path / "o" / "step_0").is_dir()
    for a, b in zip(plain, observed, strict=True):
        assert torch.equal(a, b)


# ---- reentrant checkpoints whose inputs do not require grad ---------------------------------


class Frozen(nn.Module):
    """PEFT's shape: a frozen embedding, then a reentrant-checkpointed block, then a head."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.emb.weight.requires_grad_(False)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = None if style == "no_head" else nn.Linear(8, 2)
        self.style = style

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if self.style == "sequential":  # checkpoints block[0]; block[1:] runs plainly
            h = checkpoint_sequential(self.block, 2, h, use_reentrant=True)
        else:
            h = checkpoint(self.block, h, use_reentrant=True)
        return h if self.head is None else self.head(h)


IDS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])


def _called(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = model(ids)
    return out, [(str(w.message), w.category, w.filename, w.lineno) for w in seen]


def _same_grad(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and max_diff(a, b) <= 1e-5)


def _pair(style: str, **options: Any) -> tuple[nn.Module, ortfx.ORTModule]:
    torch.manual_seed(0)
    eager = Frozen(style)
    return eager, ortfx.ORTModule(copy.deepcopy(eager), options=ortfx.Options(**options))


@pytest.mark.parametrize("style", ["head", "sequential", "no_head"])
def test_a_reentrant_checkpoint_without_grad_inputs_trains_as_in_eager(style: str) -> None:
    """The same warnings (torch's text, category and place), the same requires_grad on the
    output, and the same gradients: none for the checkpointed parameters; in ORT."""
    eager, wrapped = _pair(style)
    expected, eager_warnings = _called(eager, IDS)
    out, ortfx_warnings = _called(wrapped, IDS)
    assert ortfx_warnings == eager_warnings
    assert [w[0] for w in eager_warnings] == [rewrites.NO_INPUT_REQUIRES_GRAD]
    assert out.requires_grad == expected.requires_grad == (style != "no_head")
    assert max_diff(out, expected) <= 1e-6
    if expected.requires_grad:
        expected.sum().backward()
        out.sum().backward()
    for (name, p), q in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
        assert _same_grad(p.grad, q.grad), name
    assert eager.block[0].weight.grad is None
    assert ortfx.stats(wrapped).fallback is None


def test_autograd_grad_through_a_reentrant_checkpoint_raises_as_in_eager() -> None:
    eager, wrapped = _pair("head")
    messages = []
    for model, inner in ((eager, eager), (wrapped, wrapped.module)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = model(IDS).sum()
        with pytest.raises(RuntimeError) as info:
            torch.autograd.grad(loss, inner.block[0].weight)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert "appears to not have been used in the graph" in messages[0]


def test_the_graph_follows_the_flags_and_grad_mode_a_reentrant_checkpoint_read() -> None:
    """A first call without grad (a validation pass), then training, then the embedding
    unfrozen (its output now requires grad): each graph gives eager's gradients."""
    eager, wrapped = _pair("head")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            assert max_diff(wrapped(IDS), eager(IDS)) <= 1e-6
        for unfreeze in (False, True):
            if unfreeze:
                eager.emb.weight.requires_grad_(True)
                wrapped.module.emb.weight.requires_grad_(True)
            for model in (eager, wrapped):
                model.zero_grad(set_to_none=True)
                model(IDS).sum().backward()
            for (name, p), q in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
                assert _same_grad(p.grad, q.grad), (unfreeze, name)
    assert eager.block[0].weight.grad is not None  # unfrozen: the block trains
    assert ortfx.stats(wrapped).exports == 3
    assert ortfx.stats(wrapped).fallback is None


def test_dynamo_cannot_tell_and_refuses_naming_the_line() -> None:
    """The dynamo exporter's copies do not say whether they require grad: refused (typed);
    under the default policy the module runs in PyTorch, with eager's results."""
    _, strict = _pair("head", exporter="dynamo", fallback_policy=ortfx.FallbackPolicy.DISABLE)
    with pytest.raises(ortfx.OrtfxExportError) as info:
        strict(IDS)
    assert str(info.value).startswith(
        "the forward of Frozen calls torch.utils.checkpoint with use_reentrant=True "
        "(test_randomness.py:"
    )
    eager, wrapped = _pair("head", exporter="dynamo")
    expected, eager_warnings = _called(eager, IDS)
    out, ortfx_warnings = _called(wrapped, IDS)
    assert ortfx_warnings == eager_warnings
    assert max_diff(out, expected) == 0.0
    assert out.requires_grad
    assert ortfx.stats(wrapped).fallback_calls == 1


def test_random_draws_are_said_once_per_process(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A graph with random nodes draws other values than eager (ORT's generators): a WARNING
    says so once per process, naming the kinds of nodes; a graph without random nodes, a
    dropout of p=0, and the second wrapper with them, say nothing."""
    from ortfx.runtime import logs

    monkeypatch.setattr(logs, "_RANDOM_SAID", [])
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        ortfx.ORTModule(nn.Linear(8, 8))(x)
        ortfx.ORTModule(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0)))(x)  # draws nothing
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        for _ in range(2):
            ortfx.ORTModule(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)))(x)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said == [
        "the exported graph draws random numbers (Dropout) from ONNX Runtime's generators, "
        "seeded from torch's state: the same distribution, reproducible for a given "
        "torch.manual_seed, but not the values eager PyTorch draws, and torch's own generator "
        "does not advance (a later torch.manual_seed does not reseed the graph's). Compare "
        "losses with dropout off (docs/runtime.md, Dropout and random ops). Said once per "
        "process."
    ]
