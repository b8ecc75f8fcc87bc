"""The shell's fast path compares a cheap signature instead of building the call: equal
signatures must mean equal calls, or a steady loop would run a graph built for another call."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ortfx import io
from ortfx.options import Options
from ortfx.transitions import CallContext, ModuleVersion, make_call, signature

# Small domains, so that equal signatures come up often; each value stands for a trap.
STATICS: tuple[Any, ...] = (True, 1, 1.0, 0.0, -0.0, math.nan, "a", "1", None, 2, False, 0)


@st.composite
def leaves(draw: st.DrawFn) -> Any:
    if draw(st.booleans()):
        return draw(st.sampled_from(STATICS))
    dtype = draw(st.sampled_from((torch.float32, torch.float64, torch.int64)))
    shape = draw(st.lists(st.integers(1, 3), max_size=2))
    t = torch.zeros(shape, dtype=dtype)
    if dtype.is_floating_point and draw(st.booleans()):
        t.requires_grad_(True)
    return t


@st.composite
def calls(draw: st.DrawFn) -> tuple[Any, ...]:
    n = draw(st.integers(1, 3))
    args = [draw(leaves()) for _ in range(n)]
    container = draw(st.sampled_from((tuple, list, "dict")))
    tree = {f"k{i}": a for i, a in enumerate(args)} if container == "dict" else container(args)
    return (
        tree,
        draw(st.booleans()),  # training
        draw(st.integers(0, 1)),  # module version
        tuple(draw(st.lists(st.booleans(), min_size=2, max_size=2))),  # params requiring grad
        draw(st.booleans()),  # deterministic
        tuple(draw(st.lists(st.booleans(), min_size=2, max_size=2))),  # submodules' modes
    )


def _flat(tree: Any) -> tuple[list[Any], Any]:
    return io.flatten(io.call_tree((tree,), {}))


SUBMODULES = ("block", "block.bn")


def _call(*drawn: Any) -> Any:
    tree, training, version, params, det, subs = _complete(drawn)
    leaves_, spec = _flat(tree)
    context = CallContext(
        training=training,
        module_version=ModuleVersion(version),
        export_options=Options().export_options("torchscript"),
        versions=("torch", "onnx"),
        param_names=("a", "b"),
        params_requiring_grad=params,
        memory=(0, ""),
        device="cpu",
        deterministic=det,
        other_mode=tuple(n for n, mode in zip(SUBMODULES, subs, strict=True) if mode != training),
    )
    return make_call(leaves_, spec, context)


def _signature(*drawn: Any) -> Any:
    tree, training, version, params, det, subs = _complete(drawn)
    leaves_, spec = _flat(tree)
    return signature(leaves_, spec, training, version, params, det, "cpu", modes=(training, *subs))


def _complete(drawn: tuple[Any, ...]) -> tuple[Any, ...]:
    """(tree, training, module version, params requiring grad, deterministic, submodules'
    modes); the submodules follow the root unless drawn."""
    return drawn if len(drawn) == 6 else (*drawn, (drawn[1], drawn[1]))


@settings(max_examples=400, deadline=None)
@given(calls(), calls())
def test_equal_signature_means_equal_call(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    """For two calls in the same context, signature(a) == signature(b) implies
    make_call(a) == make_call(b) (key, grad state and session key all equal)."""
    if _signature(*a) == _signature(*b):
        assert _call(*a) == _call(*b)


@settings(max_examples=200, deadline=None)
@given(calls())
def test_a_call_has_its_own_signature(a: tuple[Any, ...]) -> None:
    """Signatures are hashable and reflexive (nan included), so a steady loop hits."""
    assert _signature(*a) == _signature(*a)
    hash(_signature(*a))


def test_signature_splits_what_the_schema_splits() -> None:
    """The traps the property's domain is built around, spelled out."""
    for x, y in ((True, 1), (1, 1.0), (0.0, -0.0), ("1", 1), (None, False)):
        assert _signature((x,), True, 0, (True, True), False) != _signature(
            (y,), True, 0, (True, True), False
        )
    t = torch.zeros(2)
    assert _signature((t,), True, 0, (True, True), False) != _signature(
        (t.requires_grad_(),), True, 0, (True, True), False
    )
