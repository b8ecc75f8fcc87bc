"""TorchScript-exporter symbolics for torch ops that the exporter cannot express on its own.

Registered for the duration of each of ortfx's TorchScript exports only (:func:`table`, through
:func:`ortfx._torch.symbolics_registered`); a user's own ``torch.onnx.export`` never sees them:

- ``aten::copy`` (``buffer.copy_(value)`` in a forward, traced on a clone of the buffer):
  ``Expand`` of ``value`` cast to the buffer's dtype, so ``copy_`` updates export as ``add_``
  ones do;
- ``aten::diff`` (transformers calls it to find packed sequences when ``position_ids`` come
  without an ``attention_mask``, e.g. in ``generate(use_cache=False)``): ``Sub`` of two slices,
  ``Xor`` for bool, after concatenating ``prepend``/``append``;
- ``aten::scaled_dot_product_attention`` with ``enable_gqa=True`` (transformers uses it for
  grouped-query attention without a mask: Llama, Mistral, Qwen2 with fewer key/value heads):
  key and value heads are repeated to the query's head count, then the exporter's own symbolic
  runs with ``enable_gqa=False``, which is what the flag means;
- ``aten::cumsum`` of a bool tensor (transformers' packed-sequence check), which torch sums as
  int64 and the exporter would hand to ``CumSum`` as bool, a type ONNX does not allow;
- ``aten::hardtanh``/``aten::relu6`` as ``Where`` selections rather than ``Clip``: ORT's ``Clip``
  gradient passes the gradient at the bounds and blocks it at NaN, torch's ``hardtanh_backward``
  does the reverse (``ReLU6`` at exactly 0 got gradient 1 instead of 0);
- ``aten::softshrink``/``aten::hardshrink`` keep NaN as NaN (the exporter's forms return 0);
- ``aten::floor_divide`` floors (the exporter truncates), ``aten::div`` with a rounding mode
  keeps inf and NaN, float ``aten::remainder`` comes from ``fmod``, ``aten::__rshift__`` of
  signed integers shifts arithmetically, ``aten::atan2`` has torch's quadrants and infinities;
- ``aten::embedding`` rejects negative indices as PyTorch does (``Gather`` wraps them), as do
  ``gather``, ``scatter*``, ``index_select``, ``index_copy``, ``one_hot`` and the losses'
  targets (:mod:`ortfx.export.indexing`);
- ``aten::flip`` as a ``Gather`` (the exporter's negative-step ``Slice`` cannot be trained);
- ``aten::cdist`` has gradient 0 at coincident points and real values for odd p (the
  exporter's forms: NaN);
- ``aten::clamp``/``clamp_min``/``clamp_max`` of float tensors with torch's values and
  gradients at inf, at ties and at NaN (see :func:`_bounded`);
- the ops :mod:`ortfx.aten` runs by torch inside the graph (``histc``, ``_grouped_mm``,
  ``ctc_loss``, ``index_add``, ``gelu``, ``detach``), written as ATen nodes by
  :mod:`ortfx.export.routed`, if the bridge's executor could be installed.

Imported only by the TorchScript export path (it imports torch.onnx's TorchScript modules).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch
import torch.onnx.symbolic_helper as helper
import torch.onnx.symbolic_opset9 as opset9
import torch.onnx.symbolic_opset11 as opset11
import torch.onnx.symbolic_opset14 as opset14

from ortfx import _torch, aten
from ortfx.errors import OrtfxExportError
from ortfx.export import indexing
from ortfx.export.nan_reductions import NAN_REDUCTIONS
from ortfx.export.routed import (
    ATEN_SYMBOLICS,
    _constant,
    _detach_without_bridge,
    _is_none,
)

# The exporter's own private helpers (looked up through ortfx._torch, which names the torch
# version if one is gone).
_parse_arg = _torch.symbolic_helper("_parse_arg")
_unsqueeze = _torch.symbolic_helper("_unsqueeze_helper")
_reduce_sum = _torch.symbolic_helper("_reducesum_helper")
_tensor_rank = _torch.symbolic_helper("_get_tensor_rank")

_INT64_MAX = 2**63 - 1


def _const(g: Any, values: list[int]) -> Any:
    return g.op("Constant", value_t=torch.tensor(values, dtype=torch.int64))


def _slice(g: Any, x: Any, start: int, end: int, axis: int) -> Any:
    return g.op("Slice", x, _const(g, [start]), _const(g, [end]), _const(g, [axis]))


@helper.parse_args("v", "i", "i", "v", "v")
def diff(g: Any, x: Any, n: int, dim: int, prepend: Any, append: Any) -> Any:
    """``torch.diff(x, n, dim, prepend, append)``."""
    parts = [p for p in (prepend, x, append) if not _is_none(p)]
    if len(parts) > 1:
        x = g.op("Concat", *parts, axis_i=dim)
    boolean = x.type().scalarType() == "Bool"
    for _ in range(n):
        later, earlier = _slice(g, x, 1, _INT64_MAX, dim), _slice(g, x, 0, -1, dim)
        x = g.op("Xor" if boolean else "Sub", later, earlier)
    return x


def _repeat_heads(g: Any, kv: Any, query: Any) -> Any:
    """``kv`` of shape [B, Hkv, S, D] with each head repeated to [B, Hq, S, D]
    (``repeat_interleave`` on dim 1, as grouped-query attention means)."""
    kv_shape, q_shape = g.op("Shape", kv), g.op("Shape", query)
    batch = _slice(g, kv_shape, 0, 1, 0)
    kv_heads, q_heads = _slice(g, kv_shape, 1, 2, 0), _slice(g, q_shape, 1, 2, 0)
    rest = _slice(g, kv_shape, 2, _INT64_MAX, 0)
    groups = g.op("Div", q_heads, kv_heads)
    spread = g.op("Unsqueeze", kv, _const(g, [2]))
    spread = g.op("Expand", spread, g.op("Concat", batch, kv_heads, groups, rest, axis_i=0))
    return g.op("Reshape", spread, g.op("Concat", batch, q_heads, rest, axis_i=0))


@helper.parse_args("v", "v", "v", "v", "f", "b", "v", "b")
def scaled_dot_product_attention(
    g: Any,
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Any = None,
    enable_gqa: bool = False,
) -> Any:
    """The exporter's own symbolic, after repeating key/value heads when ``enable_gqa``."""
    if enable_gqa:
        key, value = _repeat_heads(g, key, query), _repeat_heads(g, value, query)
    return opset14.scaled_dot_product_attention(
        g, query, key, value, attn_mask, dropout_p, is_causal, scale, False
    )


