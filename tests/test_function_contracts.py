"""Custom autograd.Functions (PythonOp) keep eager PyTorch's contracts, or refuse loudly.

Each test runs the same module in plain PyTorch and through ortfx and compares outputs,
gradients, dtypes, ``requires_grad`` and exceptions (type and text); numbers within 1e-6,
relative to the largest magnitude once that exceeds 1. Where ortfx cannot do what eager does,
the test checks the typed ortfx error that names the Function and the argument.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import ortfx
from ortfx.runtime import pythonop
from tests.models import max_diff
from tests.test_pythonop import Scale3Grad

TOL = 1e-6
STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)


def close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    assert a is not None and b is not None
    if not b.is_floating_point():
        return torch.equal(a, b)
    return max_diff(a, b) <= TOL * max(1.0, float(b.detach().abs().max()))


class Body(nn.Module):
    """Linear -> ``body(h, w)`` -> outputs, so gradients cross the Function both ways."""

    def __init__(self, body: Callable[..., Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4))
        self.body = body

    def forward(self, x: torch.Tensor, *extra: Any) -> Any:
        return self.body(self.a(x), self.w, *extra)


def _loss(out: Any) -> torch.Tensor:
    outs = out if isinstance(out, tuple) else (out,)
    return sum(
        ((o.float() * o.float()).sum() for o in outs if o.is_floating_point() and o.requires_grad),
        torch.zeros(()),
    )


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_like_eager(body: Callable[..., Any], *extra: Any, steps: int = 3) -> None:
    """Outputs (values, dtypes, requires_grad) and all gradients equal eager's, every step."""
    model = Body(body)
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model, options=STRICT)
    for step in range(steps):
        x = torch.randn(3, 4)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_a, out_b = wrapped(xa, *extra), reference(xb, *extra)
        flat_a = out_a if isinstance(out_a, tuple) else (out_a,)
        flat_b = out_b if isinstance(out_b, tuple) else (out_b,)
        for oa, ob in zip(flat_a, flat_b, strict=True):
            assert oa.dtype == ob.dtype, (step, oa.dtype, ob.dtype)
            assert oa.requires_grad == ob.requires_grad, (step, oa.requires_grad)
            assert close(oa, ob), ("output", step, max_diff(oa, ob))
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        _loss(out_a).backward()
        _loss(out_b).backward()
        assert pythonop.live_contexts() == 0
        assert close(xa.grad, xb.grad), ("input grad", step)
        for ga, gb in zip(_grads(model), _grads(reference), strict=True):
            assert close(ga, gb), ("parameter grad", step)


# ---- lifetime -----------------------------------------------------------------------------------

_LIVE: list[weakref.ref[Any]] = []


def _watched(ctx: Any, x: torch.Tensor) -> None:
    _LIVE.append(weakref.ref(ctx))
    _LIVE.append(weakref.ref(x))


class SavesOutput(torch.autograd.Function):
    """The activation pattern of the issue: the output saved for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        _watched(ctx, x)
        out = torch.tanh(x + bias)
        ctx.save_for_backward(x, bias, out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _x, _bias, out = ctx.saved_tensors
        grad = g * (1 - out * out)
        return grad, grad.sum(0)


class SavesOutputOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _watched(ctx, x)
        out = torch.sigmoid(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        return g * out * (1 - out)


class SavesInputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _watched(ctx, x)
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * g


class KeepsTensorsOnCtx(torch.autograd.Function):
    """Tensors as ctx attributes: the input, and the output (a cycle in eager too)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _watched(ctx, x)
        out = x.exp()
        ctx.x, ctx.out = x, out
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * ctx.out


