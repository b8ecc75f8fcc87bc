"""What a custom Function's ``backward`` returned, checked and shaped the way torch's engine does.

ORT's ``PythonOpGrad`` wants exactly one tensor per forward input that requires grad, of that
input's shape and dtype. Eager PyTorch accepts more than that, and rejects some values with its
own messages; :func:`eager_gradients` applies eager's rules (``validate_outputs`` and the
custom-Function checks of torch's engine) to the values the bridge called ``backward`` for
directly, so that every value eager accepts trains the same, and every value it rejects raises
its error text:

* extra trailing ``None``\\ s are dropped; any other count raises eager's "incorrect number of
  gradients";
* a non-tensor that is not ``None`` raises "expected Variable or None";
* a gradient for a non-tensor argument raises eager's "different than None" error; one for a
  tensor that does not require grad is ignored, as eager does;
* a gradient of another dtype is cast to the input's; of a shape the input expands to, summed
  down to it; any other shape raises eager's "invalid gradient";
* ``None`` for an input that requires grad is eager's "no gradient from here", which ORT can
  only express as zeros: the bridge hands ORT zeros and records where, and
  :func:`no_gradient_inputs` finds the graph inputs that then get no gradient at all.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, Final

import attrs
import onnx
import torch

from ortfx import aten
from ortfx.function_names import parse_node_name
from ortfx.runtime import memgrad

WRONG_COUNT = "function {name} returned an incorrect number of gradients (expected {n}, got {got})"
NOT_A_TENSOR = "expected Variable or None (got {kind})"
NOT_A_VARIABLE = (
    "function {name} returned a gradient different than None at position {position}, but the "
    "corresponding forward input was not a Variable"
)
WRONG_SHAPE = (
    "Function {name} returned an invalid gradient at index {index} - got {got} but expected "
    "shape compatible with {expected}"
)
WRONG_KIND = (
    "Function {name} returned an invalid gradient at index {index} - expected dtype {expected} "
    "but got {got} (a complex gradient for a real input, or the reverse)"
)


def _expands_to(shape: torch.Size, target: torch.Size) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (torch's ``is_expandable_to``)."""
    if len(shape) > len(target):
        return False
    return all(s == t or s == 1 for s, t in zip(reversed(shape), reversed(target), strict=False))


