"""Torch ops neither exporter can express, run by torch inside the ORT graph (ORT's ATen node).

The TorchScript exporter writes a routed op as an ``org.pytorch.aten::ATen`` node (attributes
``operator`` and ``overload_name``; every argument an input, scalars as constants). ORT runs such
a node through the executor registered once per process (``register_aten_op_executor``): two
plain-C functions in ``ortfx._bridge`` that call :func:`is_tensor_argument` and :func:`execute`
here. Each routed op's argument kinds are listed in :data:`ROUTED`, so no torch schema lookup is
needed. Routed ops are not differentiable here: ORT builds no gradient through them (``histc``
counts; its input never requires grad in the models that use it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs
import onnx
import torch
import torch.onnx.symbolic_helper as helper
import torch.utils.dlpack

DOMAIN: Final = "org.pytorch.aten"


@attrs.frozen
class Routed:
    """An op run by torch inside the graph: its callable and the kind of each argument."""

    function: Callable[..., Any]
    arguments: tuple[str, ...]  # "tensor", "int", "float" or "bool"
    outputs: int = 1


# (operator, overload name) -> how to run it
ROUTED: Final[dict[tuple[str, str], Routed]] = {
    # transformers' grouped-mm MoE experts count tokens per expert with it (Mixtral, Qwen2-MoE)
    ("histc", ""): Routed(torch.histc, ("tensor", "int", "float", "float")),
}

_SCALARS: Final[dict[str, Callable[[Any], Any]]] = {"int": int, "float": float, "bool": bool}


def is_tensor_argument(op: str, overload: str, index: int, is_input: bool) -> bool:
    """ORT's question: is argument (or output) ``index`` of ``aten::op.overload`` a tensor?"""
    if not is_input:
        return True
    return ROUTED[(op, overload)].arguments[index] == "tensor"


def execute(op: str, overload: str, inputs: Sequence[Any], n_out: int) -> list[Any]:
    """Run ``aten::op.overload`` on DLPack capsules; return one capsule per output."""
    routed = ROUTED[(op, overload)]
    args = []
    for kind, capsule in zip(routed.arguments, inputs, strict=True):
        value = None if capsule is None else torch.utils.dlpack.from_dlpack(capsule)
        if value is not None and kind in _SCALARS:
            value = _SCALARS[kind](value.item())
        args.append(value)
    result = routed.function(*args)
    outputs = result if isinstance(result, tuple) else (result,)
    if len(outputs) != n_out:
        raise RuntimeError(f"aten::{op} returned {len(outputs)} outputs, ORT expects {n_out}")
    to_dlpack: Any = torch.utils.dlpack.to_dlpack  # type: ignore[attr-defined]
    return [to_dlpack(t.contiguous()) for t in outputs]


_installed: list[bool] = []
_lock = threading.Lock()


def install() -> bool:
    """Register the executor with ORT once per process; False without the bridge."""
    with _lock:
        if _installed:
            return _installed[0]
        try:
            from onnxruntime.capi import _pybind_state as C

            from ortfx import _bridge  # type: ignore[attr-defined]
        except ImportError:
            _installed.append(False)
            return False
        _bridge.set_aten_executor(is_tensor_argument, execute)
        is_tensor, run = _bridge.aten_addresses()
        C.register_aten_op_executor(str(is_tensor), str(run))
        _installed.append(True)
        return True


# ---- export: the symbolics that write ATen nodes -------------------------------------------------


def routed_ops(model: bytes, /) -> tuple[str, ...]:
    """The ops an exported graph runs in torch (its ATen nodes), sorted, for the log."""
    graph = onnx.load_model_from_string(model).graph
    return tuple(
        sorted(
            {
                f"aten::{onnx.helper.get_attribute_value(a).decode()}"
                for n in graph.node
                if n.op_type == "ATen" and n.domain == DOMAIN
                for a in n.attribute
                if a.name == "operator"
            }
        )
    )


def _aten_node(g: Any, op: str, inputs: Sequence[Any], like: Any) -> Any:
    node = g.op(f"{DOMAIN}::ATen", *inputs, operator_s=op, overload_name_s="")
    node.setType(like.type())
    return node


def _constant(g: Any, value: Any, dtype: torch.dtype) -> Any:
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


@helper.parse_args("v", "i", "f", "f")
def histc(g: Any, x: Any, bins: int, low: float, high: float) -> Any:
    """``torch.histc(x, bins, min, max)`` as an ATen node (the output has ``x``'s dtype)."""
    args = [
        x,
        _constant(g, bins, torch.int64),
        _constant(g, low, torch.float32),
        _constant(g, high, torch.float32),
    ]
    return _aten_node(g, "histc", args, x)


SYMBOLICS: Final[dict[str, tuple[Callable[..., Any], int]]] = {"aten::histc": (histc, 9)}
