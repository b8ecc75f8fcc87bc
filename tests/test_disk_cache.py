"""The persistent export cache (``Options(cache_dir=...)``, ``ORTMODULE_CACHE_DIR``).

Content-addressed: every process traces, and an entry is keyed by the traced graph. A warm
process skips the passes and ORT's gradient build and trains exactly as a cold one; whatever
the forward reads (globals, helper code, closures, private attributes, tied weights) changes
the traced graph and misses; a hit serves exactly what the passes produce now; entries are
JSON plus ONNX bytes, never code (a crafted pickle is refused with a WARNING); a directory or
entry others can write is refused with a WARNING; damaged entries warn and are built again;
concurrent writers leave a whole entry.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import pickle
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch import nn

import ortfx
from ortfx.model_info import PostExportProcessedModelInfo
from ortfx.runtime import disk_cache, events
from ortfx.runtime.logs import wrapper_log

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 240

Events = list[tuple[str, tuple[Any, ...]]]


def _worker(cache_dir: Path, out: Path, which: str = "block") -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tests.cache_worker", str(cache_dir), str(out), which]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen[bytes]) -> None:
    output, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, output.decode()[-3000:]


def _entries(cache: Path) -> list[Path]:
    """The processed-graph entries (not ORT's gradient graphs)."""
    return sorted(p for p in cache.iterdir() if not p.name.startswith("gradient-"))


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for x, y in zip(a["outputs"], b["outputs"], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert a["grads"].keys() == b["grads"].keys()
    for name, grad in a["grads"].items():
        torch.testing.assert_close(b["grads"][name], grad, rtol=0, atol=0, msg=name)
    for name, buffer in a["buffers"].items():
        torch.testing.assert_close(b["buffers"][name], buffer, rtol=0, atol=0, msg=name)


def test_warm_process_skips_the_passes_and_trains_identically(tmp_path: Path) -> None:
    """A fresh process with a filled cache still traces (every export is counted) but takes
    the processed graph and ORT's gradient graph from disk, and gives the cold run's outputs
    and gradients bit for bit; training and eval each have their own entry."""
    cache = tmp_path / "cache"
    _finish(_worker(cache, tmp_path / "cold.pt"))
    _finish(_worker(cache, tmp_path / "warm.pt"))
    cold = torch.load(tmp_path / "cold.pt")
    warm = torch.load(tmp_path / "warm.pt")
    assert (cold["exports"], warm["exports"]) == (2, 2)  # training and eval, traced both times
    assert [kind for kind, _ in cold["disk"]] == ["miss", "miss"]
    assert [kind for kind, _ in warm["disk"]] == ["hit", "hit"]
    assert (cold["gradient"], warm["gradient"]) == (["miss"], ["hit"])
    train_path, eval_path = (path for _, path in warm["disk"])
    assert train_path != eval_path and "-train-" in train_path and "-eval-" in eval_path
    assert [p.name for p in _entries(cache)] == sorted(
        Path(p).name for p in (train_path, eval_path)
    )
    assert all(p.stat().st_mode & 0o077 == 0 for p in cache.iterdir())  # this user's only
    assert cache.stat().st_mode & 0o777 == 0o700
    _same(cold, warm)


@pytest.mark.parametrize("which", ["gpt2", "index_add", "batchnorm"])
def test_warm_process_hugging_face_model_aten_ops_and_batchnorm(tmp_path: Path, which: str) -> None:
    """A transformers model is cached too (its output type, a ``ModelOutput``, comes from the
    warm process's own trace); a graph with ops run by torch (ATen nodes) gets its executor and
    gradient definitions in the warm process; a BatchNorm model is cached and updates its
    running statistics as the cold run did."""
    cache = tmp_path / "cache"
    _finish(_worker(cache, tmp_path / "cold.pt", which))
    _finish(_worker(cache, tmp_path / "warm.pt", which))
    cold = torch.load(tmp_path / "cold.pt")
    warm = torch.load(tmp_path / "warm.pt")
    assert [kind for kind, _ in cold["disk"]] == ["miss", "miss"]
    assert [kind for kind, _ in warm["disk"]] == ["hit", "hit"]
    assert (cold["gradient"], warm["gradient"]) == (["miss"], ["hit"])
    _same(cold, warm)


def test_untied_then_tied_weights_across_processes(tmp_path: Path) -> None:
    """A cache filled by a model with untied weights serves nothing to the same class with its
    head tied to its embedding (a KeyError on every warm start with the old key), and the
    reverse: each trains as it does with a cache of its own."""
    for first, second in (("untied", "tied"), ("tied", "untied")):
        shared, alone = tmp_path / f"{first}-shared", tmp_path / f"{second}-alone"
        _finish(_worker(shared, tmp_path / f"{first}.pt", first))
        _finish(_worker(shared, tmp_path / f"{second}-after.pt", second))
        _finish(_worker(alone, tmp_path / f"{second}-alone.pt", second))
        after = torch.load(tmp_path / f"{second}-after.pt")
        assert [kind for kind, _ in after["disk"]] == ["miss", "miss"]
        _same(torch.load(tmp_path / f"{second}-alone.pt"), after)


def test_concurrent_writers_leave_a_whole_entry(tmp_path: Path) -> None:
    """Two cold processes storing the same entries at once: both succeed and a later process
    hits entries that load and train correctly."""
    cache = tmp_path / "cache"
    procs = [_worker(cache, tmp_path / f"cold{i}.pt") for i in range(2)]
    for proc in procs:
        _finish(proc)
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]
    _finish(_worker(cache, tmp_path / "warm.pt"))
    warm = torch.load(tmp_path / "warm.pt")
    assert [kind for kind, _ in warm["disk"]] == ["hit", "hit"]
    assert warm["gradient"] == ["hit"]
    _same(torch.load(tmp_path / "cold0.pt"), warm)


def test_threads_storing_and_loading_never_see_a_partial_entry(tmp_path: Path) -> None:
    """store() replaces atomically: readers racing eight writers load a whole entry or none."""
    torch.manual_seed(0)
    wrapped = ortfx.ORTModule(nn.Linear(3, 2))
    with events.recording() as seen:
        wrapped(torch.randn(2, 3))
    (info,) = [args[0] for name, args in seen if name == "export"]
    entry = disk_cache.Slot(tmp_path / "entry.ortfx", "0" * 32)
    log = wrapper_log(ortfx.LogLevel.WARNING)
    disk_cache.store(entry, info, log)
    loaded: list[PostExportProcessedModelInfo | None] = []

    def write() -> None:
        for _ in range(20):
            disk_cache.store(entry, info, log)

    def read() -> None:
        for _ in range(40):
            loaded.append(disk_cache.load(entry, info, log))

    threads = [threading.Thread(target=write) for _ in range(8)] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert loaded and all(e == info for e in loaded)
    assert [p.name for p in tmp_path.iterdir()] == [entry.path.name]


# ---- in one process: a new wrapper per run, so only the directory is shared -------------------


class Net(nn.Module):
    def __init__(self, width: int = 8, slope: float = 0.1) -> None:
        super().__init__()
        self.a = nn.Linear(4, width)
        self.act = nn.LeakyReLU(slope)
        self.b = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


class Scaled(Net):
    """Same parameters as Net, another forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


@attrs.frozen
class Ran:
    """One call through a fresh wrapper: the cache's events, the exports, the graph ORT got."""

    disk: tuple[str, ...]
    gradient: tuple[str, ...]
    exports: int
    info: PostExportProcessedModelInfo
    output: torch.Tensor


def _run(
    model: nn.Module,
    cache: Path | str,
    *,
    train: bool = True,
    x: torch.Tensor | None = None,
    **options: Any,
) -> Ran:
    """Call ``model`` once through a new wrapper (and backward, in training) beside a copy
    run in PyTorch; outputs, gradients and buffers must match it."""
    torch.manual_seed(1)
    x = torch.randn(5, 4) if x is None else x
    eager = copy.deepcopy(model).train(train)
    wrapped = ortfx.ORTModule(model, options=ortfx.Options(cache_dir=str(cache), **options))
    wrapped.train(train)
    with events.recording() as seen:
        y = wrapped(x)
        if train:
            y.sum().backward()
    expected = eager(x)
    if train:
        expected.sum().backward()
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    for (name, b), c in zip(model.named_buffers(), eager.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-5, msg=name)
    (info,) = [args[0] for name, args in seen if name == "export"]
    return Ran(
        disk=tuple(args[0] for name, args in seen if name == "disk_cache"),
        gradient=tuple(args[0] for name, args in seen if name == "gradient_cache"),
        exports=sum(name == "export" for name, _ in seen),
        info=info,
        output=y.detach(),
    )


@pytest.mark.parametrize(
    ("name", "variant"),
    [
        ("parameter shape", lambda: (Net(width=9), {})),
        ("module class", lambda: (Scaled(), {})),
        ("module attribute", lambda: (Net(slope=0.2), {})),
        ("opset", lambda: (Net(), {"opset_version": 18})),
        ("eval mode", lambda: (Net(), {"train": False})),
    ],
)
def test_what_changes_the_graph_misses(tmp_path: Path, name: str, variant: Any) -> None:
    """A module or option that changes the traced graph gets its own entry."""
    assert _run(Net(), tmp_path).disk == ("miss",)
    again = _run(Net(), tmp_path)  # the same graph: served from disk, traced all the same
    assert (again.disk, again.gradient, again.exports) == (("hit",), ("hit",), 1)
    model, options = variant()
    train = options.pop("train", True)
    assert _run(model, tmp_path, train=train, **options).disk == ("miss",), name
    assert len(_entries(tmp_path)) == 2


def test_frozen_parameters_share_the_graph_not_the_gradient(tmp_path: Path) -> None:
    """requires_grad does not change the traced graph (the passes give the same graph), but
    it changes what ORT differentiates: the gradient graph gets its own entry."""
    assert (_run(Net(), tmp_path).disk, _run(Net(), tmp_path).gradient) == (("miss",), ("hit",))
    frozen = Net()
    frozen.a.requires_grad_(False)
    ran = _run(frozen, tmp_path)
    assert (ran.disk, ran.gradient) == (("hit",), ("miss",))
    assert frozen.a.weight.grad is None and frozen.b.weight.grad is not None


def test_a_call_under_autocast_is_not_served_the_float32_graph(tmp_path: Path) -> None:
    """A graph traced under autocast holds its casts: the float32 graph's entry is never
    served to it (on CPU such a call falls back, as without a cache)."""
    assert _run(Net(), tmp_path).disk == ("miss",)
    model = Net()
    with torch.autocast("cpu", dtype=torch.bfloat16), events.recording() as seen:
        y = ortfx.ORTModule(model, options=ortfx.Options(cache_dir=str(tmp_path)))(
            torch.randn(5, 4)
        )
    assert ("disk_cache", "hit") not in [(name, args[0]) for name, args in seen if args]
    assert y.dtype == torch.bfloat16


# What the forward reads besides its arguments, parameters and buffers: each is part of what
# the trace records, so a change misses (the old key, a description of the module, served the
# first graph for every one of these).

SCALE = 2.0


class ReadsGlobal(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * SCALE


helper = types.ModuleType("helper")  # a helper module the forward calls into
helper.act = torch.tanh  # type: ignore[attr-defined]


class CallsHelper(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return helper.act(super().forward(x))  # type: ignore[no-any-return]


def _made(scale: float) -> type[Net]:
    """A class from a factory: its forward reads a closure cell."""

    class Made(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * scale

    return Made


class PrivateScale(Net):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self._scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self._scale


class Tied(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        if tie:
            self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _global(monkeypatch: pytest.MonkeyPatch) -> tuple[nn.Module, Callable[[], nn.Module]]:
    def change() -> nn.Module:
        monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)
        return ReadsGlobal()

    return ReadsGlobal(), change


def _helper(monkeypatch: pytest.MonkeyPatch) -> tuple[nn.Module, Callable[[], nn.Module]]:
    def change() -> nn.Module:
        monkeypatch.setattr(helper, "act", torch.sigmoid)
        return CallsHelper()

    return CallsHelper(), change


STATE_READ_BY_THE_FORWARD: dict[str, Callable[..., Any]] = {
    "module global": _global,
    "helper module": _helper,
    "closure": lambda _: (_made(2.0)(), lambda: _made(3.0)()),
    "private attribute": lambda _: (PrivateScale(2.0), lambda: PrivateScale(3.0)),
    "untied, then tied": lambda _: (Tied(tie=False), lambda: Tied(tie=True)),
    "tied, then untied": lambda _: (Tied(tie=True), lambda: Tied(tie=False)),
}


@pytest.mark.parametrize("case", STATE_READ_BY_THE_FORWARD)
def test_state_the_forward_reads_is_never_served_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Change what the forward reads between two processes' worth of wrappers: the second
    traces another graph, misses, and matches PyTorch (outputs, gradients)."""
    first, changed = STATE_READ_BY_THE_FORWARD[case](monkeypatch)
    assert _run(first, tmp_path).disk == ("miss",)
    assert _run(changed(), tmp_path).disk == ("miss",), case
    assert len(_entries(tmp_path)) == 2


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2


class WithFunction(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Double.apply(super().forward(x))  # type: ignore[no-any-return]


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.lin(x))))


class Branches(Net):
    """Branches on a tensor's values: the tracer bakes the branch it took into the graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * 2 if bool(x.sum() > 0) else y


class CountsCalls(Net):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # Python state: set while traced, as without a cache
        return super().forward(x)


@pytest.mark.parametrize("make", [Net, BatchNormNet, WithFunction, Branches, CountsCalls])
def test_a_hit_serves_what_the_passes_produce_now(
    tmp_path: Path, make: Callable[[], nn.Module]
) -> None:
    """With a cache hit, ORT gets exactly the graph and record it gets with no cache at all
    (PythonOps, BatchNorm's statistics, baked branches and traced writes included)."""
    assert _run(make(), tmp_path).disk == ("miss",)
    hit = _run(make(), tmp_path)
    fresh = _run(make(), "")
    assert (hit.disk, fresh.disk) == (("hit",), ())
    assert hit.info == fresh.info
    assert hit.info.model == fresh.info.model


def test_batchnorm_is_cached_without_a_false_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A BatchNorm model (whose export replaces its forward on the instance) draws no WARNING
    about attributes the forward sets, and is stored and served; its running statistics move
    as in PyTorch (checked in _run)."""
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        assert _run(BatchNormNet(), tmp_path).disk == ("miss",)
        assert _run(BatchNormNet(), tmp_path).disk == ("hit",)
    assert not [r.getMessage() for r in caplog.records]
    assert len(_entries(tmp_path)) == 1


def test_a_branch_taken_otherwise_misses(tmp_path: Path) -> None:
    """A branch on tensor values is baked into the trace; inputs that take the other branch
    trace another graph, which misses and is right."""
    x = torch.ones(5, 4)
    assert _run(Branches(), tmp_path, x=x).disk == ("miss",)
    assert _run(Branches(), tmp_path, x=x).disk == ("hit",)
    assert _run(Branches(), tmp_path, x=-x).disk == ("miss",)


def test_the_forward_python_runs_on_a_hit(tmp_path: Path) -> None:
    """A hit still traces, so the exporting call's Python effects (an attribute the forward
    sets) happen as without a cache."""
    cold, warm = CountsCalls(), CountsCalls()
    assert _run(cold, tmp_path).disk == ("miss",)
    assert _run(warm, tmp_path).disk == ("hit",)
    assert warm.calls == cold.calls >= 1


def test_forward_hooks_are_traced_and_keyed(tmp_path: Path) -> None:
    """What a forward hook computes is in the traced graph: another hook misses."""
    model = Net()
    model.a.register_forward_hook(lambda m, i, o: o * 3)
    assert _run(model, tmp_path).disk == ("miss",)
    other = Net()
    other.a.register_forward_hook(lambda m, i, o: o * 4)
    assert _run(other, tmp_path).disk == ("miss",)


def test_custom_function_graph_is_cached_but_not_its_gradient(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A graph with PythonOps is served (its nodes name the Function this process traced),
    but ORT's gradient build of it, which may call the Function's Python, is not cached: the
    log says why."""
    caplog.set_level(logging.INFO, logger="ortfx")
    options = {"log_level": ortfx.LogLevel.INFO}
    assert _run(WithFunction(), tmp_path, **options).disk == ("miss",)
    ran = _run(WithFunction(), tmp_path, **options)
    assert (ran.disk, ran.gradient) == (("hit",), ())
    assert any(
        "export cache: ORT's gradient graph not cached: the graph calls Python (PythonOp nodes)"
        in r.getMessage()
        for r in caplog.records
    )


# ---- entries are data, never code --------------------------------------------------------------


class _Payload:
    """Unpickling this creates a directory: what a crafted pickle entry would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


def _with_checksum(header: bytes, payload: bytes) -> bytes:
    return header + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


@pytest.mark.parametrize(
    "craft",
    [
        lambda pickled: pickled,  # a bare pickle
        lambda pickled: _with_checksum(b"ortfx-export-cache 2\n", pickled),  # the old format
        lambda pickled: _with_checksum(disk_cache.FORMAT, pickled),  # this format's header
    ],
)
def test_a_crafted_pickle_entry_is_never_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, craft: Callable[[bytes], bytes]
) -> None:
    """A pickle under the expected name (with the old or the current header, its checksum
    right) is refused with a WARNING, never unpickled; the graph is processed again and the
    entry replaced by a good one."""
    cache, marker = tmp_path / "cache", tmp_path / "ran"
    _run(Net(), cache)
    for path in cache.iterdir():
        path.write_bytes(craft(pickle.dumps(_Payload(marker))))
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        ran = _run(Net(), cache)
    assert not marker.exists()
    assert (ran.disk, ran.gradient) == (("miss",), ("miss",))
    unreadable = [r.getMessage() for r in caplog.records if "ignoring unreadable" in r.getMessage()]
    assert len(unreadable) == 2 and all(r.levelno == logging.WARNING for r in caplog.records)
    again = _run(Net(), cache)
    assert (again.disk, again.gradient) == (("hit",), ("hit",))


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda data: data[: len(data) // 2], "checksum mismatch"),  # truncated
        (lambda data: data[:-10] + b"0123456789", "checksum mismatch"),  # bytes changed
        (lambda data: b"garbage", "not an ortfx cache file of this format"),
    ],
)
def test_damaged_entry_warns_and_is_built_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Any, why: str
) -> None:
    """A damaged entry (processed graph or gradient) is ignored with a WARNING naming it and
    why; the call is correct and the entry is replaced with a good one."""
    _run(Net(), tmp_path)
    paths = sorted(tmp_path.iterdir())
    for path in paths:
        path.write_bytes(damage(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        assert _run(Net(), tmp_path).disk == ("miss",)
    messages = [r.getMessage() for r in caplog.records]
    for path in paths:
        assert f"export cache: ignoring unreadable entry {path} ({why}); building it again" in (
            messages
        )
    again = _run(Net(), tmp_path)
    assert (again.disk, again.gradient) == (("hit",), ("hit",))


def test_an_entry_under_another_graphs_name_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A whole, well-formed entry copied under the name of another graph's entry is refused
    (it names the digest it was stored for), with a WARNING."""
    _run(Net(), tmp_path)
    (net,) = _entries(tmp_path)
    _run(Scaled(), tmp_path)
    (scaled,) = [p for p in _entries(tmp_path) if p != net]
    scaled.write_bytes(net.read_bytes())
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        assert _run(Scaled(), tmp_path).disk == ("miss",)
    assert any("an entry for another graph" in r.getMessage() for r in caplog.records)


# ---- the directory: only this user may write it ------------------------------------------------


@pytest.mark.parametrize(("mode", "problem"), [(0o770, "its group"), (0o707, "every user")])
def test_a_directory_others_can_write_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int, problem: str
) -> None:
    """A group- or world-writable directory is neither read nor written, with one WARNING
    (even when it holds the right entries): the cache is off, the calls are right."""
    cache = tmp_path / "cache"
    _run(Net(), cache)
    stored = sorted(cache.iterdir())
    cache.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        first, second = _run(Net(), cache), _run(Scaled(), cache)
    assert (first.disk, first.gradient, second.disk) == (("untrusted",),) * 3
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"export cache off: the directory {cache} is writable by {problem}")
    assert sorted(cache.iterdir()) == stored


def test_a_directory_owned_by_another_user_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check refuses another owner (a stat result as the check's input); and a process
    that is not the directory's owner (its user id simulated) turns the cache off."""
    status = os.stat_result((0o40700, 0, 0, 2, 1234, 1234, 0, 0, 0, 0))
    assert disk_cache.refusal(status, 1234) == ""
    assert disk_cache.refusal(status, 1000) == (
        "is owned by another user (uid 1234, this process runs as uid 1000)"
    )
    cache = tmp_path / "cache"
    _run(Net(), cache)
    monkeypatch.setattr(os, "geteuid", lambda: cache.stat().st_uid + 1)
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        assert _run(Net(), cache).disk == ("untrusted",)
    assert any("is owned by another user" in r.getMessage() for r in caplog.records)


def test_an_entry_others_can_write_is_refused_and_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry file its group may write (in a directory only this user writes) is ignored with
    a WARNING and replaced by one only this user can write."""
    _run(Net(), tmp_path)
    (entry,) = _entries(tmp_path)
    entry.chmod(0o664)
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        assert _run(Net(), tmp_path).disk == ("miss",)
    assert any(
        f"ignoring unreadable entry {entry} (the file is writable by its group" in r.getMessage()
        for r in caplog.records
    )
    assert entry.stat().st_mode & 0o077 == 0
    assert _run(Net(), tmp_path).disk == ("hit",)


def test_a_missing_directory_is_created_for_this_user_only(tmp_path: Path) -> None:
    """The directory is made on first store, readable and writable by this user alone, even
    under a umask that would let the group write."""
    cache = tmp_path / "made"
    old = os.umask(0o002)
    try:
        assert _run(Net(), cache).disk == ("miss",)
    finally:
        os.umask(old)
    assert cache.stat().st_mode & 0o777 == 0o700
    assert _run(Net(), cache).disk == ("hit",)


def test_environment_variable_sets_the_directory(tmp_path: Path) -> None:
    options = ortfx.Options.from_env(environ={"ORTMODULE_CACHE_DIR": str(tmp_path)})
    assert options.cache_dir == str(tmp_path)
    with pytest.raises(ValueError, match="must be a directory"):
        ortfx.Options(cache_dir=__file__)
    assert os.path.isdir(tmp_path)


def test_every_record_field_round_trips_as_plain_data() -> None:
    """Each field of the processed record (but the bytes and the call's structures, which come
    from this process's trace) survives JSON; the decoder builds only ortfx's records."""
    from ortfx.model_info import InputKind, InputSpec, Update

    names = {f.name for f in attrs.fields(PostExportProcessedModelInfo)}
    assert names - disk_cache._RECORD_FIELDS == {"model", "input_schema", "output_schema"}
    values = (
        (InputSpec("x", InputKind.USER, 0, True), InputSpec("w", InputKind.PARAMETER, "a.w")),
        frozenset({"args[1]", "*"}),
        (Update("state", "bn.running_mean"), Update("input", 2)),
        ((0, 1),),
        float("nan"),
        None,
    )
    for value in values:
        decoded = disk_cache._decode(disk_cache._encode(value))
        assert type(decoded) is type(value)
        assert decoded == value or (value != value and decoded != decoded)  # nan
    with pytest.raises(KeyError):
        disk_cache._decode({"record": "Popen", "fields": {}})
    with pytest.raises(disk_cache.Uncacheable):
        disk_cache._encode(object())


class TokenMean(Net):
    """A token-normalised loss: ``float(mask.sum())`` is a guarded value of the graph."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (super().forward(x).sum(-1) * mask).sum() / float(mask.sum())


def test_a_guarded_graph_from_disk_still_checks_its_guards(tmp_path: Path) -> None:
    """An entry holds its guards (plain data): a warm wrapper served the entry computes another
    mask's call right (re-export, a disk miss for the new trace), as eager does (atol 1e-5)."""
    torch.manual_seed(0)
    model = TokenMean()
    x = torch.randn(6, 4)
    full, half = torch.ones(6), torch.tensor([1.0, 1, 1, 0, 0, 0])
    options = ortfx.Options(cache_dir=str(tmp_path))
    with events.recording() as cold:
        ortfx.ORTModule(copy.deepcopy(model), options=options)(x, full).backward()
    warm_module = copy.deepcopy(model)
    warm = ortfx.ORTModule(warm_module, options=options)
    with events.recording() as seen:
        outs = [warm(x, mask) for mask in (full, half, full)]
    disk = [e[1][0] for e in seen if e[0] == "disk_cache"]
    assert [e[1][0] for e in cold if e[0] == "disk_cache"] == ["miss"]
    assert disk == ["hit", "miss"]  # the half mask's graph traced anew; back to full: in memory
    for out, mask in zip(outs, (full, half, full), strict=True):
        torch.testing.assert_close(out, model(x, mask), rtol=0, atol=1e-5)
