"""Custom ``torch.autograd.Function``s in an export: each becomes an ORT ``PythonOp`` node.

The TorchScript exporter keeps a Function as ``prim::PythonOp`` (``autograd_inlining=False``);
:func:`pythonop_symbolic`, registered for ortfx's exports only, writes it as
``com.microsoft::PythonOp`` with the attributes ORT 1.19 reads. Each Function class gets a graph
name (its qualified name, ``#n`` for a second class of the same name), under which
:mod:`ortfx.runtime.pythonop` registers it with ORT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import attrs
import onnx
import torch

from ortfx import _torch
from ortfx.errors import OrtfxExportError
from ortfx.function_names import function_graph_name, node_function_name

# Non-numeric constant arguments reach ORT as object addresses: keep the objects alive.
_CONSTANTS: dict[int, Any] = {}

TENSORS_IN_CONTAINER = (
    "the autograd.Function {name} is given tensor(s) inside a {kind} as argument {position} "
    "of apply() (counting from 0). ORT's PythonOp carries only tensors passed directly to "
    "apply() through the graph; a container is kept as the object of the exporting call, so "
    "every later call would see that call's tensors. Pass each tensor as its own argument "
    "({name}.apply(x, *tensors)), or let ortfx run the module in PyTorch (the fallback policy "
    "UNSUPPORTED_ONNX_MODEL, on by default)."
)
NOT_A_TENSOR_OUTPUT = (
    "the autograd.Function {name} returns a value that is not a tensor as output {position} "
    "(counting from 0): a Python number, None or another object. ORT's PythonOp returns "
    "tensors only, and the traced graph would keep the exporting call's value. Return it as a "
    "tensor (torch.tensor(value)) or compute it outside the Function, or let ortfx run the "
    "module in PyTorch (the fallback policy UNSUPPORTED_ONNX_MODEL, on by default)."
)


# What the tracer records for Python arithmetic and comparisons on sizes.
_NUMBER_OPS = frozenset(
    f"aten::{op}"
    for op in (
        *("add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "floordiv"),
        *("remainder", "pow", "neg", "gt", "lt", "ge", "le", "eq", "ne", "__and__", "__or__"),
    )
)
# The traced PythonOp node's attribute listing them (positions in apply()).
NUMBERS = "ortfx_numbers"


def _python_number(value: Any) -> bool:
    """Whether a value of the running trace is a Python number in eager: the tracer makes a
    size (``x.shape[0]``: ``prim::NumToTensor``) and arithmetic on it with Python numbers
    (constants) 0-dim tensors. ``torch.tensor(n)`` and ops with other tensors are tensors."""
    node = value.node()
    kind = node.kind()
    if kind == "prim::NumToTensor":
        return True
    if kind not in _NUMBER_OPS:
        return False
    operands = [v for v in node.inputs() if v.type().kind() == "TensorType"]
    numbers = [_python_number(v) for v in operands]
    constants = [v.node().kind() == "prim::Constant" for v in operands]
    return any(numbers) and all(n or c for n, c in zip(numbers, constants, strict=True))


def mark_numbers(returned: Any) -> None:
    """Note on the traced PythonOp node that returned ``returned`` which tensor arguments of
    its ``apply`` were Python numbers in eager (see :func:`_python_number`). Called as
    ``apply`` returns, while the trace is raw: the exporter's passes later drop what tells a
    size from ``torch.tensor(size)``."""
    outputs = returned if isinstance(returned, tuple) else (returned,)
    first = next((o for o in outputs if isinstance(o, torch.Tensor)), None)
    if first is None:
        return
    node = _torch.traced_node(first)
    if node is None or node.kind() != "prim::PythonOp":
        return
    inputs = iter(node.inputs())
    positions = [p for p, c in enumerate(node.cconv()) if c == "d" and _python_number(next(inputs))]
    if positions:
        node.is_(NUMBERS, positions)


def _holds_tensors(value: Any) -> bool:
    """Whether a constant argument carries tensors: in a container, or a dataclass or attrs
    record (made per call, like a container). Other objects, modules included, are passed
    as themselves."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensors(v) for v in value)
    if (dataclasses.is_dataclass(value) or attrs.has(type(value))) and not isinstance(value, type):
        names = (
            [f.name for f in attrs.fields(type(value))]
            if attrs.has(type(value))
            else [f.name for f in dataclasses.fields(value)]
        )
        return any(_holds_tensors(getattr(value, name)) for name in names)
    return False


# ONNX element types of the TorchScript scalar types a PythonOp input or output can have.
_ONNX_TYPES = {
    "Float": onnx.TensorProto.FLOAT,
    "Double": onnx.TensorProto.DOUBLE,
    "Half": onnx.TensorProto.FLOAT16,
    "BFloat16": onnx.TensorProto.BFLOAT16,
    "Long": onnx.TensorProto.INT64,
    "Int": onnx.TensorProto.INT32,
    "Short": onnx.TensorProto.INT16,
    "Char": onnx.TensorProto.INT8,
    "Byte": onnx.TensorProto.UINT8,
    "Bool": onnx.TensorProto.BOOL,
}