def _all_patterns(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = SavesOutput.apply(h, w)
    h = SavesOutputOnly.apply(h) + SavesInputs.apply(h)
    return KeepsTensorsOnCtx.apply(h * 0.1)


def test_a_thousand_steps_keep_no_context_and_no_input_alive() -> None:
    """Fails on the baseline: a Function that saved its own output kept every step's ctx and
    inputs alive (a cycle through the autograd node that gc cannot see): 30 steps, 30 of each.
    Now, after every backward, no ctx and no input of any Function is alive, without a gc pass,
    for outputs saved, inputs saved, both, and tensors kept as ctx attributes."""
    assert_like_eager(_all_patterns, steps=2)
    model = Body(_all_patterns)
    wrapped = ortfx.ORTModule(model, options=STRICT)
    x = torch.randn(3, 4)
    wrapped(x).sum().backward()  # the export (its trace makes eager's cycles, for gc)
    gc.collect()
    _LIVE.clear()
    gc.disable()
    try:
        for step in range(1000):
            wrapped(x).sum().backward()
            if step % 100 == 99:
                alive = [r for r in _LIVE if r() is not None]
                assert not alive, (step, len(alive), len(_LIVE))
                assert pythonop.live_contexts() == 0
        assert len(_LIVE) == 1000 * 4 * 2
    finally:
        gc.enable()
        _LIVE.clear()


# ---- what backward returns ----------------------------------------------------------------------


def _returning(grads: Callable[[torch.Tensor], Any], residual: bool = True) -> Callable[..., Any]:
    class Returns(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return x * w

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> Any:
            return grads(g)

    if residual:
        return lambda h, w: Returns.apply(h, w) + h
    return Returns.apply


ACCEPTED = {
    "extra trailing Nones": lambda g: (g * 2, g.sum(0), None, None),
    "float64 for float32 inputs": lambda g: ((g * 2).double(), g.sum(0).double()),
    "int64 for a float32 input": lambda g: ((g * 2).long(), g.sum(0)),
    "shapes that sum down to the inputs'": lambda g: ((g * 2)[None], g.sum(0, keepdim=True)),
}


@pytest.mark.parametrize("grads", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_backward_values_eager_accepts_train_as_in_eager(
    grads: Callable[[torch.Tensor], Any],
) -> None:
    """Fails on the baseline: each crashed every step (ORT's Gemm_Grad, or a bare
    ``ValueError: zip() ...``)."""
    assert_like_eager(_returning(grads))


REJECTED = {
    "too few": (lambda g: (g * 2,), "incorrect number of gradients (expected 2, got 1)"),
    "a lone tensor": (lambda g: g * 2, "incorrect number of gradients (expected 2, got 1)"),
    "too many": (
        lambda g: (g, g.sum(0), g),
        "incorrect number of gradients (expected 2, got 3)",
    ),
    "not a tensor": (lambda g: (g, 3), "expected Variable or None (got int)"),
    "a wrong shape": (
        lambda g: (g.sum(0), g.sum(0)),
        "invalid gradient at index 0 - got [4] but expected shape compatible with [3, 4]",
    ),
    "a shape that does not sum down": (
        lambda g: (g.sum(0, keepdim=True), g.sum(0)),
        "invalid gradient at index 0 - got [1, 4] but expected shape compatible with [3, 4]",
    ),
}


@pytest.mark.parametrize(("grads", "text"), REJECTED.values(), ids=REJECTED.keys())
def test_backward_values_eager_rejects_raise_eagers_error(
    grads: Callable[[torch.Tensor], Any], text: str
) -> None:
    """Fails on the baseline (a bare zip() ValueError, or ORT's kernel error). Now eager's
    exception type and text, the ctx released, and the wrapper usable afterwards."""
    model = Body(_returning(grads))
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError) as eager:
        reference(x).sum().backward()
    assert text in str(eager.value)
    wrapped = ortfx.ORTModule(model, options=STRICT)
    with pytest.raises(RuntimeError) as ours:
        wrapped(x).sum().backward()
    assert type(ours.value) is type(eager.value)
    assert str(ours.value) == str(eager.value)
    assert pythonop.live_contexts() == 0
    with torch.no_grad():
        assert close(wrapped(x), reference(x))


_NONE_FOR_X = _returning(lambda g: (None, g.sum(0)), residual=False)
NO_GRADIENT: dict[str, Callable[..., Any]] = {
    # the layer before gets no gradient at all: eager leaves its .grad None
    "only path": _NONE_FOR_X,
    # another path gives one
    "residual": lambda h, w: _NONE_FOR_X(h, w) + h,
    # a Function before it (materializing grads, the default) still runs its backward, on
    # zeros: its inputs get zeros
    "behind a Function": lambda h, w: _NONE_FOR_X(Scale3Grad.apply(h), w),
    # no gradient for either input
    "both": _returning(lambda g: (None, None), residual=False),
}


MEM = ortfx.Options(
    fallback_policy=ortfx.FallbackPolicy.DISABLE, enable_mem_efficient_grad_management=True
)


@pytest.mark.parametrize("options", [STRICT, MEM], ids=["default", "mem-efficient gradients"])
@pytest.mark.parametrize("body", NO_GRADIENT.values(), ids=NO_GRADIENT.keys())
def test_none_for_an_input_that_requires_grad_is_no_gradient_as_in_eager(
    body: Callable[..., Any], options: ortfx.Options
) -> None:
    """Fails on the baseline: ORT's Gemm_Grad crashed every step. Eager passes "no gradient"
    on: a tensor reached only through it keeps ``.grad`` None (not zeros: an optimizer skips
    it); one reached otherwise gets eager's gradient, for parameters and the input alike, also
    with parameters fed by memory-efficient gradient management."""
    model = Body(body)
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model, options=options)
    for step in range(2):
        x = torch.randn(3, 4)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        (wrapped(xa) * 3).sum().backward()
        (reference(xb) * 3).sum().backward()
        pairs = [("input", xa.grad, xb.grad)] + [
            (name, pa.grad, pb.grad)
            for (name, pa), (_, pb) in zip(
                model.named_parameters(), reference.named_parameters(), strict=True
            )
        ]
        for name, ga, gb in pairs:
            assert (ga is None) == (gb is None), (step, name, ga, gb)
            assert gb is None or close(ga, gb), (step, name)
    assert pythonop.live_contexts() == 0


# ---- dtypes crossing the Function ---------------------------------------------------------------


class Through(torch.autograd.Function):
    """Records the dtypes it is given; returns its float input scaled and the others as is."""

    seen: ClassVar[list[tuple[torch.dtype, ...]]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *others: torch.Tensor) -> Any:
        Through.seen.append(tuple(o.dtype for o in others))
        return (x * 2, *(o.clone() for o in others))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *rest: Any) -> tuple[torch.Tensor | None, ...]:
        return (g * 3, *(None for _ in rest))


DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float64,
)


def test_every_dtype_reaches_the_function_and_comes_back_as_passed() -> None:
    """Fails on the baseline: a bool argument reached the Function as uint8, and a bool output
    was refused by ORT ("Unsupported code 6"). Every other dtype, in the same call, too."""
    Through.seen.clear()
    others = [(torch.arange(12).reshape(3, 4) % 3).to(dtype) for dtype in DTYPES]
    assert_like_eager(lambda h, w, *o: Through.apply(h * w, *o), *others)
    assert Through.seen and set(Through.seen) == {DTYPES}, Through.seen


class Masked(torch.autograd.Function):
    """The issue's case: ``~mask`` inside the Function (on uint8: 254/255, not False/True)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = (~mask).to(x.dtype)
        ctx.save_for_backward(keep)
        return x * keep + mask.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        (keep,) = ctx.saved_tensors
        return g * keep, None


def test_a_bool_mask_argument_is_a_bool_tensor_inside_the_function() -> None:
    """Fails on the baseline: the output was off by 227 (``~`` of a uint8 1 is 254)."""
    mask = torch.tensor([[True, False, True, False]] * 3)
    assert_like_eager(lambda h, w, m: Masked.apply(h + w, m), mask)


class BoolOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x > 0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _g_mask: Any) -> torch.Tensor:
        return g * 3


def test_a_bool_output_is_a_bool_tensor_inside_and_outside_the_graph() -> None:
    """Fails on the baseline: ORT refused the bool output ("Unsupported code 6"). The graph
    uses it as a bool (``~``, ``where``) and returns it."""

    def body(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, positive = BoolOut.apply(h * w)
        return torch.where(~positive, y, y * 5), positive

    assert_like_eager(body)


class TakesSizes(torch.autograd.Function):
    seen: ClassVar[list[tuple[Any, ...]]] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *sizes: Any) -> torch.Tensor:
        TakesSizes.seen.append(sizes)
        n, twice, scale, big, t, u = sizes
        return x * scale + (twice if big else n) + t + u

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (g * 3, *(None for _ in range(6)))


def _sizes(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n = h.shape[0]
    zero = torch.zeros((), dtype=torch.int64)
    return TakesSizes.apply(h * w, n, n * 2, h.shape[-1] ** -0.5, n > 4, torch.tensor(n), zero + n)


# The tracer hands torch.tensor() a size tensor, and torch warns about copying it (eager: an int).
@pytest.mark.filterwarnings("ignore:To copy construct from a tensor:UserWarning")
def test_sizes_passed_to_apply_reach_the_function_as_python_numbers() -> None:
    """Fails on the baseline: ``x.shape[0]`` (and arithmetic and comparisons on it with Python
    numbers) reached the Function as 0-dim tensors, where eager passes int, float and bool;
    ``torch.tensor(n)`` and ``zeros(()) + n`` stay tensors. Values are the current call's, for
    two batch sizes (the export's own trace sees tensors: the tracer's doing)."""
    model = Body(_sizes)
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model, options=STRICT)
    for n in (3, 5, 3):
        x = torch.randn(n, 4)
        TakesSizes.seen.clear()
        expected = reference(x)
        (eager,) = TakesSizes.seen
        TakesSizes.seen.clear()
        got = wrapped(x)
        assert close(got, expected)
        got.sum().backward()
        ours = TakesSizes.seen[-1]  # the first call's export traces the Function first
        assert eager[:4] == (n, 2 * n, 0.5, n > 4)
        assert [type(v) for v in ours] == [type(v) for v in eager], (ours, eager)
        for a, b in zip(ours, eager, strict=True):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), (ours, eager)
    assert ortfx.stats(wrapped).exports == 1


class NonDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rounded = x.round()
        ctx.mark_non_differentiable(rounded)
        return x * 2, rounded

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, g_rounded: Any) -> torch.Tensor:
        return g * 3


def test_mark_non_differentiable_outputs_do_not_require_grad() -> None:
    """Fails on the baseline: the marked output (and what the graph computed from it alone)
    required grad through ortfx. Now eager's flags, and no gradient flows through it."""

    def body(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y, rounded = NonDifferentiable.apply(h * w)
        return y, rounded, rounded * 3 + 1, y * rounded

    assert_like_eager(body)


# ---- what the graph cannot carry: refused, naming the Function ---------------------------------


@dataclasses.dataclass
class Pair:
    a: torch.Tensor
    b: torch.Tensor


class SumsList(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, extras: Any, scale: float) -> torch.Tensor:
        tensors = extras.values() if isinstance(extras, dict) else extras
        if isinstance(extras, list) and extras and isinstance(extras[0], list):
            tensors = extras[0]
        if isinstance(extras, Pair):
            tensors = [extras.a, extras.b]
        return x * scale + sum(tensors)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return g, None, None


CONTAINERS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "list": lambda h, w: [h * w, w],
    "tuple": lambda h, w: (h * w, w),
    "dict": lambda h, w: {"a": h * w, "b": w},
    "nested list": lambda h, w: [[h * w, w]],
    "dataclass": lambda h, w: Pair(h * w, w),
}


