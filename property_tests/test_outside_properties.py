"""Random small modules whose forward reads state outside its arguments (a module global, a
private attribute, a class attribute, an environment variable, a config object's field, a
global list) besides values it takes from tensors; between calls, random changes of that state
and random inputs. Every call's output and every parameter gradient must match PyTorch's (1e-5
absolute), whatever graphs ortfx kept: a graph reused after a change it did not see shows up
as a difference here.
"""

from __future__ import annotations

import copy
import os
import sys
import types

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ortfx
from tests.models import backward_both_and_compare

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE, cache_size=16)
WIDTH = 4
GAIN = 1.0
FACTORS = [1.0, 1.0]
THIS = sys.modules[__name__]
VARIABLE = "ORTFX_PROPERTY_SHIFT"


class Step(nn.Module):
    """One layer, one read of outside state and, maybe, one value taken from a tensor."""

    bias = 0.0  # a class attribute

    def __init__(self, reads: str, baked: bool) -> None:
        super().__init__()
        self.reads, self.baked = reads, baked
        self.lin = nn.Linear(WIDTH, WIDTH)
        self._scale = 1.0
        self.config = types.SimpleNamespace(power=1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.lin(h)
        if self.reads == "global":
            h = h * GAIN
        elif self.reads == "private":
            h = h * self._scale
        elif self.reads == "class":
            h = h + self.bias
        elif self.reads == "environ":
            h = h + float(os.environ.get(VARIABLE, "0"))
        elif self.reads == "config":
            h = h**self.config.power
        elif self.reads == "list":
            h = h * FACTORS[1]
        if self.baked:
            h = torch.relu(h) if h.mean() > 0 else torch.tanh(h)
        return h


class Stack(nn.Module):
    def __init__(self, steps: list[tuple[str, bool]]) -> None:
        super().__init__()
        self.steps = nn.ModuleList(Step(r, b) for r, b in steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            x = step(x)
        return x


READS = ["global", "private", "class", "environ", "config", "list", "none"]
CHANGES = ["global", "private", "class", "environ", "config", "list", "nothing"]


def _change(kind: str, value: int, models: list[Stack]) -> None:
    """The same change applied to the wrapped model and to the eager reference."""
    if kind == "global":
        THIS.GAIN = 1.0 + value / 4
    elif kind == "class":
        Step.bias = value / 8
    elif kind == "environ":
        os.environ[VARIABLE] = str(value / 8)
    elif kind == "list":
        FACTORS[1] = 1.0 - value / 8
    for model in models:
        for step in model.steps:
            if kind == "private":
                step._scale = 1.0 + value / 4
            elif kind == "config":
                step.config.power = 1 + value % 2


@settings(max_examples=25, deadline=None)
@given(
    steps=st.lists(st.tuples(st.sampled_from(READS), st.booleans()), min_size=1, max_size=3),
    calls=st.lists(
        st.tuples(st.sampled_from(CHANGES), st.integers(0, 3), st.floats(-1.0, 1.0)),
        min_size=2,
        max_size=5,
    ),
    seed=st.integers(0, 2**16),
)
def test_every_call_matches_pytorch_after_outside_changes(
    steps: list[tuple[str, bool]], calls: list[tuple[str, int, float]], seed: int
) -> None:
    THIS.GAIN, Step.bias, FACTORS[1] = 1.0, 0.0, 1.0
    os.environ[VARIABLE] = "0"
    try:
        torch.manual_seed(seed)
        model = Stack(steps)
        reference = copy.deepcopy(model)
        wrapped = ortfx.ORTModule(model, options=STRICT)
        for k, (kind, value, shift) in enumerate(calls):
            if k:
                _change(kind, value, [model, reference])
            x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(seed + k)) + shift
            got, expected = wrapped(x), reference(x)
            # relative too: three squarings (config.power = 2) reach magnitudes of 30, where
            # float32 rounding of MLAS's and torch's sums differs by 2e-5
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            backward_both_and_compare(
                got, expected, model, reference, rtol=1e-5, where=k, zeros_for_none=True
            )
    finally:
        THIS.GAIN, Step.bias, FACTORS[1] = 1.0, 0.0, 1.0
        os.environ.pop(VARIABLE, None)