def _fitted(name: str, index: int, grad: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    if grad.shape != leaf.shape:
        if not _expands_to(leaf.shape, grad.shape):
            raise RuntimeError(
                WRONG_SHAPE.format(
                    name=name, index=index, got=list(grad.shape), expected=list(leaf.shape)
                )
            )
        grad = grad.sum_to_size(leaf.shape)
    if grad.dtype != leaf.dtype:
        if not grad.is_floating_point() and grad.is_complex() != leaf.is_complex():
            raise RuntimeError(
                WRONG_KIND.format(name=name, index=index, expected=leaf.dtype, got=grad.dtype)
            )
        grad = grad.to(leaf.dtype)
    if grad.device != leaf.device:
        grad = grad.to(leaf.device)
    return grad


def eager_gradients(
    name: str,
    returned: Any,
    leaves: Sequence[torch.Tensor | None],
    tensors: Sequence[bool],
) -> list[torch.Tensor | None]:
    """One gradient per forward argument: a tensor or None (no gradient) for each that
    requires grad, None for the others.

    ``name`` is the autograd node's name (``FooBackward``), as eager's messages give it;
    ``leaves[i]`` is the tensor argument ``i`` that requires grad (None otherwise);
    ``tensors[i]`` says argument ``i`` was a tensor.
    """
    values = returned if isinstance(returned, tuple) else (returned,)
    n = len(leaves)
    if len(values) > n and all(v is None for v in values[n:]):
        values = values[:n]
    if len(values) != n:
        raise RuntimeError(WRONG_COUNT.format(name=name, n=n, got=len(values)))
    result: list[torch.Tensor | None] = []
    for index, (value, leaf, is_tensor) in enumerate(zip(values, leaves, tensors, strict=True)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise RuntimeError(NOT_A_TENSOR.format(kind=type(value).__name__))
        if value is not None and not is_tensor:
            raise RuntimeError(NOT_A_VARIABLE.format(name=name, position=index))
        if leaf is None or value is None:
            result.append(None)  # eager drops a gradient for an input that needs none
        else:
            result.append(_fitted(name, index, value, leaf))
    return result


def fits(returned: Any, leaves: Sequence[torch.Tensor | None]) -> bool:
    """The common case, cheap to check: one value per argument, and a tensor of the input's
    own shape, dtype and device for each input that requires grad."""
    if not isinstance(returned, tuple) or len(returned) != len(leaves):
        return len(leaves) == 1 and _same(returned, leaves[0])
    return all(_same(value, leaf) for value, leaf in zip(returned, leaves, strict=True))


def _same(value: Any, leaf: torch.Tensor | None) -> bool:
    if leaf is None:
        return value is None
    return (
        isinstance(value, torch.Tensor)
        and value.shape == leaf.shape
        and value.dtype == leaf.dtype
        and value.device == leaf.device
    )


@attrs.frozen
class _Node:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    stopped: frozenset[int]  # input indices gradients never cross (an ATen detach)
    number: int | None  # a PythonOp's number among the graph's PythonOps
    positions: tuple[int, ...]  # a PythonOp's apply() position of each tensor input


@attrs.frozen
class _Graph:
    nodes: tuple[_Node, ...]
    outputs: frozenset[str]
    fed: dict[int, str]  # parameter index -> the value its feed node gives ORT (memgrad)


# Standard ops whose outputs carry no gradient to any input: sizes, comparisons, logic and
# index-valued results (an integer Cast too, below).
_NO_GRADIENT: Final = frozenset(
    {
        "Shape", "Size", "ArgMax", "ArgMin", "NonZero", "Equal", "Less", "LessOrEqual",
        "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN", "IsInf",
    }
)  # fmt: skip
_FLOATS: Final = frozenset(
    {
        onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
    }
)  # fmt: skip


@functools.lru_cache(maxsize=8)  # bytes cache their hash: a repeated lookup is cheap
def _graph(model: bytes) -> _Graph:
    graph = onnx.load_model_from_string(model).graph
    nodes = []
    fed: dict[int, str] = {}
    for node in graph.node:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        stopped: frozenset[int] = frozenset()
        if node.op_type == "ATen" and node.domain == aten.DOMAIN:
            stopped = frozenset(aten.STOP_GRADIENT.get(attributes["operator"].decode(), ()))
        elif node.domain in ("", "ai.onnx") and (
            node.op_type in _NO_GRADIENT
            or (node.op_type == "Cast" and attributes.get("to") not in _FLOATS)
        ):
            stopped = frozenset(range(len(node.input)))
        number: int | None = None
        positions: tuple[int, ...] = ()
        if node.op_type == "PythonOp" and node.domain == "com.microsoft":
            if attributes["func_name"].decode() == memgrad.FUNCTION_NAME:
                fed[attributes["input_int_scalars"][0]] = node.output[1]
            number = parse_node_name(attributes["func_name"].decode()).node
            convention = attributes["input_convention"].decode()
            positions = tuple(i for i, c in enumerate(convention) if c == "d")
        nodes.append(_Node(tuple(node.input), tuple(node.output), stopped, number, positions))
    return _Graph(tuple(nodes), frozenset(o.name for o in graph.output), fed)


def fed_value(model: bytes, index: int) -> str:
    """The value through which memory-efficient gradients feed parameter ``index``."""
    return _graph(model).fed[index]


def no_gradient_inputs(
    model: bytes,
    cut: Iterable[tuple[int, int]],
    names: Iterable[str],
    seeded: Iterable[str] | None = None,
) -> frozenset[str]:
    """Which of the graph inputs (or fed values) ``names`` get no gradient at all, eager's
    ``None``, when the PythonOp backwards ``cut`` (node number, apply() position) gave none
    and only the graph outputs ``seeded`` (all of them when None) got a gradient.

    Eager PyTorch's engine passes "no gradient" on: an op whose outputs all got none gives
    none to its inputs, and a tensor from which no output that got a gradient is computed
    (a head whose output the loss does not use) gets none. A custom Function's backward runs
    whenever its node is reached (with zeros for the missing grads, by default), so only the
    inputs it returned None for get none from it. Sizes, comparisons and integer casts
    carry no gradient (in eager they are Python numbers or tensors without ``grad_fn``).
    """
    return _no_gradient_inputs(
        model,
        frozenset(cut),
        tuple(names),
        None if seeded is None else frozenset(seeded),
    )


@functools.lru_cache(maxsize=16)
def _no_gradient_inputs(
    model: bytes,
    cut: frozenset[tuple[int, int]],
    names: tuple[str, ...],
    seeded: frozenset[str] | None,
) -> frozenset[str]:
    given = _given(model, cut, seeded)
    return frozenset(name for name in names if name not in given)


def receives_gradient(model: bytes, value: str, seeded: Iterable[str]) -> bool:
    """Whether a gradient reaches ``value`` from the graph outputs ``seeded`` (through nodes
    that pass one: not sizes, comparisons, integer casts or a detach)."""
    return value in _given(model, frozenset(), frozenset(seeded))


def _given(
    model: bytes, cut: frozenset[tuple[int, int]], seeded: frozenset[str] | None
) -> set[str]:
    graph = _graph(model)
    nodes = graph.nodes
    outputs = graph.outputs if seeded is None else seeded
    reached = set(outputs)  # has a path to an output that got a gradient
    given = set(outputs)  # ... and gets a gradient along it
    for node in reversed(nodes):  # ONNX orders nodes topologically
        runs = any(o in reached for o in node.outputs)
        if not runs:
            continue
        gives = node.number is not None or any(o in given for o in node.outputs)
        for k, value in enumerate(node.inputs):
            if k in node.stopped:
                continue
            reached.add(value)
            if gives and (node.number is None or (node.number, node.positions[k]) not in cut):
                given.add(value)
    return given
