"""Random small modules whose forward takes Python values from tensors (branches on values,
numbers from ``.item()``/``float``, counts from ``int``, slicing, loops), called with random
inputs that move those values around: every call's output and every parameter gradient must
match PyTorch's (1e-5 absolute), whatever graphs ortfx kept from earlier calls. A graph that
served a call it did not trace shows up as a difference here.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ortfx
from tests.models import backward_both_and_compare

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE, cache_size=16)
WIDTH = 4


class Step(nn.Module):
    """One layer and one use of a value taken from a tensor."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        h = self.lin(h)
        if self.kind == "branch":
            return torch.relu(h) if h.mean() > 0 else torch.tanh(h)
        if self.kind == "scale":
            return h / max(1.0, float(h.abs().max()))
        if self.kind == "slice":
            return torch.cat([h[:, : int(n)] * 2, h[:, int(n) :]], dim=1)
        if self.kind == "loop":
            for _ in range(int(n)):
                h = h * 0.9
            return h
        if self.kind == "item":
            return h * float(h.sum().item() > 0.5)
        return h  # "none"


class Stack(nn.Module):
    def __init__(self, kinds: list[str]) -> None:
        super().__init__()
        self.steps = nn.ModuleList(Step(k) for k in kinds)

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            x = step(x, n)
        return x


KINDS = ["branch", "scale", "slice", "loop", "item", "none"]


@settings(max_examples=25, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=3),
    calls=st.lists(
        st.tuples(st.floats(-2.0, 2.0), st.integers(0, WIDTH), st.integers(0, 2**16)),
        min_size=2,
        max_size=4,  # at most 4 values per location: within MAX_GUARD_VALUES, all in ORT
    ),
    seed=st.integers(0, 2**16),
)
def test_every_call_matches_pytorch_whatever_graphs_were_kept(
    kinds: list[str], calls: list[tuple[float, int, int]], seed: int
) -> None:
    torch.manual_seed(seed)
    model = Stack(kinds)
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model, options=STRICT)
    for shift, n, data_seed in calls:
        x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(data_seed)) + shift
        count = torch.tensor(n)
        got, expected = wrapped(x, count), reference(x, count)
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), (kinds, shift, n)
        backward_both_and_compare(got, expected, model, reference, where=(kinds, shift, n))
    assert ortfx.stats(wrapped).fallback_calls == 0
