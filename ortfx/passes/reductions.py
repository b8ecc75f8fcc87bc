"""Gradient-model pass: drop the broadcast reductions that can never reduce anything.

ORT's gradient builder does not know the shapes of a graph exported with dynamic sizes, so the
gradient of every broadcasting op (``Mul``, ``Add``, ``Sub``, ``Div``, ``Pow``, ``Where``...)
sums the incoming gradient over the broadcast axes computed at run time:
``BroadcastGradientArgs(Shape(A), Shape(B))`` gives the axes, ``ReduceSum(dY, axes,
noop_with_empty_axes=1)`` sums over them. When A has the output's shape, the axes are empty and
the ``ReduceSum`` copies ``dY`` whole: in the GPT-2-like model 86 of its 103 such reductions
are copies, 7 ms of a 290 ms step at 2 threads.

The pass replaces a reduction by ``Identity`` when its axes are empty for every input size,
proven one of three ways:

- the other operand is a rank-0 constant;
- both operands are in one class of equal shape: a shape is often known to equal another
  without being known (``Sigmoid(x)`` has ``x``'s, ``x * 0.5`` too), so tensors joined by
  elementwise ops whose inputs are all of one class or rank-0 constants share a class;
- ONNX shape inference over the forward model (its own sizes, symbolic ones named after the
  graph inputs' dynamic axes) gives both shapes, and every axis of the other operand is 1 or
  the same size or symbol as this one's (a bias of [256] against [batch, seq, 256]).

Sound, never complete: an unproven case keeps its reduction. (And a wrong drop could not be
silent: the gradient is then reshaped to the operand's shape, which fails on a size mismatch.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import onnx

# A tensor's dims from shape inference: a size, a symbol, or None (unknown, equal to nothing).
Shape = tuple[int | str | None, ...]

# Ops whose outputs have the shape of their first input: all outputs, or those listed.
_SAME_AS_FIRST: Final = frozenset(
    {
        "Abs", "Cast", "Ceil", "Clip", "Cos", "Elu", "Erf", "Exp", "Floor", "HardSigmoid",
        "Identity", "IsInf", "IsNaN", "LeakyRelu", "Log", "LogSoftmax", "Neg", "Not",
        "Reciprocal", "Relu", "Round", "Sigmoid", "Sign", "Sin", "Softmax", "Softplus", "Sqrt",
        "Tanh", "Dropout", "LayerNormalization",
    }
)  # fmt: skip
# com.microsoft ops of the same kind (the gelu forms ORT fuses, its layer norms).
_SAME_AS_FIRST_MICROSOFT: Final = frozenset(
    {"FastGelu", "BiasGelu", "Gelu", "QuickGelu", "SimplifiedLayerNormalization",
     "SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "BitmaskDropout"}
)  # fmt: skip
# Of these, only the listed outputs (a layer norm's mean and inverse deviation are reduced;
# a bitmask has its own shape).
_OUTPUTS: Final = {
    "LayerNormalization": (0,),
    "SimplifiedLayerNormalization": (0,),
    "SkipLayerNormalization": (0,),
    "SkipSimplifiedLayerNormalization": (0,),
    "BitmaskDropout": (0,),
}
# Broadcasting elementwise ops: the output has the broadcast shape of all inputs.
_BROADCASTING: Final = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "Equal", "Less",
        "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Mod",
    }
)  # fmt: skip


class _Classes:
    """Union-find over tensor names: one class per set of tensors of equal shape."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, name: str) -> str:
        root = self.parent.setdefault(name, name)
        while root != self.parent[root]:
            root = self.parent[root]
        while name != root:  # path compression
            self.parent[name], name = root, self.parent[name]
        return root

    def join(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


def _rank0_constants(graph: onnx.GraphProto) -> set[str]:
    """Names of tensors known to be rank 0 (scalars) whatever the input sizes."""
    scalars = {t.name for t in graph.initializer if len(t.dims) == 0}
    for value in graph.input:
        tensor = value.type.tensor_type
        if tensor.HasField("shape") and len(tensor.shape.dim) == 0:
            scalars.add(value.name)
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attribute in node.attribute:
                if attribute.name == "value" and len(attribute.t.dims) == 0:
                    scalars.add(node.output[0])
    return scalars


def _same_as_first(node: onnx.NodeProto) -> bool:
    if node.domain == "com.microsoft":
        return node.op_type in _SAME_AS_FIRST_MICROSOFT
    return node.domain in ("", "ai.onnx") and node.op_type in _SAME_AS_FIRST


def _equal_shapes(graph: onnx.GraphProto, scalars: set[str]) -> _Classes:
    classes = _Classes()
    for node in graph.node:
        if not node.input or not node.input[0]:
            continue
        if _same_as_first(node):
            positions = _OUTPUTS.get(node.op_type, range(len(node.output)))
            for k in positions:
                if k < len(node.output) and node.output[k]:
                    classes.join(node.output[k], node.input[0])
        elif node.domain in ("", "ai.onnx") and node.op_type in _BROADCASTING:
            shaped = [i for i in node.input if i and i not in scalars]
            if shaped and all(classes.find(i) == classes.find(shaped[0]) for i in shaped):
                classes.join(node.output[0], shaped[0])
    return classes


def forward_shapes(forward: bytes) -> dict[str, Shape]:
    """Every tensor's shape in a forward model as ONNX shape inference derives it from the
    graph inputs alone (the exporter's own annotations are dropped first: its symbols are not
    all derived from the inputs'); empty if inference fails."""
    model = onnx.load_model_from_string(forward)
    del model.graph.value_info[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # an op inference rejects: prove nothing from shapes
        return {}
    shapes: dict[str, Shape] = {}
    graph = inferred.graph
    for value in (*graph.value_info, *graph.input, *graph.output):
        tensor = value.type.tensor_type
        if tensor.HasField("shape"):
            shapes[value.name] = tuple(_dim(d) for d in tensor.shape.dim)
    for initializer in graph.initializer:
        shapes[initializer.name] = tuple(int(n) for n in initializer.dims)
    return shapes


def _dim(dim: onnx.TensorShapeProto.Dimension) -> int | str | None:
    if dim.HasField("dim_value"):
        return int(dim.dim_value)
    return dim.dim_param or None


def _covers(this: Shape, other: Shape) -> bool:
    """Whether broadcasting ``this`` with ``other`` gives ``this``'s shape for every input
    size: ``other`` has no more axes, and each of its axes is 1 or the same as ``this``'s."""
    if len(other) > len(this):
        return False
    aligned = zip(reversed(this), reversed(other), strict=False)
    return all(b == 1 or (a is not None and a == b) for a, b in aligned)


def drop_empty_broadcast_reductions(
    model: onnx.ModelProto, shapes: Mapping[str, Shape] | None = None
) -> int:
    """Replace each gradient ``ReduceSum`` whose broadcast axes are empty for every input
    size by ``Identity`` (which ORT then removes); returns how many were replaced.
    ``shapes`` are the forward tensors' (:func:`forward_shapes`)."""
    shapes = shapes or {}
    graph = model.graph
    scalars = _rank0_constants(graph)
    classes = _equal_shapes(graph, scalars)
    producer = {out: node for node in graph.node for out in node.output}

    def shape_of(name: str) -> str | None:
        node = producer.get(name)
        if node is None or node.op_type != "Shape" or node.domain not in ("", "ai.onnx"):
            return None
        # A whole shape: ORT's builder writes start=0 explicitly.
        if any(a.name == "end" or (a.name == "start" and a.i != 0) for a in node.attribute):
            return None
        return str(node.input[0])

    empty: set[str] = set()  # BroadcastGradientArgs outputs that are always empty
    for node in graph.node:
        if node.op_type != "BroadcastGradientArgs" or node.domain != "com.microsoft":
            continue
        a, b = (shape_of(i) for i in node.input[:2])
        if a is None or b is None:
            continue
        same = classes.find(a) == classes.find(b)
        for k, (this, other) in enumerate(((a, b), (b, a))):
            if k >= len(node.output) or not node.output[k]:
                continue
            known = this in shapes and other in shapes
            if same or other in scalars or (known and _covers(shapes[this], shapes[other])):
                empty.add(node.output[k])
    replaced = 0
    for node in graph.node:
        if node.op_type != "ReduceSum" or node.domain not in ("", "ai.onnx"):
            continue
        if len(node.input) < 2 or node.input[1] not in empty:
            continue
        noop = next((a.i for a in node.attribute if a.name == "noop_with_empty_axes"), 0)
        if noop != 1:  # empty axes without noop_with_empty_axes would reduce everything
            continue
        identity = onnx.helper.make_node(
            "Identity", [node.input[0]], list(node.output), name=f"{node.name}_empty_axes"
        )
        node.CopyFrom(identity)
        replaced += 1
    return replaced
