"""TorchScript-exporter symbolics that write ATen nodes: ops run by torch inside the ORT graph
(:mod:`ortfx.aten` runs them, through the compiled bridge's executor).

- ``histc``, ``_grouped_mm``, ``ctc_loss``: no ONNX form;
- ``index_add``: the exporter's ``ScatterND`` writes instead of adding where the index repeats;
- ``detach``: an ATen node whose input edge ORT's gradient builder does not cross.

Registered by :func:`ortfx.export.symbolics.table` for training exports, when the bridge's
executor could be installed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import torch
import torch.onnx.symbolic_helper as helper

from ortfx import _torch, aten
from ortfx.errors import OrtfxExportError

_parse_arg = _torch.symbolic_helper("_parse_arg")


def _is_none(value: Any) -> bool:
    return value is None or bool(value.node().mustBeNone())


def _aten_node(g: Any, op: str, inputs: Sequence[Any], like: Any, rank: int | None) -> Any:
    node = g.op(f"{aten.DOMAIN}::ATen", *inputs, operator_s=op, overload_name_s="")
    # like's dtype, sizes unknown; rank None: like's own type, sizes included
    node.setType(like.type() if rank is None else like.type().with_sizes([None] * rank))
    # ORT cannot infer an ATen node's output type; an intermediate value keeps the type the
    # exporter records for it, a graph output would lose it in the gradient graph.
    out = g.op("Identity", node)
    out.setType(node.type())
    return out


def _constant(g: Any, value: Any, dtype: torch.dtype) -> Any:
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


def _is_floating(x: Any) -> bool:
    dtype = x.type().dtype() if x.type().kind() == "TensorType" else None
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def index_add(g: Any, x: Any, dim: Any, index: Any, source: Any, alpha: Any = None) -> Any:
    """``x.index_add(dim, index, source, alpha=...)`` as an ATen node: the exporter's
    ``ScatterND`` writes instead of adding where ``index`` repeats (a documented exporter
    limitation that gave silently wrong sums)."""
    dim_value = int(_parse_arg(dim, "i"))
    scale = 1.0 if alpha is None or _is_none(alpha) else float(_parse_arg(alpha, "f"))
    rank = x.type().dim() if x.type().kind() == "TensorType" else None
    # ortfx's own node (ortfx.aten._index_add): the additions into zeros of x's shape, then
    # x added in the graph, so x's gradient is ORT's own.
    args = [
        source,
        g.op("Shape", x),
        index,
        _constant(g, dim_value, torch.int64),
        _constant(g, scale, torch.float32),
    ]
    return g.op("Add", x, _aten_node(g, "index_add", args, x, rank if rank is not None else 1))


def detach(g: Any, x: Any) -> Any:
    """``x.detach()`` as an ATen node ORT's gradient builder does not cross (the exporter
    drops detach, and ORT then differentiated straight through it). Only floating tensors
    carry gradients; anything else stays as it is."""
    return _aten_node(g, "detach", [x], x, None) if _is_floating(x) else x


def _detach_without_bridge(g: Any, x: Any) -> Any:
    if _is_floating(x):
        raise OrtfxExportError(aten.DETACH_NEEDS_BRIDGE)
    return x


@helper.parse_args("v", "i", "f", "f")
def histc(g: Any, x: Any, bins: int, low: float, high: float) -> Any:
    """``torch.histc(x, bins, min, max)`` as an ATen node (the output has ``x``'s dtype)."""
    args = [
        x,
        _constant(g, bins, torch.int64),
        _constant(g, low, torch.float32),
        _constant(g, high, torch.float32),
    ]
    return _aten_node(g, "histc", args, x, 1)


GROUPED_MM_ARGUMENTS = (
    "torch._grouped_mm with bias or out_dtype cannot run inside the ONNX Runtime graph yet; "
    "ortfx routes _grouped_mm(input, weight, offs) only. Call it without them, or let ortfx "
    "fall back to PyTorch."
)


def grouped_mm(
    g: Any, x: Any, weight: Any, offs: Any, bias: Any = None, out_dtype: Any = None
) -> Any:
    """``torch._grouped_mm(x [S, K], weight [E, K, N], offs [E])`` -> [S, N] as an ATen node."""
    if not all(_is_none(v) for v in (bias, out_dtype)) or _is_none(offs):
        raise RuntimeError(GROUPED_MM_ARGUMENTS)
    return _aten_node(g, "_grouped_mm", [x, weight, offs], x, 2)


@helper.parse_args("v", "v", "v", "v", "i", "i", "b")
def ctc_loss(
    g: Any,
    log_probs: Any,
    targets: Any,
    input_lengths: Any,
    target_lengths: Any,
    blank: int,
    reduction: int,
    zero_infinity: bool,
) -> Any:
    """``aten::ctc_loss`` (lengths as lists or tensors) as an ATen node."""
    args = [
        log_probs,
        targets,
        _lengths(g, input_lengths),
        _lengths(g, target_lengths),
        _constant(g, blank, torch.int64),
        _constant(g, reduction, torch.int64),
        _constant(g, zero_infinity, torch.bool),
    ]
    return _aten_node(g, "ctc_loss", args, log_probs, 0 if reduction else 1)


def _lengths(g: Any, lengths: Any) -> Any:
    return g.op("Cast", lengths, to_i=7)  # TensorProto.INT64; a list arrives as a tensor


ATEN_SYMBOLICS: Final[dict[str, tuple[Callable[..., Any], int]]] = {
    "aten::histc": (histc, 9),
    "aten::_grouped_mm": (grouped_mm, 9),
    "aten::ctc_loss": (ctc_loss, 9),
    "aten::index_add": (index_add, 9),
    "aten::detach": (detach, 9),
}