@helper.parse_args("v", "i", "v")
def cumsum(g: Any, x: Any, dim: int, dtype: Any = None) -> Any:
    """``torch.cumsum(x, dim, dtype)``; a bool ``x`` is summed as int64, as torch does."""
    if _is_none(dtype) and x.type().scalarType() == "Bool":
        x = g.op("Cast", x, to_i=7)  # TensorProto.INT64
    return opset11.cumsum(g, x, dim, dtype)


def _dtype_of(x: Any) -> torch.dtype:
    dtype = x.type().dtype()
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


@helper.parse_args("v", "f", "f")
def hardtanh(g: Any, x: Any, low: float, high: float) -> Any:
    """``hardtanh(x, low, high)`` with torch's gradient: 0 at and beyond the bounds, passed at NaN
    (``x <= low`` and ``x >= high`` are both false there, and the forward keeps the NaN)."""
    dtype = _dtype_of(x)
    at_high = g.op(
        "Where", g.op("GreaterOrEqual", x, _constant(g, high, dtype)), _constant(g, high, dtype), x
    )
    return g.op(
        "Where", g.op("LessOrEqual", x, _constant(g, low, dtype)), _constant(g, low, dtype), at_high
    )


def relu6(g: Any, x: Any) -> Any:
    """``relu6(x)``, which torch computes as ``hardtanh(x, 0, 6)``."""
    return hardtanh(g, x, 0.0, 6.0)


_ONNX_FLOATS: Final[dict[torch.dtype, int]] = {
    torch.float32: 1,
    torch.float16: 10,
    torch.float64: 11,
    torch.bfloat16: 16,
}
_ONNX_INTS: Final[dict[torch.dtype, int]] = {
    torch.int8: 3,
    torch.int16: 5,
    torch.int32: 6,
    torch.int64: 7,
}


def _above(g: Any, x: Any, low: Any, nan: Any) -> Any:
    # x >= low: x; x < low: low; NaN: a NaN constant, so neither gets a gradient there.
    inner = g.op("Where", g.op("Less", x, low), low, nan)
    return g.op("Where", g.op("GreaterOrEqual", x, low), x, inner)


