"""The shell's fast path compares a cheap signature instead of building the call: equal
signatures must mean equal calls, or a steady loop would run a graph built for another call."""

from __future__ import annotations

import math
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ortfx import io
from ortfx.keys import ModuleVersion
from ortfx.options import Options
from ortfx.runtime.guards import GLOBALS, keyed
from ortfx.transitions import CallContext, make_call, signature

# Small domains, so that equal signatures come up often; each value stands for a trap.
STATICS: tuple[Any, ...] = (True, 1, 1.0, 0.0, -0.0, math.nan, "a", "1", None, 2, False, 0)

# Values each entry of the shell's guard table (ortfx.runtime.guards.GLOBALS) can read; a new
# entry without a domain here fails the test below.
GLOBAL_VALUES: dict[str, tuple[Any, ...]] = {
    "grad_enabled": (True, False),
    "deterministic": (True, False),
    "autocast": (None, "bfloat16", "float16"),
    "default_dtype": (torch.float32, torch.float64),
    "inference_mode": (True, False),
    "functorch_transform": (True, False),
}


def test_every_guard_has_a_domain() -> None:
    assert [g.name for g in GLOBALS] == list(GLOBAL_VALUES)


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
        tuple(draw(st.sampled_from(GLOBAL_VALUES[g.name])) for g in GLOBALS),  # torch's state
        tuple(draw(st.lists(st.booleans(), min_size=2, max_size=2))),  # submodules' modes
    )


def _flat(tree: Any) -> tuple[list[Any], Any]:
    return io.flatten(io.call_tree((tree,), {}))


SUBMODULES = ("block", "block.bn")


def _call(*drawn: Any) -> Any:
    tree, training, version, params, state, subs = _complete(drawn)
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
        other_mode=tuple(n for n, mode in zip(SUBMODULES, subs, strict=True) if mode != training),
        **keyed(state),
    )
    return make_call(leaves_, spec, context)


def _signature(*drawn: Any) -> Any:
    tree, training, version, params, state, subs = _complete(drawn)
    leaves_, spec = _flat(tree)
    return signature(leaves_, spec, training, version, params, "cpu", (training, *subs), state)


# torch's state as a default process reads it: grad on, nothing else set.
DEFAULT_STATE = (True, False, None, torch.float32, False, False)


def _complete(drawn: tuple[Any, ...]) -> tuple[Any, ...]:
    """(tree, training, module version, params requiring grad, torch's global state,
    submodules' modes); the state is the default and the submodules follow the root unless
    drawn."""
    if len(drawn) == 4:
        drawn = (*drawn, DEFAULT_STATE)
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
        assert _signature((x,), True, 0, (True, True)) != _signature((y,), True, 0, (True, True))
    t = torch.zeros(2)
    assert _signature((t,), True, 0, (True, True)) != _signature(
        (t.requires_grad_(),), True, 0, (True, True)
    )
