"""ORT's errors, turned into ortfx's typed errors that name the operator, the input and the fix."""

from __future__ import annotations

import re
from collections.abc import Sequence

import onnx
import torch

from ortfx.errors import (
    EMPTY_TENSOR_TRAINING,
    NOT_FLOAT32,
    UNSUPPORTED_LAYOUT,
    UNSUPPORTED_OP,
    OrtfxEmptyTensorError,
    OrtfxError,
    OrtfxGraphBuildError,
    OrtfxIOError,
    OrtfxRuntimeError,
    OrtfxUnsupportedOpError,
)
from ortfx.model_info import InputKind, PostExportProcessedModelInfo
from ortfx.runtime import pythonop

SESSION_FAILED = (
    "ONNX Runtime could not create the {kind} session for the exported graph: {error}. "
    "Usually an operator has no kernel for these dtypes on {device} in ORT 1.19 (e.g. integer "
    "arithmetic on uint8); compute in a supported dtype, or let ortfx fall back to PyTorch."
)

# Where ORT's error texts name the node or the operator (gradient build and session creation).
_NODE_IN_ERROR = (
    re.compile(r"node with name '([^']+)'"),
    re.compile(r"in node \(([^)]+)\)"),  # a type error: "bound to different types ... in node (n)"
    re.compile(r"for node:? ?(\S+?)\.?(?:\s|$)"),
)
_OP_IN_ERROR = (
    re.compile(r"has not been registered: (\w+)"),
    re.compile(r"implementation for (\w+)\("),
    re.compile(r"(\w+) gradient currently supports"),
    re.compile(r"(\w+) and \w+Grad kernel"),
)
# The sentence of an ORT error after its C++ location and signature.
_DETAIL_AFTER = (
    "was false. ",
    "NOT_IMPLEMENTED : ",
    "RUNTIME_EXCEPTION : ",
    "FAIL : ",
    "() const ",
)


def _detail(text: str) -> str:
    for marker in _DETAIL_AFTER:
        if marker in text:
            text = text.rsplit(marker, 1)[1]
            break
    return text.strip().rstrip(".")[:400]


def unsupported_op(model: bytes, error: Exception, *, what: str) -> OrtfxError | None:
    """An :class:`OrtfxUnsupportedOpError` naming the operator ORT's ``error`` is about, or None
    when the text names none (then the caller's generic error stands)."""
    text = " ".join(str(error).split())
    node = next((m.group(1) for p in _NODE_IN_ERROR if (m := p.search(text))), "")
    forward = node.split("_Grad/", 1)[0]
    ops = {n.name: n.op_type for n in onnx.load_model_from_string(model).graph.node if n.name}
    op = ops.get(forward) or next((m.group(1) for p in _OP_IN_ERROR if (m := p.search(text))), "")
    if not op:
        return None
    op = op.removesuffix("Grad") if op not in ops.values() else op
    message = UNSUPPORTED_OP.format(
        what=what,
        op=op,
        node=f" (node {forward})" if forward else "",
        detail=_detail(text),
    )
    dtypes = _float_dtypes(model) - {"float32"}
    if dtypes and "Could not find an implementation" in text:
        message += " " + NOT_FLOAT32.format(dtypes=", ".join(sorted(dtypes)))
    return OrtfxUnsupportedOpError(message, op=op, node=forward)


_FLOAT_NAMES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
}


def _float_dtypes(model: bytes) -> set[str]:
    """The floating dtypes of the graph's inputs (the module's parameters among them)."""
    graph = onnx.load_model_from_string(model).graph
    types = {i.type.tensor_type.elem_type for i in graph.input}
    return {_FLOAT_NAMES[t] for t in types if t in _FLOAT_NAMES}


def _where(info: PostExportProcessedModelInfo, k: int) -> tuple[str, str]:
    """("input", leaf path) for a user input, (kind, graph name) for a parameter or buffer."""
    spec = info.inputs[k]
    if spec.kind is InputKind.USER and isinstance(spec.source, int):
        return "input", info.input_schema.paths[spec.source]
    return spec.kind.name.lower(), spec.name


def check_not_empty(
    info: PostExportProcessedModelInfo, inputs: Sequence[torch.Tensor], slots: Sequence[int]
) -> None:
    """Raise before ORT's forward: its backward on an empty tensor fails or crashes."""
    for k in slots:
        if inputs[k].numel() == 0:
            where, path = _where(info, k)
            shape = list(inputs[k].shape)
            raise OrtfxEmptyTensorError(
                EMPTY_TENSOR_TRAINING.format(where=where, path=path, shape=shape)
            )


def feed_error(
    info: PostExportProcessedModelInfo, inputs: Sequence[torch.Tensor], error: Exception
) -> Exception:
    """Why ``inputs`` could not cross into ORT: a typed error for what ortfx can name (a
    sparse or other non-dense tensor, which the fast path does not look at), else ``error``."""
    for k, tensor in enumerate(inputs):
        if tensor.layout is not torch.strided:
            where, path = _where(info, k)
            return OrtfxIOError(
                UNSUPPORTED_LAYOUT.format(where=where, path=path, layout=tensor.layout)
            )
    return error


def run_failed(what: str, inputs: Sequence[torch.Tensor], error: Exception) -> BaseException:
    # A custom autograd.Function raised inside the graph: the user gets that exception.
    original = pythonop.take_error()
    if original is not None:
        return original
    from ortfx.passes import ZERO_DIVISION_GUARD

    if ZERO_DIVISION_GUARD in str(error):
        return RuntimeError("ZeroDivisionError")  # torch's exception for integer division
    first = first_line(error)
    shapes = ", ".join(str(list(t.shape)) for t in inputs)
    return OrtfxRuntimeError(
        f"ONNX Runtime failed to run the {what} graph on inputs of shapes {shapes}: {first}"
    )


GRADIENT_BUILD_FAILED = (
    "ONNX Runtime could not build the gradient graph: {error}. Save the graphs with "
    "DebugOptions(save_onnx=True, onnx_prefix=...) to see the operator involved, try "
    "Options(enable_compute_optimizer=False) or the other exporter, or let ortfx fall back "
    "to PyTorch."
)


def build_failed(model: bytes, error: Exception) -> OrtfxError:
    """The operator ORT cannot differentiate, named; else the generic build failure."""
    named = unsupported_op(model, error, what="differentiate")
    if named is not None:
        return named
    return OrtfxGraphBuildError(GRADIENT_BUILD_FAILED.format(error=first_line(error)))


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