def _below(g: Any, x: Any, high: Any, nan: Any) -> Any:
    inner = g.op("Where", g.op("Greater", x, high), high, nan)
    return g.op("Where", g.op("LessOrEqual", x, high), x, inner)


def _bounded(g: Any, x: Any, low: Any | None, high: Any | None, stock: Callable[[], Any]) -> Any:
    """``clamp`` of a float tensor with torch's values and gradients where the exporter's
    forms differ; ``stock`` (the exporter's own symbolic) for the rest.

    - One bound missing: the exporter writes ``Clip`` without it, and ORT's ``Clip`` then
      clamps to the dtype's largest finite value (``clamp(x, min=0)`` turned inf into 3.4e38).
      The missing bound becomes ±inf.
    - A tensor bound: the exporter writes ``Max``/``Min``, whose ORT gradient at a tie goes to
      the bound, torch's to ``x``, and at NaN to ``x``, torch's nowhere. Written as ``Where``
      selections with torch's rule instead.
    """
    dtype = x.type().dtype() if x.type().kind() == "TensorType" else None
    if dtype not in _ONNX_FLOATS or (low is None and high is None):
        return stock()
    cast = [None if b is None else g.op("Cast", b, to_i=_ONNX_FLOATS[dtype]) for b in (low, high)]
    if all(b is None or b.type().dim() == 0 for b in cast):
        filled = [
            _constant(g, fill, dtype) if b is None else b
            for b, fill in zip(cast, (-math.inf, math.inf), strict=True)
        ]
        return g.op("Clip", x, *filled)
    nan = _constant(g, math.nan, dtype)
    if cast[0] is not None:
        x = _above(g, x, cast[0], nan)
    if cast[1] is not None:
        x = _below(g, x, cast[1], nan)
    return x


def clamp(g: Any, x: Any, low: Any, high: Any) -> Any:
    """``clamp(x, low, high)``, see :func:`_bounded`."""
    return _bounded(
        g,
        x,
        None if _is_none(low) else low,
        None if _is_none(high) else high,
        lambda: opset11.clamp(g, x, low, high),
    )


def clamp_min(g: Any, x: Any, low: Any) -> Any:
    """``clamp_min(x, low)``, see :func:`_bounded`."""
    return _bounded(g, x, low, None, lambda: opset11.clamp_min(g, x, low))


def clamp_max(g: Any, x: Any, high: Any) -> Any:
    """``clamp_max(x, high)``, see :func:`_bounded`."""
    return _bounded(g, x, None, high, lambda: opset11.clamp_max(g, x, high))


def _rounding_mode(value: Any) -> str | None:
    return None if _is_none(value) else str(_parse_arg(value, "s"))


def _float_dtype(x: Any) -> torch.dtype | None:
    dtype = x.type().dtype() if x.type().kind() == "TensorType" else None
    return dtype if dtype in _ONNX_FLOATS else None


def _rounded_quotient(g: Any, x: Any, other: Any, dtype: torch.dtype, mode: str) -> Any:
    """``floor`` or ``trunc`` of ``x / other`` for floats. (A zero result may lose its sign:
    ORT's ``Where`` and ``Ceil`` do not keep -0.0, see docs/index.md.)"""
    zero = _constant(g, 0, dtype)
    quotient = g.op("Div", x, g.op("Cast", other, to_i=_ONNX_FLOATS[dtype]))
    if mode == "floor":
        return g.op("Floor", quotient)
    negative = g.op("Less", quotient, zero)
    return g.op("Where", negative, g.op("Ceil", quotient), g.op("Floor", quotient))


def floor_divide(g: Any, x: Any, other: Any) -> Any:
    """``x // other``: floor division, as torch computes it since 1.13 (the exporter still
    writes the old truncating one: ``-7 // 2`` gave -3, torch says -4)."""
    dtype = _float_dtype(x)
    if dtype is None:
        return opset9.div(g, x, other, "floor")
    return _rounded_quotient(g, x, other, dtype, "floor")


