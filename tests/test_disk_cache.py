"""The persistent export cache (``Options(cache_dir=...)``, ``ORTMODULE_CACHE_DIR``).

A warm process serves the graph from disk (no export) and trains exactly as a cold one; train
and eval never share an entry; anything that changes the graph misses; damaged entries warn and
re-export; concurrent writers leave a whole entry.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import ortfx
from ortfx.runtime import disk_cache, events
from ortfx.runtime.logs import wrapper_log

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 240


def _worker(cache_dir: Path, out: Path, which: str = "block") -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tests.cache_worker", str(cache_dir), str(out), which]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen[bytes]) -> None:
    output, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, output.decode()[-3000:]


def _disk_events(seen: list[tuple[str, tuple[object, ...]]]) -> list[str]:
    return [args[0] for name, args in seen if name == "disk_cache"]  # type: ignore[misc]


def _exports(seen: list[tuple[str, tuple[object, ...]]]) -> int:
    return sum(name == "export" for name, _ in seen)


def test_warm_process_skips_export_and_trains_identically(tmp_path: Path) -> None:
    """A fresh process with a filled cache exports nothing and gives the cold run's outputs
    and gradients bit for bit; training and eval each have their own entry."""
    cache = tmp_path / "cache"
    _finish(_worker(cache, tmp_path / "cold.pt"))
    _finish(_worker(cache, tmp_path / "warm.pt"))
    cold = torch.load(tmp_path / "cold.pt")
    warm = torch.load(tmp_path / "warm.pt")
    assert cold["exports"] == 2  # training and eval
    assert [kind for kind, _ in cold["disk"]] == ["miss", "miss"]
    assert warm["exports"] == 0
    assert [kind for kind, _ in warm["disk"]] == ["hit", "hit"]
    train_path, eval_path = (path for _, path in warm["disk"])
    assert train_path != eval_path and "-train-" in train_path and "-eval-" in eval_path
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        Path(p).name for p in (train_path, eval_path)
    )
    for a, b in zip(cold["outputs"], warm["outputs"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert cold["grads"].keys() == warm["grads"].keys()
    for name, grad in cold["grads"].items():
        torch.testing.assert_close(warm["grads"][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("which", ["gpt2", "index_add"])
def test_warm_process_hugging_face_model_and_aten_ops(tmp_path: Path, which: str) -> None:
    """A transformers model is cached too: its output type (a ``ModelOutput``) is registered
    in the warm process before the entry's specs load, and the values transformers' mask code
    computes from sizes (tracer warnings in an installed library) do not refuse the entry,
    since the in-memory cache reuses such graphs for every size as well. A graph with ops run
    by torch (ATen nodes) gets its executor and gradient definitions in the warm process, which
    never exported."""
    cache = tmp_path / "cache"
    _finish(_worker(cache, tmp_path / "cold.pt", which))
    _finish(_worker(cache, tmp_path / "warm.pt", which))
    cold = torch.load(tmp_path / "cold.pt")
    warm = torch.load(tmp_path / "warm.pt")
    assert [kind for kind, _ in cold["disk"]] == ["miss", "miss"]
    assert (warm["exports"], [kind for kind, _ in warm["disk"]]) == (0, ["hit", "hit"])
    for a, b in zip(cold["outputs"], warm["outputs"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name, grad in cold["grads"].items():
        torch.testing.assert_close(warm["grads"][name], grad, rtol=0, atol=0, msg=name)


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
    cold = torch.load(tmp_path / "cold0.pt")
    assert warm["exports"] == 0
    for a, b in zip(cold["outputs"], warm["outputs"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_threads_storing_and_loading_never_see_a_partial_entry(tmp_path: Path) -> None:
    """store() replaces atomically: readers racing eight writers load a whole entry or none."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    wrapped = ortfx.ORTModule(model, options=ortfx.Options(cache_dir=str(tmp_path)))
    with events.recording():
        wrapped(torch.randn(2, 3))
    (path,) = tmp_path.iterdir()
    log = wrapper_log(ortfx.LogLevel.WARNING)
    entry = disk_cache.load(path, log)
    assert entry is not None
    loaded: list[disk_cache.Entry | None] = []

    def write() -> None:
        for _ in range(20):
            disk_cache.store(path, entry, log)

    def read() -> None:
        for _ in range(40):
            loaded.append(disk_cache.load(path, log))

    threads = [threading.Thread(target=write) for _ in range(8)] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert loaded and all(e == entry for e in loaded)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


class Net(nn.Module):
    def __init__(self, width: int = 8, slope: float = 0.1) -> None:
        super().__init__()
        self.a = nn.Linear(4, width)
        self.act = nn.LeakyReLU(slope)
        self.b = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


