"""Dynamo-exporter translations that keep torch's semantics where the stock ones differ.

The dynamo exporter writes ``aten.hardtanh``/``aten.relu6`` as ``Clip``, whose ORT gradient
passes the gradient at the bounds and blocks it at NaN; torch's ``hardtanh_backward`` does the
reverse. These write them as ``Where`` selections, whose gradients are torch's (the TorchScript
exporter gets the same through :mod:`ortfx.symbolics`). Imported only by the dynamo export path
(it imports ``onnxscript``).
"""

from __future__ import annotations

from typing import Any

import torch
from onnxscript import opset18

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


def table() -> dict[Any, Any]:
    """The ``custom_translation_table`` for ``torch.onnx.export(dynamo=True)``."""
    return {torch.ops.aten.hardtanh.default: hardtanh, torch.ops.aten.relu6.default: relu6}