def _is_custom(cls: type) -> bool:
    # ortfx's own Functions (a nested ORTModule's) are not the user's.
    return not cls.__module__.startswith("ortfx.")


# Per thread, the running exports' records of the custom Functions they met (innermost last).
_RECORDING = threading.local()


def record(cls: type) -> None:
    """Note that the running export on this thread met the Function class ``cls``."""
    stack: list[dict[str, type]] = getattr(_RECORDING, "stack", [])
    if stack and _is_custom(cls) and not _inlined(cls):
        stack[-1].setdefault(function_graph_name(cls), cls)


@contextlib.contextmanager
def recorded() -> Iterator[dict[str, type]]:
    """Collect the custom Function classes this thread's export meets (graph name -> class)."""
    found: dict[str, type] = {}
    stack: list[dict[str, type]] = getattr(_RECORDING, "stack", None) or []
    _RECORDING.stack = stack
    stack.append(found)
    try:
        yield found
    finally:
        stack.pop()


# ---- Functions written as plain ops instead ---------------------------------------------------


def _inlined(cls: type) -> bool:
    """Library Functions whose forward is a standard op, written as that op: DeepSpeed's
    ZeRO-3 linear (``F.linear`` replaced process-wide by DeepSpeed) exports as a plain linear,
    so ortfx never has to put ``F.linear`` back while it exports."""
    return cls.__module__ == "deepspeed.runtime.zero.linear" and cls.__name__.startswith(
        "LinearFunctionForZero"
    )


def _linear(g: Any, x: Any, weight: Any, bias: Any = None) -> Any:
    """``F.linear(x, weight, bias)`` as the exporter's own symbolic writes it (Gemm for a
    2-d input with bias, MatMul (+ Add) otherwise): the graph of a plain ``F.linear``."""
    import torch.onnx.symbolic_opset9 as opset9

    if bias is None:
        return opset9.matmul(g, x, opset9.t(g, weight))
    return opset9.linear(g, x, weight, bias)


# ---- the prim::PythonOp symbolic ---------------------------------------------------------------


def pythonop_symbolic(g: Any, *args: Any, **kwargs: Any) -> Any:
    """``prim::PythonOp`` -> ``com.microsoft::PythonOp`` with the attributes ORT 1.19 reads."""
    node = g.original_node
    cls = node.pyobj().__self__
    cconv = node.cconv()
    if _inlined(cls):
        return _linear(g, *(a for a, c in zip(args, cconv, strict=True) if c == "d"))
    record(cls)
    tensors: list[Any] = []
    attributes: dict[str, Any] = {"input_tensor_types_i": [], "input_tensor_ranks_i": []}

    def add(kind: str, value: Any, position: int, suffix: str = "i") -> None:
        attributes.setdefault(f"input_{kind}s_{suffix}", []).append(value)
        attributes.setdefault(f"input_{kind}_positions_i", []).append(position)

    def add_tuple(kind: str, values: list[Any], position: int, suffix: str) -> None:
        begins = attributes.setdefault(f"input_{kind}_tuple_begins_i", [])
        begins.append(len(attributes.get(f"input_{kind}_tuples_{suffix}", [])))
        attributes.setdefault(f"input_{kind}_tuples_{suffix}", []).extend(values)
        attributes.setdefault(f"input_{kind}_tuple_positions_i", []).append(position)

    name = cls.__qualname__
    bools: list[int] = []
    for position, (arg, convention) in enumerate(zip(args, cconv, strict=True)):
        if convention == "d":
            tensors.append(arg)
            if arg.type().scalarType() == "Bool":
                bools.append(position)
            attributes["input_tensor_types_i"].append(_onnx_type(arg, cls))
            attributes["input_tensor_ranks_i"].append(arg.type().dim())
        elif isinstance(arg, bool):  # before int: bool is an int
            add("bool_scalar", int(arg), position)
        elif isinstance(arg, int):
            add("int_scalar", arg, position)
        elif isinstance(arg, float):
            add("float_scalar", arg, position, "f")
        elif isinstance(arg, tuple) and arg and all(type(v) is bool for v in arg):
            add_tuple("bool", [int(v) for v in arg], position, "i")
        elif isinstance(arg, tuple) and arg and all(type(v) is int for v in arg):
            add_tuple("int", list(arg), position, "i")
        elif isinstance(arg, tuple) and arg and all(type(v) is float for v in arg):
            add_tuple("float", list(arg), position, "f")
        elif _holds_tensors(arg):
            kind = type(arg).__name__
            raise OrtfxExportError(
                TENSORS_IN_CONTAINER.format(name=name, kind=kind, position=position)
            )
        else:
            # str, None, mixed tuples, other objects: ORT passes the object itself.
            _CONSTANTS[id(arg)] = arg
            add("pointer_scalar", id(arg), position)
    outputs = list(node.outputs())
    for position, value in enumerate(outputs):
        if value.type().scalarType() is None:  # the tracer types every tensor it returns
            raise OrtfxExportError(NOT_A_TENSOR_OUTPUT.format(name=name, position=position))
    made = g.op(
        "com.microsoft::PythonOp",
        *tensors,
        outputs=len(outputs),
        func_name_s=node_function_name(cls, bools, kwargs.get(NUMBERS, ())),
        input_convention_s=cconv,
        # A bool output crosses as uint8 (ORT 1.19 reads no DLPack bool), cast back below.
        output_tensor_types_i=[
            _onnx_type(o, cls) if not _is_bool(o) else onnx.TensorProto.UINT8 for o in outputs
        ],
        output_tensor_ranks_i=[o.type().dim() for o in outputs],
        # ortfx decides per run whether a backward follows (see runtime/pythonop.py).
        training_mode_i=1,
        **attributes,
    )
    grad_in = any(t.type().requires_grad() for t in tensors)
    results = []
    for value, traced in zip(made if len(outputs) > 1 else (made,), outputs, strict=True):
        # The traced outputs' types: the exporter's shape inference has none of its own for
        # a custom-domain op (it would warn on stderr at every export).
        if _is_bool(traced):
            value.setType(traced.type().with_dtype(torch.uint8))
            value = g.op("Cast", value, to_i=onnx.TensorProto.BOOL)
        elif grad_in and not traced.type().requires_grad():
            # Eager gives this output no gradient (mark_non_differentiable): a gradient stop,
            # or ORT would differentiate through it.
            from ortfx.export import routed  # TorchScript's: only its exports get here

            value.setType(traced.type())
            value = routed.detach(g, value)
        value.setType(traced.type())
        results.append(value)
    return tuple(results) if len(outputs) > 1 else results[0]