def div(g: Any, x: Any, other: Any, *args: Any) -> Any:
    """``div(x, other, rounding_mode=...)`` of floats through :func:`_rounded_quotient`: the
    exporter's ``trunc`` casts the quotient through int64 (inf became -9.2e18, NaN and
    quotients beyond 2**63 wrapped). Everything else: the exporter's ``div``."""
    mode = _rounding_mode(args[0]) if args else None
    dtype = _float_dtype(x)
    if mode not in ("floor", "trunc") or dtype is None:
        return opset9.div(g, x, other, *args)
    return _rounded_quotient(g, x, other, dtype, mode)


def remainder(g: Any, x: Any, other: Any) -> Any:
    """``x % other`` of floats from ``fmod`` (ORT's ``Mod(fmod=1)``), moved to the divisor's
    sign as torch does; the exporter's ``x - floor(x / other) * other`` lost all precision
    when the quotient is large (``1e30 % 1e-20`` gave -inf)."""
    dtype = _float_dtype(x)
    if dtype is None:
        return opset9.remainder(g, x, other)
    zero = _constant(g, 0, dtype)
    other = g.op("Cast", other, to_i=_ONNX_FLOATS[dtype])
    rest = g.op("Mod", x, other, fmod_i=1)
    other_side = g.op("Xor", g.op("Less", rest, zero), g.op("Less", other, zero))
    fix = g.op("And", g.op("Not", g.op("Equal", rest, zero)), other_side)
    return g.op("Where", fix, g.op("Add", rest, other), rest)


def rshift(g: Any, x: Any, other: Any) -> Any:
    """``x >> other`` of signed integers: an arithmetic shift, floor division by
    ``2**other`` (the exporter's ``Div`` truncates: ``-7 >> 1`` gave -3, torch says -4)."""
    dtype = x.type().dtype() if x.type().kind() == "TensorType" else None
    if dtype not in (torch.int8, torch.int16, torch.int32, torch.int64):
        stock: Any = getattr(opset11, "__rshift_")  # a name mypy cannot see
        return stock(g, x, other)
    exponent = g.op("Cast", other, to_i=_ONNX_FLOATS[torch.float32])
    power = g.op("Pow", _constant(g, 2.0, torch.float32), exponent)
    return opset9.div(g, x, g.op("Cast", power, to_i=_ONNX_INTS[dtype]), "floor")


def _signbit(g: Any, v: Any, zero: Any) -> Any:
    # v < 0, or v is -0.0 (1 / -0.0 is -inf); false for NaN.
    negative_zero = g.op("And", g.op("Equal", v, zero), g.op("Less", g.op("Reciprocal", v), zero))
    return g.op("Or", g.op("Less", v, zero), negative_zero)


def atan2(g: Any, y: Any, x: Any) -> Any:
    """``atan2(y, x)`` with torch's (IEEE) quadrants, signed zeros and infinities.

    The exporter's form gave -pi for ``atan2(0, -1)`` (torch: pi), NaN for ``atan2(0, 0)``
    (torch: 0), NaN for ``atan2(inf, inf)`` (torch: pi/4) and ignored ``-0.0``.
    """
    dtype = _dtype_of(y)
    if dtype not in _ONNX_FLOATS:
        return opset9.atan2(g, y, x)
    x = g.op("Cast", x, to_i=_ONNX_FLOATS[dtype])
    zero, pi = _constant(g, 0.0, dtype), _constant(g, math.pi, dtype)
    y_negative, x_negative = _signbit(g, y, zero), _signbit(g, x, zero)
    base = g.op("Atan", g.op("Div", y, x))
    # x negative (or -0.0): the quadrant is the other side, toward y's sign.
    shifted = g.op("Where", y_negative, g.op("Sub", base, pi), g.op("Add", base, pi))
    result = g.op("Where", x_negative, shifted, base)
    # Both zero: 0/0 is NaN; torch gives y (a signed zero) or ±pi when x is negative.
    both_zero = g.op("And", g.op("Equal", y, zero), g.op("Equal", x, zero))
    toward_y = g.op("Where", y_negative, g.op("Neg", pi), pi)
    result = g.op("Where", both_zero, g.op("Where", x_negative, toward_y, y), result)
    # Both infinite: inf/inf is NaN; torch gives ±pi/4 or ±3pi/4.
    both_inf = g.op("And", g.op("IsInf", y), g.op("IsInf", x))
    corner = g.op(
        "Where", x_negative, _constant(g, 3 * math.pi / 4, dtype), _constant(g, math.pi / 4, dtype)
    )
    corner = g.op("Where", y_negative, g.op("Neg", corner), corner)
    return g.op("Where", both_inf, corner, result)


