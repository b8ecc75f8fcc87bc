"""Random streams through ortfx.

An export draws from no stream of the user's: torch's default generators, a module's own
``torch.Generator``, one given to an op, Python's and numpy's.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ortfx
from ortfx.export import rewrites

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