class Scaled(Net):
    """Same parameters as Net, another forward: the class is part of the key."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def _run(
    model: nn.Module, cache: Path, *, train: bool = True, **options: object
) -> tuple[list[str], int, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(5, 4)
    wrapped = ortfx.ORTModule(model, options=ortfx.Options(cache_dir=str(cache), **options))  # type: ignore[arg-type]
    wrapped.train(train)
    with events.recording() as seen:
        y = wrapped(x)
    torch.testing.assert_close(y, model(x))
    return _disk_events(seen), _exports(seen), y


@pytest.mark.parametrize(
    ("name", "variant"),
    [
        ("parameter shape", lambda: (Net(width=9), {})),
        ("module class", lambda: (Scaled(), {})),
        ("module attribute", lambda: (Net(slope=0.2), {})),
        ("requires_grad", lambda: (Net().requires_grad_(False), {})),
        ("opset", lambda: (Net(), {"opset_version": 18})),
        ("eval mode", lambda: (Net(), {"train": False})),
    ],
)
def test_what_changes_the_graph_misses(tmp_path: Path, name: str, variant: object) -> None:
    """A module or option that differs in anything the export reads gets its own entry."""
    assert _run(Net(), tmp_path)[:2] == (["miss"], 1)
    assert _run(Net(), tmp_path)[:2] == (["hit"], 0)  # same key: served from disk
    model, options = variant()  # type: ignore[operator]
    train = options.pop("train", True)
    assert _run(model, tmp_path, train=train, **options)[:2] == (["miss"], 1), name
    assert len(list(tmp_path.iterdir())) == 2


def test_a_call_under_autocast_is_not_served_the_float32_graph(tmp_path: Path) -> None:
    """The autocast dtype is in the digest: a graph traced without autocast's casts is never
    loaded for a call under torch.autocast (which then falls back on CPU, as without a cache)."""
    assert _run(Net(), tmp_path)[:2] == (["miss"], 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen, exports, y = _run(Net(), tmp_path)
    assert "hit" not in seen and exports == 1
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # truncated
        lambda data: data[:-10] + b"0123456789",  # bytes changed: checksum
        lambda data: b"garbage",
    ],
)
def test_damaged_entry_warns_and_exports_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: object
) -> None:
    """A damaged entry is ignored with a WARNING naming it; the call exports, is correct, and
    replaces the entry with a good one."""
    _run(Net(), tmp_path)
    (path,) = tmp_path.iterdir()
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        assert _run(Net(), tmp_path)[:2] == (["miss"], 1)
    assert any(
        "ignoring unreadable entry" in r.message and path.name in r.message for r in caplog.records
    )
    assert _run(Net(), tmp_path)[:2] == (["hit"], 0)


def test_forward_hook_is_not_cached(tmp_path: Path) -> None:
    """A forward hook's code is not in the key: such a module is exported every time."""
    model = Net()
    model.a.register_forward_hook(lambda m, i, o: o * 3)
    assert _run(model, tmp_path)[:2] == ([], 1)
    assert not list(tmp_path.iterdir())


def test_custom_function_graph_is_not_stored(tmp_path: Path) -> None:
    """A graph with PythonOps names Python code the digest does not cover: not stored."""

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    class WithFunction(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Double.apply(self.lin(x))  # type: ignore[no-any-return]

    assert _run(WithFunction(), tmp_path)[:2] == (["miss"], 1)
    assert not list(tmp_path.iterdir())


class Branches(nn.Module):
    """Branches on a tensor's values in the user's own code: the tracer bakes the branch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if bool(y.sum() > -1e9) else y


class ReturnsSize(nn.Module):
    """Returns a Python number taken from a tensor: the graph is pinned to its sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.lin(x), int(x.shape[0])


class CountsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # Python state: a warm start would never run it
        return self.lin(x)


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (Branches, "the tracer baked in a branch on tensor values"),
        (ReturnsSize, "the graph returns Python numbers computed from tensors"),
        (CountsCalls, "the forward sets attributes of its modules"),
    ],
)
def test_values_from_this_runs_tensors_are_not_stored(
    tmp_path: Path, model: type[nn.Module], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What the tracer took from this run's tensor values is not in the key: not stored, and
    the log says why."""
    caplog.set_level(logging.INFO, logger="ortfx")
    torch.manual_seed(0)
    options = ortfx.Options(cache_dir=str(tmp_path), log_level=ortfx.LogLevel.INFO)
    wrapped = ortfx.ORTModule(model(), options=options)
    with events.recording() as seen:
        wrapped(torch.randn(5, 4))
    assert (_disk_events(seen), _exports(seen)) == (["miss"], 1)
    assert not list(tmp_path.iterdir())
    assert any(f"export cache not used: {why}" in r.getMessage() for r in caplog.records)


def test_environment_variable_sets_the_directory(tmp_path: Path) -> None:
    options = ortfx.Options.from_env(environ={"ORTMODULE_CACHE_DIR": str(tmp_path)})
    assert options.cache_dir == str(tmp_path)
    with pytest.raises(ValueError, match="must be a directory"):
        ortfx.Options(cache_dir=__file__)
    assert os.path.isdir(tmp_path)
