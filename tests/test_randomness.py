"""Random streams through ortfx.

An export draws from no stream of the user's (torch's default generators, a module's own
``torch.Generator``, one given to an op, Python's and numpy's); ORT's random nodes (Dropout,
``torch.rand``, ...) are seeded from torch's state so that the same torch seed gives the same
numbers, run to run, and a new session (a re-process) or the convergence hooks never repeat or
shift a stream.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ortfx
from ortfx.export import rewrites
from ortfx.hooks import GlobalSubscriberManager, StatisticsSubscriber

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
