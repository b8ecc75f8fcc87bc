"""Dynamo-exporter translations that keep torch's semantics where the stock ones differ.

The dynamo exporter writes ``aten.hardtanh``/``aten.relu6`` as ``Clip``, whose ORT gradient
passes the gradient at the bounds and blocks it at NaN; torch's ``hardtanh_backward`` does the
reverse. These write them as ``Where`` selections, whose gradients are torch's (the TorchScript
exporter gets the same through :mod:`ortfx.symbolics`). Imported only by the dynamo export path
(it imports ``onnxscript``).
"""

from __future__ import annotations

from typing import Any

import onnx
import onnxscript
import torch
from onnxscript import opset18

from ortfx.errors import OrtfxExportError

# onnxscript's typed opset does not accept Python floats where ONNX takes a scalar constant.
op: Any = opset18


def hardtanh(x: Any, min_val: float = -1.0, max_val: float = 1.0) -> Any:
    """``hardtanh(x, min_val, max_val)`` with torch's gradient (0 at the bounds, passed at NaN)."""
    low = op.CastLike(min_val, x)
    high = op.CastLike(max_val, x)
    return op.Where(op.LessOrEqual(x, low), low, op.Where(op.GreaterOrEqual(x, high), high, x))


def relu6(x: Any) -> Any:
    """``relu6(x)``, which torch computes as ``hardtanh(x, 0, 6)``."""
    return hardtanh(x, 0.0, 6.0)


def _aten_schema() -> onnx.defs.OpSchema:
    """ORT's ``org.pytorch.aten::ATen`` (run by ortfx's executor), as onnxscript needs it."""
    Param, Attr = onnx.defs.OpSchema.FormalParameter, onnx.defs.OpSchema.Attribute
    string = onnx.defs.OpSchema.AttrType.STRING
    variadic = onnx.defs.OpSchema.FormalParameterOption.Variadic
    return onnx.defs.OpSchema(
        "ATen",
        "org.pytorch.aten",
        1,
        inputs=[Param("inputs", "T", param_option=variadic, is_homogeneous=False)],
        outputs=[Param("outputs", "T", param_option=variadic, is_homogeneous=False)],
        type_constraints=[
            ("T", [f"tensor({t})" for t in ("float", "double", "float16", "bfloat16")], "")
        ],
        attributes=[Attr("operator", string, ""), Attr("overload_name", string, "")],
    )


_ATEN_OP: Any = onnxscript.values.Op(
    onnxscript.values.Opset("org.pytorch.aten", 1), "ATen", _aten_schema()
)


def detach(x: Any) -> Any:
    """``x.detach()`` as the ATen node ORT's gradient builder does not cross (see
    :func:`ortfx.symbolics.detach` and ``passes.stop_edges_behind_identity``)."""
    return _ATEN_OP(x, operator="detach", overload_name="")


def _detach_without_bridge(x: Any) -> Any:
    from ortfx import aten

    raise OrtfxExportError(aten.DETACH_NEEDS_BRIDGE)


def table() -> dict[Any, Any]:
    """The ``custom_translation_table`` for ``torch.onnx.export(dynamo=True)``."""
    entries: dict[Any, Any] = {
        torch.ops.aten.hardtanh.default: hardtanh,
        torch.ops.aten.relu6.default: relu6,
    }
    from ortfx import aten

    # the executor runs the ATen node; never let ORT differentiate through a detach silently
    entries[torch.ops.aten.detach.default] = detach if aten.install() else _detach_without_bridge
    return entries
