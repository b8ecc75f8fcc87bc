"""TorchScript-exporter symbolics for PyTorch's NaN in max-like reductions.

PyTorch propagates NaN through ``max``/``min`` (all elements or along a dim: the value is NaN and
the index the first NaN's), ``amax``/``amin`` and ``argmax``/``argmin``; ORT's CPU
``ReduceMax``/``ReduceMin``/``ArgMax``/``ArgMin`` skip it: ``x.max()`` of a tensor holding NaN
returned its largest number, so a diverged activation trained on as if finite, silently. Each
symbolic here runs the exporter's own form and then selects NaN (and the first NaN's index)
where the reduced slice holds one. ``sign(NaN)`` is 0 in PyTorch (ORT: NaN), and
``hardswish(-inf)`` NaN (ORT: 0). ``sort``/``topk`` with NaN (PyTorch orders NaN above every
number) are not covered (docs/index.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import torch

from ortfx import _torch
from ortfx.export.indexing import stock

_FLOAT: Final = 1  # TensorProto.FLOAT
# ORT 1.19's CPU IsNaN/IsInf kernels below opset 20 take float32 and float64 only (float16 and
# bfloat16 keep the exporter's forms: documented).
_CHECKED: Final = (torch.float32, torch.float64)
_get_const = _torch.symbolic_helper("_get_const")
_is_none = _torch.symbolic_helper("_is_none")
_tensor_rank = _torch.symbolic_helper("_get_tensor_rank")


def _nan_flags(g: Any, x: Any) -> Any:
    return g.op("Cast", g.op("IsNaN", x), to_i=_FLOAT)


def _any_nan(g: Any, x: Any, axes: list[int] | None, keepdim: bool) -> Any:
    """Whether the slice of ``x`` over ``axes`` (all: None) holds a NaN, as a bool tensor."""
    flags = _nan_flags(g, x)
    if axes is None:
        count = g.op("ReduceSum", flags, keepdims_i=0)
    elif g.opset >= 13:
        axes_value = g.op("Constant", value_t=torch.tensor(axes, dtype=torch.int64))
        count = g.op("ReduceSum", flags, axes_value, keepdims_i=int(keepdim))
    else:
        count = g.op("ReduceSum", flags, axes_i=axes, keepdims_i=int(keepdim))
    return g.op("Greater", count, g.op("Constant", value_t=torch.tensor(0.0)))


def _first_nan(g: Any, x: Any, axis: int | None, keepdim: bool) -> Any:
    """The index of the first NaN along ``axis`` (of the flattened ``x``: None)."""
    flags = _nan_flags(g, x)
    if axis is None:
        flat = g.op("Reshape", flags, g.op("Constant", value_t=torch.tensor([-1])))
        return g.op("ArgMax", flat, axis_i=0, keepdims_i=0)
    return g.op("ArgMax", flags, axis_i=axis, keepdims_i=int(keepdim))


def _constant_like(g: Any, value: float, like: Any) -> Any:
    """A scalar constant in ``like``'s dtype (a CastLike would put ``like`` on the gradient
    path, and ORT has no gradient for CastLike)."""
    dtype = like.type().dtype() if like.type().kind() == "TensorType" else torch.float32
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


def _nan_where(g: Any, has_nan: Any, out: Any) -> Any:
    return g.op("Where", has_nan, _constant_like(g, float("nan"), out), out)


def _checked(x: Any) -> bool:
    return bool(x.type().kind() == "TensorType" and x.type().dtype() in _CHECKED)


def _rank(x: Any) -> int | None:
    rank: int | None = _tensor_rank(x)
    return rank


def _extreme(name: str) -> Callable[..., Any]:
    def symbolic(g: Any, self: Any, dim_or_y: Any = None, keepdim: Any = None) -> Any:
        exporters = stock(name, g.opset)
        if not _checked(self):
            return exporters(g, self, dim_or_y, keepdim)
        if dim_or_y is None and keepdim is None:  # over every element
            return _nan_where(g, _any_nan(g, self, None, False), exporters(g, self))
        if keepdim is None:  # the elementwise maximum/minimum: NaN already propagates
            return exporters(g, self, dim_or_y, keepdim)
        dim = _get_const(dim_or_y, "i", "dim")
        keep = bool(_get_const(keepdim, "i", "keepdim"))
        rank = _rank(self)
        if not rank:  # a 0-dim tensor (or an unknown rank): its one value is the result
            return exporters(g, self, dim_or_y, keepdim)
        if dim < 0:
            dim += rank
        values, indices = exporters(g, self, dim_or_y, keepdim)
        has_nan = _any_nan(g, self, [dim], keep)
        first = _first_nan(g, self, dim, keep)
        return _nan_where(g, has_nan, values), g.op("Where", has_nan, first, indices)

    symbolic.__name__ = symbolic.__qualname__ = name
    symbolic.__doc__ = f"``aten::{name}``: NaN propagates, with the first NaN's index."
    return symbolic


def _extreme_values(name: str) -> Callable[..., Any]:
    def symbolic(g: Any, self: Any, dim: Any, keepdim: Any) -> Any:
        out = stock(name, g.opset)(g, self, dim, keepdim)
        if not _checked(self):
            return out
        axes = _get_const(dim, "is", "dim")
        keep = bool(_get_const(keepdim, "i", "keepdim"))
        return _nan_where(g, _any_nan(g, self, list(axes) or None, keep), out)

    symbolic.__name__ = symbolic.__qualname__ = name
    symbolic.__doc__ = f"``aten::{name}``: NaN propagates."
    return symbolic


def _extreme_index(name: str) -> Callable[..., Any]:
    def symbolic(g: Any, self: Any, dim: Any = None, keepdim: Any = None) -> Any:
        out = stock(name, g.opset)(g, self, dim, keepdim)
        if not _checked(self):
            return out
        keep = bool(_get_const(keepdim, "i", "keepdim")) if keepdim is not None else False
        if _is_none(dim):
            first = _first_nan(g, self, None, False)
            if keep:  # the flat index in the input's rank of ones, as the exporter shapes it
                first = g.op("Reshape", first, g.op("Shape", out))
            return g.op("Where", _any_nan(g, self, None, False), first, out)
        axis = _get_const(dim, "i", "dim")
        rank = _rank(self)
        if not rank:  # a 0-dim tensor (or an unknown rank): index 0
            return out
        if axis < 0:
            axis += rank
        has_nan = _any_nan(g, self, [axis], keep)
        return g.op("Where", has_nan, _first_nan(g, self, axis, keep), out)

    symbolic.__name__ = symbolic.__qualname__ = name
    symbolic.__doc__ = f"``aten::{name}``: the first NaN's index where the slice holds one."
    return symbolic


def sign(g: Any, self: Any) -> Any:
    """``torch.sign``: 0 for NaN (ONNX's ``Sign`` gives NaN)."""
    out = g.op("Sign", self)
    if not _checked(self):
        return out
    return g.op("Where", g.op("IsNaN", self), _constant_like(g, 0.0, self), out)


def hardswish(g: Any, self: Any) -> Any:
    """``F.hardswish``: NaN at -inf, as PyTorch's ``x * relu6(x + 3) / 6`` (ORT: 0)."""
    out = stock("hardswish", g.opset)(g, self)
    if not _checked(self):
        return out
    return _nan_where(g, g.op("IsInf", self, detect_positive_i=0), out)


NAN_REDUCTIONS: Final[dict[str, tuple[Callable[..., Any], int]]] = {
    "aten::max": (_extreme("max"), 9),
    "aten::min": (_extreme("min"), 9),
    "aten::amax": (_extreme_values("amax"), 9),
    "aten::amin": (_extreme_values("amin"), 9),
    "aten::argmax": (_extreme_index("argmax"), 9),
    "aten::argmin": (_extreme_index("argmin"), 9),
    "aten::sign": (sign, 9),
    "aten::hardswish": (hardswish, 14),
}