def _is_bool(value: Any) -> bool:
    return bool(value.type().scalarType() == "Bool")


def _onnx_type(value: Any, cls: type) -> int:
    scalar = value.type().scalarType()
    if scalar not in _ONNX_TYPES:
        raise OrtfxExportError(
            f"the autograd.Function {cls.__qualname__} takes or returns a tensor of type "
            f"{scalar}, which ORT's PythonOp cannot carry; supported: {', '.join(_ONNX_TYPES)}."
        )
    return _ONNX_TYPES[scalar]


# ---- Function bodies the tracer cannot trace ---------------------------------------------------

CONSTANT_NEEDS_GRAD = "Cannot insert a Tensor that requires grad as a constant"
PROFILER_ACTIVE = (
    "a custom autograd Function's forward could not be traced, and tracing it again without "
    "its body needs a profile hook, which cannot run beside the C-level profiler active on this "
    "thread (cProfile, torch.profiler); export before profiling, or let ortfx run the module in "
    "PyTorch"
)


@contextlib.contextmanager
def bodies_untraced() -> Iterator[None]:
    """Run each custom Function's forward with the TorchScript tracer suspended (an export
    retried after its trace of a Function body failed).

    The graph keeps the Function as a PythonOp that calls it at run time, so its traced body is
    never used; tracing it failed on what eager PyTorch allows in a forward, such as a
    parameter the Function closes over or an ORTModule it calls ("Cannot insert a Tensor that
    requires grad as a constant"). A profile hook (this thread only) sees the forward start
    under ``Function.apply``, however the user bound ``apply``.
    """
    get, put = _torch.tracing_state_access()
    suspended: dict[int, Any] = {}  # id(forward frame) -> the tracing state to restore
    previous = sys.getprofile()
    if not (previous is None or callable(previous)):
        raise RuntimeError(PROFILER_ACTIVE)

    def hook(frame: types.FrameType, event: Any, arg: Any) -> None:
        if event == "call":
            caller = frame.f_back
            called_by_apply = caller is not None and caller.f_code is _torch.FUNCTION_APPLY_CODE
            if called_by_apply and frame.f_code.co_name == "forward":
                suspended[id(frame)] = get()
                put(None)
        elif event == "return" and id(frame) in suspended:
            put(suspended.pop(id(frame)))
            # The Function's outputs, made while the tracer was suspended, get a (dead)
            # value now, while they do not yet require grad: the tracer looks each up as
            # apply returns, and refuses to make a constant of one that requires grad.
            returned = arg if isinstance(arg, tuple) else (arg,)
            for value in returned:
                if isinstance(value, torch.Tensor):
                    _torch.trace_value_of(value)
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(previous)
        for state in suspended.values():  # a forward that raised: restore the outermost
            put(state)
            break
