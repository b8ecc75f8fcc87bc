"""Rewrites around ORT 1.19 faults, each into an equivalent graph ORT runs soundly: a stop edge
its gradient builder crosses, integer division by zero (the process dies), reductions whose
gradient it builds wrong, ``Where`` operands whose broadcast gradient it does not reduce, and
grouped 1-d convolutions whose CPU gradient writes out of bounds; and hard activations it
cannot differentiate at all."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from ortfx import aten
from ortfx.passes.core import graph_pass, is_standard


@graph_pass
def stop_edges_behind_identity(model: onnx.ModelProto) -> bool:
    """An ATen node's stop-gradient input (``aten.STOP_GRADIENT``: ``x.detach()``) that is a
    graph input (a parameter, a user input) reads it through an ``Identity``.

    ORT's gradient builder does not cross a stop edge, except on the direct consumers of an
    input that requires grad: it differentiates those regardless, and such an ATen node has no
    gradient, so the build failed. Through the ``Identity`` the stop edge holds (eager: no
    gradient).
    """
    inputs = {v.name for v in model.graph.input}
    nodes: list[onnx.NodeProto] = []
    changed = False
    for i, node in enumerate(model.graph.node):
        operator = next((a.s.decode() for a in node.attribute if a.name == "operator"), "")
        stopped = aten.STOP_GRADIENT.get(operator, ()) if node.op_type == "ATen" else ()
        for position in stopped:
            if position < len(node.input) and node.input[position] in inputs:
                read = f"{node.name or f'{operator}_{i}'}_input_{position}"
                nodes.append(
                    onnx.helper.make_node("Identity", [node.input[position]], [read], name=read)
                )
                node.input[position] = read
                changed = True
        nodes.append(node)
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return changed


ZERO_DIVISION_GUARD = "ortfx_zero_division_guard"
_INTEGER_TYPES = frozenset(
    {
        onnx.TensorProto.INT8,
        onnx.TensorProto.INT16,
        onnx.TensorProto.INT32,
        onnx.TensorProto.INT64,
        onnx.TensorProto.UINT8,
        onnx.TensorProto.UINT16,
        onnx.TensorProto.UINT32,
        onnx.TensorProto.UINT64,
    }
)


def _nonzero_constant(model: onnx.ModelProto, name: str) -> bool:
    """Whether ``name`` is a constant with no zero in it."""
    for init in model.graph.initializer:
        if init.name == name:
            return bool(onnx.numpy_helper.to_array(init).all())
    for node in model.graph.node:
        if is_standard(node, "Constant") and node.output[0] == name:
            value = next((a for a in node.attribute if a.name == "value"), None)
            return value is not None and bool(onnx.numpy_helper.to_array(value.t).all())
    return False


@graph_pass
def guard_integer_division(model: onnx.ModelProto) -> bool:
    """Integer ``Div``/``Mod`` by a divisor that may be zero fail cleanly instead of crashing.

    ORT's integer kernels divide by zero in C, which kills the process (SIGFPE); torch raises
    ``RuntimeError: ZeroDivisionError``. Before each such node a guard reshapes a one-element
    tensor to ``[1 + any(divisor == 0)]``, which ORT rejects with an error naming the guard
    (the runtime turns it into torch's exception); its all-zero sum is added to the divisor so
    the guard runs first. Divisors that are constants without zeros get no guard.
    """
    candidates = [
        n
        for n in model.graph.node
        if (is_standard(n, "Div") or is_standard(n, "Mod")) and len(n.input) == 2
    ]
    candidates = [n for n in candidates if not _nonzero_constant(model, n.input[1])]
    if not candidates:
        return False
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    }
    for init in model.graph.initializer:
        types.setdefault(init.name, init.data_type)
    guarded = {id(n) for n in candidates if types.get(n.input[1]) in _INTEGER_TYPES}
    if not guarded:
        return False
    h = onnx.helper
    i64 = onnx.TensorProto.INT64
    nodes: list[onnx.NodeProto] = []
    for k, node in enumerate(model.graph.node):
        if id(node) not in guarded:
            nodes.append(node)
            continue
        tag = f"{ZERO_DIVISION_GUARD}_{k}"
        divisor, kind = node.input[1], types[node.input[1]]
        nodes += [
            h.make_node(
                "Constant", [], [f"{tag}_zero"], value=h.make_tensor(f"{tag}_z", kind, [], [0])
            ),
            h.make_node(
                "Constant", [], [f"{tag}_one"], value=h.make_tensor(f"{tag}_o", i64, [1], [1])
            ),
            h.make_node(
                "Constant", [], [f"{tag}_cell"], value=h.make_tensor(f"{tag}_c", i64, [1], [0])
            ),
            h.make_node("Equal", [divisor, f"{tag}_zero"], [f"{tag}_is_zero"]),
            h.make_node("Cast", [f"{tag}_is_zero"], [f"{tag}_zeros"], to=i64),
            h.make_node("ReduceMax", [f"{tag}_zeros"], [f"{tag}_any"], keepdims=1),
            h.make_node("Reshape", [f"{tag}_any", f"{tag}_one"], [f"{tag}_any1"]),
            h.make_node("Add", [f"{tag}_one", f"{tag}_any1"], [f"{tag}_shape"]),
            h.make_node("Reshape", [f"{tag}_cell", f"{tag}_shape"], [f"{tag}_checked"], name=tag),
            h.make_node("ReduceSum", [f"{tag}_checked"], [f"{tag}_sum"], keepdims=0),
            h.make_node("Cast", [f"{tag}_sum"], [f"{tag}_nothing"], to=kind),
            h.make_node("Add", [divisor, f"{tag}_nothing"], [f"{tag}_divisor"]),
        ]
        node.input[1] = f"{tag}_divisor"
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return True


# Reductions whose ORT 1.19 gradient builder writes an attribute-style Unsqueeze (opset < 13)
# when keepdims=0, which an opset 13+ graph rejects ("input size 1 not in range [min=2]").
_KEEPDIMS_GRAD_BROKEN = frozenset({"ReduceL2", "ReduceLogSumExp"})


def _constant_ints(model: onnx.ModelProto, name: str) -> list[int] | None:
    for node in model.graph.node:
        if is_standard(node, "Constant") and node.output[0] == name:
            value = next((a for a in node.attribute if a.name == "value"), None)
            return (
                None
                if value is None
                else [int(v) for v in onnx.numpy_helper.to_array(value.t).ravel()]
            )
    for init in model.graph.initializer:
        if init.name == name:
            return [int(v) for v in onnx.numpy_helper.to_array(init).ravel()]
    return None


@graph_pass
def reductions_keep_dims(model: onnx.ModelProto) -> bool:
    """``ReduceL2``/``ReduceLogSumExp`` with ``keepdims=0`` (``x.norm(dim=1)``,
    ``torch.logsumexp``) become ``keepdims=1`` and a ``Squeeze`` of the reduced axes, whose
    gradients ORT builds correctly. Reductions over every axis are reshaped to a scalar."""
    h = onnx.helper
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    nodes: list[onnx.NodeProto] = []
    changed = False
    for k, node in enumerate(model.graph.node):
        keep = next((a for a in node.attribute if a.name == "keepdims"), None)
        if not (
            node.op_type in _KEEPDIMS_GRAD_BROKEN
            and node.domain in ("", "ai.onnx")
            and keep is not None
            and keep.i == 0
        ):
            nodes.append(node)
            continue
        attribute_axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
        axes = attribute_axes
        if axes is None and len(node.input) > 1 and node.input[1]:
            axes = _constant_ints(model, node.input[1])
            if axes is None:  # axes computed in the graph: leave the node as it is
                nodes.append(node)
                continue
        tag = f"ortfx_keepdims_{k}"
        out = node.output[0]
        keep.i = 1
        node.output[0] = f"{tag}_kept"
        nodes.append(node)
        if axes and opset < 13:  # Squeeze took its axes as an attribute before opset 13
            nodes.append(h.make_node("Squeeze", [f"{tag}_kept"], [out], name=tag, axes=axes))
        elif axes:
            value = h.make_tensor(f"{tag}_axes_value", onnx.TensorProto.INT64, [len(axes)], axes)
            nodes.append(h.make_node("Constant", [], [f"{tag}_axes"], name=f"{tag}_a", value=value))
            nodes.append(h.make_node("Squeeze", [f"{tag}_kept", f"{tag}_axes"], [out], name=tag))
        else:
            value = h.make_tensor(f"{tag}_shape_value", onnx.TensorProto.INT64, [0], [])
            nodes.append(
                h.make_node("Constant", [], [f"{tag}_shape"], name=f"{tag}_s", value=value)
            )
            nodes.append(h.make_node("Reshape", [f"{tag}_kept", f"{tag}_shape"], [out], name=tag))
        changed = True
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return changed


_FLOATS: frozenset[int] = frozenset(
    (
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.DOUBLE,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
    )
)


def _same_shape(a: onnx.TypeProto, b: onnx.TypeProto) -> bool:
    """Whether inference proves two tensors have one shape (equal values or equal named dims;
    the ``unk__`` names inference makes up prove nothing)."""
    if not (a.tensor_type.HasField("shape") and b.tensor_type.HasField("shape")):
        return False
    da, db = a.tensor_type.shape.dim, b.tensor_type.shape.dim
    return len(da) == len(db) and all(
        (x.dim_value > 0 and x.dim_value == y.dim_value)
        or (
            bool(x.dim_param) and x.dim_param == y.dim_param and not x.dim_param.startswith("unk__")
        )
        for x, y in zip(da, db, strict=True)
    )


def _broadcasts_nothing(t: onnx.TypeProto | None) -> bool:
    """A scalar or all-ones shape: expanding to it changes nothing."""
    return (
        t is not None
        and t.tensor_type.HasField("shape")
        and all(d.dim_value == 1 for d in t.tensor_type.shape.dim)
    )


@graph_pass
def where_gradients_reduce(model: onnx.ModelProto) -> bool:
    """Expand each float value operand of ``Where`` that may broadcast to the output's shape.

    ORT's ``Where`` gradient hands an operand the output's full-shaped gradient, never summed
    over the axes the operand was broadcast along (``torch.where(mask, bias, x)`` with a
    ``[1, heads, q, k]`` bias, T5's position bias under an attention mask): the next gradient
    node fails on the shape, or, for a parameter, torch sums it at the boundary. An explicit
    ``Expand`` first makes the operand full-shaped, and ORT's ``Expand`` gradient reduces
    correctly. Operands inference proves full-shaped are left alone (an Expand would copy).
    """
    wheres = [n for n in model.graph.node if is_standard(n, "Where")]
    if not wheres:
        return False
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    types = {v.name: v.type for v in [*inferred.value_info, *inferred.input, *inferred.output]}
    constants = {o for n in model.graph.node if is_standard(n, "Constant") for o in n.output}
    inputs = {i.name for i in model.graph.input}
    constants |= {t.name for t in model.graph.initializer if t.name not in inputs}
    h = onnx.helper
    nodes: list[onnx.NodeProto] = []
    changed = False
    for i, node in enumerate(model.graph.node):
        if not is_standard(node, "Where"):
            nodes.append(node)
            continue
        out = types.get(node.output[0])
        for k in (1, 2):
            value = node.input[k]
            kind = types.get(value)
            if value in constants or (kind and kind.tensor_type.elem_type not in _FLOATS):
                continue
            if kind is not None and out is not None and _same_shape(kind, out):
                continue
            tag = f"{node.name or f'Where_{i}'}_expand{k}"
            full = value
            for j, other in enumerate((node.input[0], node.input[3 - k])):
                if _broadcasts_nothing(types.get(other)):
                    continue
                nodes.append(
                    h.make_node("Shape", [other], [f"{tag}_shape{j}"], name=f"{tag}_shape{j}")
                )
                nodes.append(
                    h.make_node(
                        "Expand", [full, f"{tag}_shape{j}"], [f"{tag}_{j}"], name=f"{tag}_{j}"
                    )
                )
                full = f"{tag}_{j}"
            node.input[k] = full
            changed = changed or full != value
        nodes.append(node)
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return changed


def _unsqueeze_2(name: str, out: str, axis: str, opset: int) -> onnx.NodeProto:
    """``Unsqueeze(name, axes=[2])`` in the form of ``opset`` (``axis`` names the constant)."""
    if opset >= 13:
        return onnx.helper.make_node("Unsqueeze", [name, axis], [out], name=out)
    return onnx.helper.make_node("Unsqueeze", [name], [out], name=out, axes=[2])


@graph_pass
def conv1d_grouped_as_2d(model: onnx.ModelProto) -> bool:
    """Run each grouped 1-d ``Conv`` as a 2-d one over a height of 1.

    ORT 1.19's CPU gradient of a 1-d convolution with ``group > 1`` writes past the end of a
    buffer (measured: glibc aborts with the arena off; with it, a neighbouring tensor is
    overwritten and a gradient comes out silently wrong, as in wav2vec2's positional
    convolution). The 2-d grouped kernel is sound, and ``Unsqueeze``/``Squeeze`` around it
    cost nothing (views).
    """
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    h = onnx.helper
    nodes: list[onnx.NodeProto] = []
    changed = False
    for i, node in enumerate(model.graph.node):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        one_d = len(attrs.get("kernel_shape", [])) == 1
        auto = attrs.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
        if not (is_standard(node, "Conv") and attrs.get("group", 1) > 1 and one_d and auto):
            nodes.append(node)
            continue
        tag = f"{node.name or f'Conv_{i}'}_as_2d"

        if opset >= 13:
            axis = h.make_tensor(f"{tag}_axis_value", onnx.TensorProto.INT64, [1], [2])
            nodes.append(
                h.make_node("Constant", [], [f"{tag}_axis"], name=f"{tag}_axis", value=axis)
            )
        nodes += [
            _unsqueeze_2(node.input[0], f"{tag}_x", f"{tag}_axis", opset),
            _unsqueeze_2(node.input[1], f"{tag}_w", f"{tag}_axis", opset),
        ]
        pads = list(attrs.get("pads", [0, 0]))
        conv_attrs = {
            "group": attrs["group"],
            "kernel_shape": [1, *attrs["kernel_shape"]],
            "strides": [1, *attrs.get("strides", [1])],
            "dilations": [1, *attrs.get("dilations", [1])],
            "pads": [0, pads[0], 0, pads[1]],
        }
        inputs = [f"{tag}_x", f"{tag}_w", *node.input[2:]]
        nodes.append(h.make_node("Conv", inputs, [f"{tag}_y"], name=f"{tag}_conv", **conv_attrs))
        if opset >= 13:
            squeeze = h.make_node(
                "Squeeze", [f"{tag}_y", f"{tag}_axis"], list(node.output), name=tag
            )
        else:
            squeeze = h.make_node("Squeeze", [f"{tag}_y"], list(node.output), name=tag, axes=[2])
        nodes.append(squeeze)
        changed = True
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return changed


# numpy dtypes of the float element types the hard activations are rewritten for.
_HARD_DTYPES = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.FLOAT16: np.float16,
}


def _hard_activation(node: onnx.NodeProto, tag: str, dtype: Any) -> list[onnx.NodeProto]:
    """``HardSwish``/``HardSigmoid`` as comparisons, ``Where`` and arithmetic, with torch's
    gradients at the kinks: torch's slopes hold on the open interval ``(-3, 3)`` only
    (hardswish's is 0 at -3 and 1 at 3, hardsigmoid's 0 at both)."""
    h = onnx.helper
    x, out = node.input[0], node.output[0]
    nodes: list[onnx.NodeProto] = []

    def constant(name: str, value: float) -> str:
        tensor = onnx.numpy_helper.from_array(np.array(value, dtype=dtype), f"{tag}_{name}_value")
        nodes.append(
            h.make_node("Constant", [], [f"{tag}_{name}"], name=f"{tag}_{name}", value=tensor)
        )
        return f"{tag}_{name}"

    def op(kind: str, inputs: list[str], name: str, output: str = "") -> str:
        nodes.append(h.make_node(kind, inputs, [output or f"{tag}_{name}"], name=f"{tag}_{name}"))
        return output or f"{tag}_{name}"

    zero = constant("zero", 0.0)
    if node.op_type == "HardSwish":
        # torch: x * min(max(x + 3, 0), 6) / 6; zero up to -3, x itself from 3.
        low = op("LessOrEqual", [x, constant("low", -3.0)], "below")
        high = op("GreaterOrEqual", [x, constant("high", 3.0)], "above")
        product = op("Mul", [x, op("Add", [x, constant("three", 3.0)], "shifted")], "product")
        middle = op("Div", [product, constant("six", 6.0)], "middle")
        upper = op("Where", [high, x, middle], "upper")
        op("Where", [low, zero, upper], "", out)
        return nodes
    attributes = {a.name: h.get_attribute_value(a) for a in node.attribute}
    alpha, beta = float(attributes.get("alpha", 0.2)), float(attributes.get("beta", 0.5))
    # The kinks in x, where alpha * x + beta leaves [0, 1]: -3 and 3 for torch's 1/6 and 1/2.
    low = op("LessOrEqual", [x, constant("low", -beta / alpha)], "below")
    high = op("GreaterOrEqual", [x, constant("high", (1.0 - beta) / alpha)], "above")
    scaled = op("Mul", [x, constant("alpha", alpha)], "scaled")
    middle = op("Add", [scaled, constant("beta", beta)], "middle")
    upper = op("Where", [high, constant("one", 1.0), middle], "upper")
    op("Where", [low, zero, upper], "", out)
    return nodes


def _is_hard(node: onnx.NodeProto) -> bool:
    return is_standard(node, "HardSwish") or is_standard(node, "HardSigmoid")


@graph_pass
def hard_activations_differentiable(model: onnx.ModelProto) -> bool:
    """``HardSwish`` and ``HardSigmoid`` (MobileNetV3, timm's and torchvision's hard
    activations) written as ops ORT differentiates: ORT 1.19 has no gradient builder for
    either, so the gradient build failed and those models ran in PyTorch. Only inputs shape
    inference types as float32, float64 or float16 are rewritten (the constants take it)."""
    if not any(_is_hard(n) for n in model.graph.node):
        return False
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in [*inferred.value_info, *inferred.input, *inferred.output]
    }
    nodes: list[onnx.NodeProto] = []
    changed = False
    for i, node in enumerate(model.graph.node):
        dtype = _HARD_DTYPES.get(types.get(node.input[0], 0)) if node.input else None
        if dtype is None or not _is_hard(node):
            nodes.append(node)
            continue
        nodes += _hard_activation(node, node.name or f"{node.op_type}_{i}", dtype)
        changed = True
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return changed