@helper.parse_args("v", "v", "i", "b", "v")
def embedding(
    g: Any, weight: Any, indices: Any, padding_idx: int, scale_grad_by_freq: bool, sparse: Any
) -> Any:
    """``F.embedding`` with PyTorch's rejection of negative indices: ONNX ``Gather`` wraps
    them around (``embedding(tensor([-1]))`` silently returned the last row). With a
    ``padding_idx`` the node is ``ortfx::PaddedGather``, which
    :func:`ortfx.passes.embedding_padding` turns into a gather whose padding row gets no
    gradient (functional calls included, not only ``nn.Embedding``)."""
    checked = indexing.nonnegative(g, indices)
    if padding_idx < 0:
        return opset9.embedding(g, weight, checked, padding_idx, scale_grad_by_freq, sparse)
    if scale_grad_by_freq:  # the exporter's own refusal, with its message
        return opset9.embedding(g, weight, checked, padding_idx, scale_grad_by_freq, sparse)
    node = g.op("ortfx::PaddedGather", weight, checked, padding_idx_i=padding_idx)
    rank = indices.type().dim() if indices.type().kind() == "TensorType" else None
    if rank is not None:
        node.setType(weight.type().with_sizes([None] * (rank + 1)))
    return node


@helper.parse_args("v", "v", "i", "b", "v")
def embedding_forward(
    g: Any, weight: Any, indices: Any, padding_idx: int, scale_grad_by_freq: bool, sparse: Any
) -> Any:
    """:func:`embedding` for inference graphs: negative indices refused as in PyTorch, and
    the padding row an ordinary row (it differs from the others only in its gradient), so
    no ``ortfx::PaddedGather`` marker is written."""
    return opset9.embedding(g, weight, indexing.nonnegative(g, indices), -1, False, sparse)


def cdist(g: Any, x1: Any, x2: Any, p: Any, compute_mode: Any = None) -> Any:
    """``torch.cdist`` for finite p > 0 from the differences themselves, with a root whose
    gradient is 0 where a distance is 0, as torch's ``_cdist_backward`` has it. The exporter's
    forms gave NaN gradients for coincident points (``cdist(x, x)``'s diagonal) and NaN values
    for odd p (it raised signed differences to the power p). Costs a ``[..., P, R, D]``
    intermediate, as the exporter's own form for small inputs does."""
    order = float(_parse_arg(p, "f"))
    dtype = _float_dtype(x1)
    rank = x1.type().dim() if x1.type().kind() == "TensorType" else None
    if dtype is None or rank is None or not 0.0 < order < math.inf:
        return opset9.cdist(g, x1, x2, p, compute_mode)
    rows = _unsqueeze(g, x1, [rank - 1])
    columns = _unsqueeze(g, x2, [rank - 2])
    diff = g.op("Sub", rows, columns)
    if order == 1.0:
        return _reduce_sum(g, g.op("Abs", diff), axes_i=[-1], keepdims_i=0)
    zero, one = _constant(g, 0, dtype), _constant(g, 1, dtype)
    if order == 2.0:
        powers = g.op("Mul", diff, diff)
    else:
        powers = g.op("Pow", g.op("Abs", diff), _constant(g, order, dtype))
    total = _reduce_sum(g, powers, axes_i=[-1], keepdims_i=0)
    positive = g.op("Greater", total, zero)
    safe = g.op("Where", positive, total, one)
    if order == 2.0:
        root = g.op("Sqrt", safe)
    else:
        root = g.op("Pow", safe, _constant(g, 1.0 / order, dtype))
    return g.op("Where", positive, root, zero)


@helper.parse_args("v", "is")
def flip(g: Any, x: Any, dims: Sequence[int]) -> Any:
    """``x.flip(dims)`` as a ``Gather`` of reversed indices per dim. The exporter's ``Slice``
    with step -1 and end -(2**63 - 1) trains in no ORT 1.19 session: its ``SliceGrad`` fails
    ("narrowing_error") in the backward."""
    i64 = torch.int64
    for dim in dims:
        size = g.op("Gather", g.op("Shape", x), _constant(g, dim, i64), axis_i=0)
        # size - 1 - [0, 1, ..., size - 1]: a descending Range was mis-optimized by ORT 1.19
        # (an empty result with graph optimizations on).
        ascending = g.op("Range", _constant(g, 0, i64), size, _constant(g, 1, i64))
        last = g.op("Sub", size, _constant(g, 1, i64))
        x = g.op("Gather", x, g.op("Sub", last, ascending), axis_i=dim)
    return x