@pytest.mark.parametrize("make", CONTAINERS.values(), ids=CONTAINERS.keys())
def test_tensors_inside_a_container_argument_are_refused_naming_function_and_argument(
    make: Callable[[torch.Tensor, torch.Tensor], Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Fails on the baseline: the container was kept as the exporting call's object, so every
    later call used that call's tensors (off by 0.36 at step 2). Now a typed error naming the
    Function and the argument; under the default policy the module runs in PyTorch, loudly,
    with eager's values."""
    body = lambda h, w: SumsList.apply(h, make(h, w), 0.5)  # noqa: E731
    wrapped = ortfx.ORTModule(Body(body), options=STRICT)
    with pytest.raises(ortfx.OrtfxExportError, match=r"SumsList .* as argument 1 of apply"):
        wrapped(torch.randn(3, 4))

    model = Body(body)
    reference = copy.deepcopy(model)
    fallback = ortfx.ORTModule(model)
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        for _ in range(2):
            x = torch.randn(3, 4)
            assert close(fallback(x), reference(x))
    assert "falling back to PyTorch" in caplog.text and "SumsList" in caplog.text
    assert ortfx.stats(fallback).fallback_calls == 2


class ReturnsAnInt(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return x * 2, 7

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _count: Any) -> torch.Tensor:
        return g * 3


def test_a_non_tensor_output_is_refused_naming_the_function_and_output() -> None:
    """Fails on the baseline: "a tensor of type None", which named no output and misled."""
    wrapped = ortfx.ORTModule(Body(lambda h, w: ReturnsAnInt.apply(h * w)[0]), options=STRICT)
    with pytest.raises(ortfx.OrtfxExportError) as refused:
        wrapped(torch.randn(3, 4))
    text = str(refused.value)
    assert "ReturnsAnInt returns a value that is not a tensor as output 1" in text
    assert "torch.tensor(value)" in text
