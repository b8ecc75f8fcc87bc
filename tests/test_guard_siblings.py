"""Siblings of the guards found by a red-team pass (issue 27): conversions the watch did not
see (torch.equal, torch.allclose, ``in``, format, NumPy's ``__array__``, complex), a torch
module wrapped directly (its own mask check), a branch on a random draw (refused), a value
read before the forward changes its tensor in place, and outside state reached other ways (a
list of tensors, class-level containers and tensors, a classmethod, a local alias of a config,
a helper object, a swapped ``__class__``). Each compares with eager (1e-5) and failed before.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ortfx
from tests.models import max_diff

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
TOL = 1e-5


def _calls_match(model: nn.Module, calls: list[tuple[Any, ...]], change: Any = None) -> int:
    """Each call through ortfx and through an eager copy (``change`` applied to both before
    the second call) gives the same output; returns the number of exports."""
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model, options=STRICT)
    for k, args in enumerate(calls):
        if change is not None and k == 1:
            change(model)
            change(reference)
        with torch.no_grad():
            got, expected = wrapped(*args), reference(*args)
        assert max_diff(got, expected) <= TOL, k
    return ortfx.stats(wrapped).exports


class Equal(nn.Module):
    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        a = x * 2 if torch.equal(m, torch.ones_like(m)) else x - 100
        b = a * 0 if -100 in m else a
        return b * float(np.asarray(m.sum())) + int(f"{m.sum():.0f}")


class AllClose(nn.Module):
    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        if torch.allclose(m, torch.ones_like(m)):
            return x * 2
        return x * complex(m.sum()).real


@pytest.mark.parametrize("make", [Equal, AllClose])
def test_conversions_through_torch_functions_and_dunders_are_guarded(
    make: Callable[[], nn.Module],
) -> None:
    x = torch.ones(2)
    calls = [(x, torch.ones(2)), (x, torch.tensor([-100.0, 3.0])), (x, torch.ones(2))]
    assert _calls_match(make(), calls) == 2


def test_a_torch_module_wrapped_directly_guards_its_own_checks() -> None:
    """nn.TransformerEncoder checks whether its mask is causal (``bool((m == causal).all())``)
    in torch's own code: wrapped directly, that value is guarded as inside a user module."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    reference = copy.deepcopy(encoder)
    wrapped = ortfx.ORTModule(encoder, options=STRICT)
    x = torch.randn(1, 4, 8)
    for mask in (nn.Transformer.generate_square_subsequent_mask(4), torch.zeros(4, 4)):
        assert max_diff(wrapped(x, mask=mask), reference(x, mask=mask)) <= TOL
    assert ortfx.stats(wrapped).exports == 2


class StochasticDepth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.rand([]) < 0.5:
            return x
        return self.lin(x)


def test_a_value_taken_from_a_random_draw_is_refused() -> None:
    """No check after the run can redraw as eager does: refused (typed), and under the
    default policy every call runs in PyTorch, skipping about half the time as eager."""
    with pytest.raises(ortfx.OrtfxExportError, match="takes a Python value from a random draw"):
        ortfx.ORTModule(StochasticDepth(), options=STRICT)(torch.randn(2, 4))
    wrapped = ortfx.ORTModule(StochasticDepth())
    x = torch.randn(2, 4)
    skipped = sum(bool(torch.equal(wrapped(x), x)) for _ in range(60))
    assert 10 < skipped < 50
    assert ortfx.stats(wrapped).fallback_calls == 60


class Breaker(nn.Module):
    """Trips on a large input and stays tripped until reset: the flag is read, then set."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("tripped", torch.tensor(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tripped or x.abs().max() > 100:
            self.tripped.fill_(1.0)
            return x * 0
        return x


def test_a_value_is_guarded_as_read_before_the_forward_changes_it() -> None:
    model, reference = Breaker(), Breaker()
    wrapped = ortfx.ORTModule(model, options=STRICT)
    with torch.no_grad():
        for k, x in enumerate([torch.ones(2), torch.full((2,), 1e3), torch.ones(2), torch.ones(2)]):
            if k == 3:
                model.tripped.fill_(0.0)
                reference.tripped.fill_(0.0)
            assert max_diff(wrapped(x), reference(x)) <= TOL, k
            assert float(model.tripped) == float(reference.tripped), k


class Anchors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.anchors = [torch.ones(3), torch.ones(3)]  # a list of tensors (no buffers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.anchors[1]


class ClassLevel(nn.Module):
    CFG: dict[str, float] = {"a": 2.0}  # noqa: RUF012 - the class-level state under test
    TABLE = torch.full((1,), 2.0)
    K = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    @classmethod
    def k(cls) -> float:
        return cls.K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.CFG["a"] * self.TABLE * self.k()


class Config:
    scale = 2.0


class Alias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.cfg = Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        return self.lin(x) * cfg.scale


class Scaler:
    def __init__(self, k: float) -> None:
        self.k = k

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


class Helper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.act = Scaler(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))  # type: ignore[no-any-return]


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)  # type: ignore[no-any-return]


class Five(Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 5  # type: ignore[no-any-return]


def _restore_class_level() -> None:
    ClassLevel.CFG["a"], ClassLevel.K = 2.0, 2.0
    ClassLevel.TABLE.fill_(2.0)


CHANGES: dict[str, tuple[Callable[[], nn.Module], Callable[[Any], None]]] = {
    "a tensor in a list, changed in place": (Anchors, lambda m: m.anchors[1].mul_(3)),
    "a class-level dict changed in place": (
        ClassLevel,
        lambda m: ClassLevel.CFG.__setitem__("a", 5.0),
    ),
    "a class-level tensor changed in place": (ClassLevel, lambda m: ClassLevel.TABLE.fill_(5.0)),
    "a class attribute read by a classmethod": (
        ClassLevel,
        lambda m: setattr(ClassLevel, "K", 5.0),
    ),
    "a config read through a local alias": (Alias, lambda m: setattr(m.cfg, "scale", 5.0)),
    "a helper object's attribute": (Helper, lambda m: setattr(m.act, "k", 5.0)),
    "the module's class swapped": (Plain, lambda m: setattr(m, "__class__", Five)),
}


@pytest.mark.parametrize("case", CHANGES)
def test_outside_state_reached_other_ways_is_guarded(case: str) -> None:
    make, change = CHANGES[case]
    _restore_class_level()
    try:
        x = torch.randn(2, 2 if make is not Anchors else 3)
        assert _calls_match(make(), [(x,), (x,)], change=change) == 2
    finally:
        _restore_class_level()


class Threshold(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = float(x.max())
        return x / v if v > 1.0 else x * 10


def test_floats_a_hair_apart_on_two_sides_of_a_branch() -> None:
    """A float guard is compared exactly (against ORT's own value for the data it was traced
    from): 0.999999 and 1.000001 take different branches, as in eager; the same data again
    reuses its graph."""
    calls = [(torch.tensor([0.5, top]),) for top in (0.999999, 1.000001, 0.999999, 1.000001)]
    assert _calls_match(Threshold(), calls) == 2


class TokenMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).squeeze(-1)
        return h.sum() / float(h.abs().sum() + 1)  # a float ORT sums in its own order


def test_a_float_orts_rounding_differs_on_is_one_graph_per_data() -> None:
    """Where ORT's float differs from PyTorch's in the last bits, the same data served again
    reuses the graph (keyed by ORT's value), with no export per call."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    assert _calls_match(TokenMean(), [(x,)] * 4) == 1