def _keep_nan(g: Any, x: Any, y: Any) -> Any:
    return g.op("Where", g.op("IsNaN", x), x, y)


@helper.parse_args("v", "f")
def softshrink(g: Any, x: Any, lambd: float) -> Any:
    """The exporter's ``softshrink``, NaN kept (its two ``Where`` selections give 0 for NaN)."""
    return _keep_nan(g, x, opset9.softshrink(g, x, lambd))


@helper.parse_args("v", "f")
def hardshrink(g: Any, x: Any, lambd: float) -> Any:
    """The exporter's ``hardshrink``, NaN kept."""
    return _keep_nan(g, x, opset9.hardshrink(g, x, lambd))


_ONNX_TYPES: Final[dict[torch.dtype, int]] = {
    **_ONNX_FLOATS,
    **_ONNX_INTS,
    torch.uint8: 2,
    torch.bool: 9,
}


def copy(g: Any, x: Any, src: Any, non_blocking: Any = None) -> Any:
    """``x.copy_(src)``, which the tracer records as ``aten::copy`` of a clone of ``x`` (no
    stock symbolic): ``src`` in ``x``'s dtype, broadcast to ``x``'s shape. A buffer or an input
    updated with ``copy_`` (running statistics, a teacher's EMA, a counter) then becomes a
    graph output like one updated with ``add_``, and ortfx writes it back after each run."""
    target, source = _dtype_or_none(x), _dtype_or_none(src)
    if target != source:
        if target not in _ONNX_TYPES:
            raise OrtfxExportError(
                f"Tensor.copy_ into a tensor of dtype {target} (from {source}) cannot be "
                "exported by ortfx: the target's dtype must be known and one of "
                f"{', '.join(str(d).removeprefix('torch.') for d in _ONNX_TYPES)}. Copy a "
                "tensor of the target's own dtype (src.to(target.dtype)), or let ortfx fall "
                "back to PyTorch."
            )
        src = g.op("Cast", src, to_i=_ONNX_TYPES[target])
    return g.op("Expand", src, g.op("Shape", x))


def _dtype_or_none(x: Any) -> torch.dtype | None:
    dtype = x.type().dtype() if x.type().kind() == "TensorType" else None
    return dtype if isinstance(dtype, torch.dtype) else None


def _mean_of_last(g: Any, x: Any) -> Any:
    if g.opset >= 18:  # axes became an input
        return g.op("ReduceMean", x, _const(g, [-1]), keepdims_i=1)
    return g.op("ReduceMean", x, axes_i=[-1], keepdims_i=1)


@helper.parse_args("v", "i", "v", "v", "f", "i")
def group_norm(g: Any, x: Any, groups: int, weight: Any, bias: Any, eps: float, cudnn: int) -> Any:
    """``group_norm`` in means and elementwise ops, which ORT can differentiate.

    The exporter writes it as ``InstanceNormalization``, which has no gradient in ORT 1.19:
    ``nn.GroupNorm`` (wav2vec2's feature extractor) could not train. Normalizing the
    ``[N, groups, -1]`` view over its last axis is the same arithmetic (biased variance, eps
    inside the root); the per-channel affine follows as in the exporter's form. Below opset 17
    the exporter's own form is kept. ``groups=0``: one per channel
    (instance norm, whose channel count the graph may only know at run time).
    """
    rank = _tensor_rank(x)
    if g.opset < 17 or rank is None or (groups == 0 and rank < 3):  # g knows the opset
        return opset9.group_norm(g, x, groups, weight, bias, eps, cudnn)
    dtype = _dtype_of(x)
    grouped = g.op("Reshape", x, _const(g, [0, groups, -1]))  # 0: keep that dimension
    centered = g.op("Sub", grouped, _mean_of_last(g, grouped))
    variance = _mean_of_last(g, g.op("Mul", centered, centered))  # biased, as torch's
    root = g.op("Sqrt", g.op("Add", variance, _constant(g, eps, dtype)))
    normed = g.op("Div", centered, root)
    out = g.op("Reshape", normed, g.op("Shape", x))
    axes = list(range(1, rank - 1))
    if not _is_none(weight):
        out = g.op("Mul", out, _unsqueeze(g, weight, axes))
    if not _is_none(bias):
        out = g.op("Add", out, _unsqueeze(g, bias, axes))
    return out


@helper.parse_args("v", "v", "v", "v", "v", "b", "f", "f", "b")
def instance_norm(
    g: Any,
    x: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    use_input_stats: bool,
    momentum: float,
    eps: float,
    cudnn: bool,
) -> Any:
    """``instance_norm`` without running statistics: :func:`group_norm` with a group per
    channel, which ORT can differentiate. With running statistics the exporter's form stays
    (it cannot train in ORT either way, and says so)."""
    if not (_is_none(running_mean) and _is_none(running_var) and use_input_stats):
        return opset9.instance_norm(
            g, x, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, cudnn
        )
    return group_norm(g, x, 0, weight, bias, eps, cudnn)


NAN_AND_BOUNDS: Final[dict[str, Callable[..., Any]]] = {
    "aten::hardtanh": hardtanh,
    "aten::relu6": relu6,
    "aten::softshrink": softshrink,
    "aten::hardshrink": hardshrink,
    "aten::clamp": clamp,
    "aten::clamp_min": clamp_min,
    "aten::clamp_max": clamp_max,
    "aten::floor_divide": floor_divide,
    "aten::div": div,
    "aten::remainder": remainder,
    "aten::__rshift_": rshift,
    "aten::atan2": atan2,
    "aten::embedding": embedding,
    "aten::cdist": cdist,
    "aten::flip": flip,
    "aten::group_norm": group_norm,
    "aten::instance_norm": instance_norm,
}


def clone(g: Any, x: Any, memory_format: Any = None) -> Any:
    """``x.clone()`` as an ``Identity`` (the exporter writes none): a returned clone is then a
    value of its own, whose gradient is its own, as in eager (see
    ``runtime.training._inner_outputs``); ORT removes the Identity when it optimizes."""
    return g.op("Identity", x)


def standard(opset: int, *, training: bool = False) -> list[tuple[str, Callable[..., Any], int]]:
    """The symbolics above that write standard ONNX operators, as ``(name, symbolic, opset)``
    for an export at ``opset``: PyTorch's values where the exporter's forms differ. Without
    ``training`` (inference files, :mod:`ortfx.deploy`) only standard operators: no ATen node,
    no PythonOp, and embeddings without ortfx's padding marker."""
    bounds = (
        NAN_AND_BOUNDS if training else {**NAN_AND_BOUNDS, "aten::embedding": embedding_forward}
    )
    entries: list[tuple[str, Callable[..., Any], int]] = [
        ("aten::copy", copy, 9),
        ("aten::clone", clone, 9),
        ("aten::diff", diff, 9),
        ("aten::cumsum", cumsum, 11),
        *((name, symbolic, 9) for name, symbolic in bounds.items()),
        *((name, symbolic, low) for name, (symbolic, low) in indexing.INDEX_CHECKS.items()),
        *((name, symbolic, low) for name, (symbolic, low) in NAN_REDUCTIONS.items()),
        ("aten::scaled_dot_product_attention", scaled_dot_product_attention, 14),
    ]
    return [(name, symbolic, opset) for name, symbolic, low in entries if opset >= low]


def table(opset: int) -> list[tuple[str, Callable[..., Any], int]]:
    """The symbolics above as ``(name, symbolic, opset)`` for a training export at ``opset``,
    for :func:`ortfx._torch.symbolics_registered` (ortfx's exports only; the user's own exports
    never see them). Each is registered at the export's own opset, which the exporter then
    picks over its built-in versions; one that needs a newer opset is left out."""
    entries: list[tuple[str, Callable[..., Any], int]] = []
    if aten.install():  # ops run by torch inside the graph need the bridge's executor
        entries += [(name, symbolic, low) for name, (symbolic, low) in ATEN_SYMBOLICS.items()]
    else:  # never let ORT differentiate through a detach silently
        entries.append(("aten::detach", _detach_without_bridge, 9))
    ours = [(name, symbolic, opset) for name, symbolic, low in entries if opset >= low]
    return standard(opset, training=True) + ours
