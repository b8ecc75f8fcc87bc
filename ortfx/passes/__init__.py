"""Post-export processing: pure passes over a model record, composed with :func:`chain`.

Each pass takes a :class:`PostExportProcessedModelInfo` and returns a new one; none mutates its
input (graph edits happen on a private copy of the decoded model). Every graph ORT runs comes out
of one of two named pipelines: :func:`for_export` (once per export) and :func:`for_session` (once
per ORT session: grad requirements, dropout seeds, symbolic shapes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import onnx

from ortfx import aten
from ortfx.errors import (
    UNSUPPORTED_OP,
    VALUE_DEPENDENT_CONTROL_FLOW,
    WRONG_AVERAGE_POOL_3D,
    OrtfxExportError,
    OrtfxUnsupportedOpError,
)
from ortfx.model_info import InputKind, InputSpec, PostExportProcessedModelInfo

Pass = Callable[[PostExportProcessedModelInfo], PostExportProcessedModelInfo]


Edit = Callable[[onnx.ModelProto], bool]


def _with_model(
    info: PostExportProcessedModelInfo, model: onnx.ModelProto
) -> PostExportProcessedModelInfo:
    """``info`` with an edited ``model``; the runners fetch outputs by ``output_names``, so
    they follow an edit that renames graph outputs (see :func:`separate_outputs`)."""
    return attrs.evolve(
        info,
        model=model.SerializeToString(),
        output_names=tuple(o.name for o in model.graph.output),
    )


def chain(*passes: Pass) -> Pass:
    """Compose passes left to right (Optax's ``chain`` for graphs).

    Consecutive graph edits (:func:`graph_pass`) share one decoded copy of the model, so a
    pipeline parses and serializes the proto once per run of edits, not once per pass.
    """

    def run(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
        model: onnx.ModelProto | None = None
        changed = False
        for p in passes:
            edit: Edit | None = getattr(p, "edit", None)
            if edit is not None:
                if model is None:
                    model = onnx.load_model_from_string(info.model)
                changed = edit(model) or changed
                continue
            if model is not None and changed:
                info = _with_model(info, model)
            model, changed = None, False
            info = p(info)
        if model is not None and changed:
            info = _with_model(info, model)
        return info

    return run


def graph_pass(edit: Edit) -> Pass:
    """Lift an in-place edit of a private ModelProto copy into a pure pass.

    ``edit`` returns whether it changed anything; an unchanged model keeps its bytes.
    """

    @functools.wraps(edit)
    def run(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
        model = onnx.load_model_from_string(info.model)
        if not edit(model):
            return info
        return _with_model(info, model)

    run.edit = edit  # type: ignore[attr-defined]  # lets chain() share one decoded model
    return run


def _standard(node: onnx.NodeProto, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


@graph_pass
def add_layernorm_stats(model: onnx.ModelProto) -> bool:
    """Name LayerNormalization's mean and inverse-std outputs: ORT's gradient reads them."""
    changed = False
    for i, node in enumerate(model.graph.node):
        if _standard(node, "LayerNormalization") and len(node.output) < 3:
            base = node.name or f"LayerNormalization_{i}"
            outputs = [*node.output, "", ""][:3]
            outputs[1] = outputs[1] or f"{base}_saved_mean"
            outputs[2] = outputs[2] or f"{base}_saved_inv_std"
            del node.output[:]
            node.output.extend(outputs)
            changed = True
    return changed


@graph_pass
def add_cross_entropy_log_prob(model: onnx.ModelProto) -> bool:
    """Name SoftmaxCrossEntropyLoss's log_prob output: its gradient reads it, and the
    TorchScript exporter emits only the loss (the build then fails on many graphs)."""
    changed = False
    for i, node in enumerate(model.graph.node):
        if _standard(node, "SoftmaxCrossEntropyLoss") and (
            len(node.output) < 2 or not node.output[1]
        ):
            outputs = [*node.output, ""][:2]
            outputs[1] = f"{node.name or f'SoftmaxCrossEntropyLoss_{i}'}_log_prob"
            del node.output[:]
            node.output.extend(outputs)
            changed = True
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
        if not (_standard(node, "Conv") and attrs.get("group", 1) > 1 and one_d and auto):
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
    wheres = [n for n in model.graph.node if _standard(n, "Where")]
    if not wheres:
        return False
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    types = {v.name: v.type for v in [*inferred.value_info, *inferred.input, *inferred.output]}
    constants = {o for n in model.graph.node if _standard(n, "Constant") for o in n.output}
    inputs = {i.name for i in model.graph.input}
    constants |= {t.name for t in model.graph.initializer if t.name not in inputs}
    h = onnx.helper
    nodes: list[onnx.NodeProto] = []
    changed = False
    for i, node in enumerate(model.graph.node):
        if not _standard(node, "Where"):
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


@graph_pass
def tanh_as_sigmoid(model: onnx.ModelProto) -> bool:
    """Write float32 ``Tanh(z)`` as ``2 * Sigmoid(2 * z) - 1``.

    ORT fuses the exporter's tanh GELU into ``FastGelu``, whose CPU gradient (``FastGeluGrad``)
    is several times slower than the unfused elementwise ops; without a ``Tanh`` the fusion
    does not match. Only tensors shape inference types as float32 are rewritten.
    """
    tanhs = [n for n in model.graph.node if _standard(n, "Tanh")]
    if not tanhs:
        return False
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    floats = {
        v.name
        for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
        if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    }
    h = onnx.helper
    nodes: list[onnx.NodeProto] = []
    changed = False
    for i, node in enumerate(model.graph.node):
        if not (_standard(node, "Tanh") and node.input[0] in floats):
            nodes.append(node)
            continue
        tag = f"{node.name or f'Tanh_{i}'}_as_sigmoid"
        two = h.make_tensor(f"{tag}_two_value", onnx.TensorProto.FLOAT, [], [2.0])
        one = h.make_tensor(f"{tag}_one_value", onnx.TensorProto.FLOAT, [], [1.0])
        nodes += [
            h.make_node("Constant", [], [f"{tag}_two"], name=f"{tag}_two", value=two),
            h.make_node("Constant", [], [f"{tag}_one"], name=f"{tag}_one", value=one),
            h.make_node("Mul", [node.input[0], f"{tag}_two"], [f"{tag}_2z"], name=f"{tag}_2z"),
            h.make_node("Sigmoid", [f"{tag}_2z"], [f"{tag}_s"], name=f"{tag}_s"),
            h.make_node("Mul", [f"{tag}_s", f"{tag}_two"], [f"{tag}_2s"], name=f"{tag}_2s"),
            h.make_node("Sub", [f"{tag}_2s", f"{tag}_one"], [node.output[0]], name=tag),
        ]
        changed = True
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
        if _standard(node, "Constant") and node.output[0] == name:
            value = next((a for a in node.attribute if a.name == "value"), None)
            return value is not None and bool(onnx.numpy_helper.to_array(value.t).all())
    return False


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
        if (_standard(n, "Div") or _standard(n, "Mod")) and len(n.input) == 2
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
        if _standard(node, "Constant") and node.output[0] == name:
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


def _split_cross_entropy(node: onnx.NodeProto, tag: str) -> list[onnx.NodeProto]:
    """LogSoftmax + GatherElements + a masked reduction, equal to SoftmaxCrossEntropyLoss."""
    h, f32, i64 = onnx.helper, onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    nodes: list[onnx.NodeProto] = []
    attributes = {a.name: h.get_attribute_value(a) for a in node.attribute}
    reduction = attributes.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    ignore = attributes.get("ignore_index")
    scores, labels = node.input[0], node.input[1]
    log_prob = node.output[1] if len(node.output) > 1 and node.output[1] else f"{tag}_log_prob"

    def const(name: str, value: float | int | list[int], dtype: int) -> str:
        values = value if isinstance(value, list) else [value]
        dims = [len(values)] if isinstance(value, list) else []
        tensor = h.make_tensor(f"{tag}_{name}_value", dtype, dims, values)
        nodes.append(
            h.make_node("Constant", [], [f"{tag}_{name}"], name=f"{tag}_{name}", value=tensor)
        )
        return f"{tag}_{name}"

    def op(kind: str, inputs: list[str], name: str, out: str = "", **kw: Any) -> str:
        out = out or f"{tag}_{name}"
        nodes.append(h.make_node(kind, inputs, [out], name=f"{tag}_{name}", **kw))
        return out

    op("LogSoftmax", [scores], "log_softmax", log_prob, axis=1)
    axis = const("axis", [1], i64)
    index, valid = labels, ""
    if ignore is not None:
        ignored = op("Equal", [labels, const("ignore", int(ignore), i64)], "ignored")
        valid = op("Not", [ignored], "valid")
        index = op("Where", [valid, labels, const("zero_index", 0, i64)], "index")
    gathered = op(
        "GatherElements", [log_prob, op("Unsqueeze", [index, axis], "idx")], "gather", axis=1
    )
    nll = op("Neg", [op("Squeeze", [gathered, axis], "picked")], "nll")
    if valid:
        nll = op("Where", [valid, nll, const("zero", 0.0, f32)], "masked")
    loss = node.output[0]
    if reduction == "none":
        op("Identity", [nll], "loss", loss)
    elif reduction == "sum":
        op("ReduceSum", [nll], "loss", loss, keepdims=0)
    elif not valid:
        op("ReduceMean", [nll], "loss", loss, keepdims=0)
    else:
        total = op("ReduceSum", [nll], "total", keepdims=0)
        count = op("ReduceSum", [op("Cast", [valid], "valid_f", to=f32)], "count", keepdims=0)
        op("Div", [total, count], "loss", loss)
    return nodes


@graph_pass
def split_cross_entropy(model: onnx.ModelProto) -> bool:
    """SoftmaxCrossEntropyLoss (float32, no class weights) as LogSoftmax + GatherElements.

    Same values and gradients; ORT 1.19's CPU kernels for the fused op and its gradient are
    several times slower than LogSoftmax's (measured: 7.6 % of a GPT-2 training step).
    """
    candidates = [
        i
        for i, n in enumerate(model.graph.node)
        if _standard(n, "SoftmaxCrossEntropyLoss") and not (len(n.input) > 2 and n.input[2])
    ]
    if not candidates:
        return False
    inferred = onnx.shape_inference.infer_shapes(model).graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*inferred.value_info, *inferred.input)}
    float32 = onnx.TensorProto.FLOAT
    replace = {i for i in candidates if types.get(model.graph.node[i].input[0]) == float32}
    if not replace:
        return False
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(model.graph.node):
        if i in replace:
            nodes.extend(_split_cross_entropy(node, f"ortfx_ce_{i}"))
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return True


@graph_pass
def add_dropout_masks(model: onnx.ModelProto) -> bool:
    """Give every Dropout its mask output: DropoutGrad reads it (dynamo exports omit it)."""
    changed = False
    for i, node in enumerate(model.graph.node):
        if _standard(node, "Dropout") and len(node.output) < 2:
            node.output.append(f"{node.name or f'Dropout_{i}'}_mask")
            changed = True
    return changed


def _has_symbolic_dim(value: onnx.ValueInfoProto) -> bool:
    dims = value.type.tensor_type.shape.dim
    return any(d.HasField("dim_param") for d in dims)


def _expand_constant(model: onnx.ModelProto, name: str, dynamic: str) -> None:
    """Rename the constant ``name`` and produce ``name`` from it with ``Expand`` by the empty
    shape ``Shape(dynamic)[0:0]``."""
    const = f"ortfx_{name}_constant"
    for node in model.graph.node:
        node.input[:] = [const if i == name else i for i in node.input]
        node.output[:] = [const if o == name else o for o in node.output]
    model.graph.node.extend(
        [
            onnx.helper.make_node("Shape", [dynamic], [f"{const}_shape"], start=0, end=0),
            onnx.helper.make_node("Expand", [const, f"{const}_shape"], [name], name=const),
        ]
    )


@graph_pass
def separate_outputs(model: onnx.ModelProto) -> bool:
    """Give each graph output its own value: a returned input or a tensor returned twice gets
    an Identity, so ORT yields (and takes gradients for) every output position separately. A
    constant output (ORT folds it into an initializer, which leaves its gradient builder and
    the session without a producer for it) is computed by a node ORT cannot fold."""
    inputs = {i.name for i in model.graph.input}
    constants = {o for n in model.graph.node if _standard(n, "Constant") for o in n.output}
    dynamic = next((i.name for i in model.graph.input if _has_symbolic_dim(i)), None)
    seen: set[str] = set()
    changed = False
    for k, output in enumerate(model.graph.output):
        if output.name in constants and dynamic is not None and output.name not in seen:
            # An Identity would be folded back into an initializer: the output becomes the
            # constant expanded by an empty shape taken from an input with symbolic dims, which
            # ORT cannot fold. The output keeps its name (the runner fetches outputs by name).
            _expand_constant(model, output.name, dynamic)
            changed = True
        elif output.name in inputs or output.name in seen:
            fresh = f"{output.name}_output_{k}"
            model.graph.node.append(
                onnx.helper.make_node("Identity", [output.name], [fresh], name=f"ortfx_{fresh}")
            )
            output.name = fresh
            changed = True
        seen.add(output.name)
    return changed


@graph_pass
def add_pythonop_ctx(model: onnx.ModelProto) -> bool:
    """Give each PythonOp ORT's leading ctx output (the exporter emits only the Function's)."""
    changed = False
    for i, node in enumerate(model.graph.node):
        if node.op_type != "PythonOp" or node.domain != "com.microsoft":
            continue
        name = node.name or f"PythonOp_{i}"
        outputs = list(node.output)
        del node.output[:]
        node.output.extend([f"{outputs[0] if outputs else name}_ctx", *outputs])
        node.name = name
        changed = True
    return changed


PADDED_GATHER = "PaddedGather"  # ortfx.symbolics marks F.embedding(padding_idx=...) with it
PADDED_GATHER_DOMAIN = "ortfx"
PADDING_ON_COMPUTED_WEIGHT = (
    "F.embedding with padding_idx={index} reads a weight computed in the forward ({weight}), not a "
    "parameter: ortfx keeps a padding row out of the gradient only for parameters. Embed from "
    "a parameter (nn.Embedding), or let ortfx fall back to PyTorch."
)


def _padded_gather(
    h: Any, weight: str, frozen: str, ids: str, out: str, index: int, tag: str
) -> list[onnx.NodeProto]:
    """``out = weight[ids]``, taken from ``frozen`` (same values, no gradient) where
    ``ids == index``."""
    i64 = onnx.TensorProto.INT64
    return [
        h.make_node("Gather", [weight, ids], [f"{tag}_trained"], name=f"{tag}_g"),
        h.make_node("Gather", [frozen, ids], [f"{tag}_kept"], name=f"{tag}_k"),
        h.make_node(
            "Constant",
            [],
            [f"{tag}_idx"],
            name=f"{tag}_c",
            value=h.make_tensor(f"{tag}_idx", i64, [], [index]),
        ),
        h.make_node("Cast", [ids], [f"{tag}_ids"], name=f"{tag}_cast", to=i64),
        h.make_node("Equal", [f"{tag}_ids", f"{tag}_idx"], [f"{tag}_is_pad"], name=f"{tag}_eq"),
        h.make_node(
            "Constant",
            [],
            [f"{tag}_axes"],
            name=f"{tag}_a",
            value=h.make_tensor(f"{tag}_axes", i64, [1], [-1]),
        ),
        h.make_node(
            "Unsqueeze", [f"{tag}_is_pad", f"{tag}_axes"], [f"{tag}_mask"], name=f"{tag}_u"
        ),
        h.make_node(
            "Where", [f"{tag}_mask", f"{tag}_kept", f"{tag}_trained"], [out], name=f"{tag}_w"
        ),
    ]


def embedding_padding(padding: Mapping[str, int]) -> Pass:
    """Keep PyTorch's ``padding_idx`` semantics: no gradient reaches an embedding's padding row.

    The exported ``Gather`` forgets ``padding_idx``. At padding positions the result is taken from
    a second, non-trainable feed of the same weight (an ``INTERNAL`` input), so the values are
    identical and ORT's gradient skips exactly those positions. The embeddings are found two
    ways: ``padding`` maps the parameter names of ``nn.Embedding`` modules to their
    ``padding_idx`` (any exporter), and the TorchScript export marks every
    ``F.embedding(..., padding_idx=...)``, functional calls included, as ``ortfx::PaddedGather``.
    """

    def run(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
        params = {spec.name: spec for spec in info.inputs if spec.kind is InputKind.PARAMETER}
        named = {n: spec for n, spec in params.items() if spec.source in padding}
        model = onnx.load_model_from_string(info.model)
        marked = [n for n in model.graph.node if n.op_type == PADDED_GATHER]
        if not (named or marked):
            return info
        values = {v.name: v for v in model.graph.input}
        added: list[InputSpec] = []
        nodes: list[onnx.NodeProto] = []
        h = onnx.helper
        for node in model.graph.node:
            if node.op_type == PADDED_GATHER and node.domain == PADDED_GATHER_DOMAIN:
                index = next(a.i for a in node.attribute if a.name == "padding_idx")
                spec = params.get(node.input[0])
                if spec is None:
                    raise OrtfxExportError(
                        PADDING_ON_COMPUTED_WEIGHT.format(index=index, weight=node.input[0])
                    )
            else:
                spec = named.get(node.input[0]) if _standard(node, "Gather") else None
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                if spec is None or axis != 0:
                    nodes.append(node)
                    continue
                index = padding[str(spec.source)]
            frozen = f"{spec.name}__no_grad"
            if frozen not in values:
                value = onnx.ValueInfoProto()
                value.CopyFrom(values[spec.name])
                value.name = frozen
                values[frozen] = value
                model.graph.input.append(value)
                added.append(InputSpec(frozen, InputKind.INTERNAL, spec.source))
            tag = f"ortfx_pad_{len(nodes)}"
            nodes += _padded_gather(h, spec.name, frozen, node.input[1], node.output[0], index, tag)
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        # The exporter gave a PaddedGather's output fresh symbolic sizes of its own; left in
        # place they contradict the ids' sizes the Gather now infers, and ORT's gradient
        # builder then knows no shape for what the output meets (a broadcasting Mul fails).
        outputs = {n.output[0] for n in marked}
        kept = [v for v in model.graph.value_info if v.name not in outputs]
        if len(kept) != len(model.graph.value_info):
            del model.graph.value_info[:]
            model.graph.value_info.extend(kept)
        return attrs.evolve(info, model=model.SerializeToString(), inputs=(*info.inputs, *added))

    return run


def user_inputs_first(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
    """Order graph inputs as ORT's training agent feeds them: user inputs, then the rest."""
    order = sorted(info.inputs, key=lambda i: i.kind is not InputKind.USER)
    if order == list(info.inputs):
        return info
    model = onnx.load_model_from_string(info.model)
    by_name = {v.name: v for v in model.graph.input}
    values = [onnx.ValueInfoProto() for _ in order]
    for value, spec in zip(values, order, strict=True):
        value.CopyFrom(by_name[spec.name])
    del model.graph.input[:]
    model.graph.input.extend(values)
    return attrs.evolve(info, model=model.SerializeToString(), inputs=tuple(order))


def seed_dropouts(seed: int) -> Pass:
    """Give each Dropout a seed derived from ``seed``: same torch seed, same masks, run to run."""

    @graph_pass
    def run(model: onnx.ModelProto) -> bool:
        changed = False
        for i, node in enumerate(model.graph.node):
            if _standard(node, "Dropout"):
                kept = [a for a in node.attribute if a.name != "seed"]
                del node.attribute[:]
                node.attribute.extend(kept)
                node.attribute.append(onnx.helper.make_attribute("seed", (seed + 7919 * i) % 2**31))
                changed = True
        return changed

    return run


def with_grad_requirements(
    inputs_requiring_grad: frozenset[int], params_requiring_grad: frozenset[str]
) -> Pass:
    """Mark which user inputs (by leaf index) and parameters (by name) need gradients."""

    def run(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
        specs = tuple(
            attrs.evolve(
                spec,
                requires_grad=(spec.kind is InputKind.USER and spec.source in inputs_requiring_grad)
                or (spec.kind is InputKind.PARAMETER and spec.source in params_requiring_grad),
            )
            for spec in info.inputs
        )
        return attrs.evolve(info, inputs=specs)

    return run


TRIGGER = "ortfx_grad_trigger"


def feed_parameters(function: str) -> Pass:
    """Memory-efficient gradients: each parameter that requires grad becomes the output of a
    PythonOp running the autograd.Function ``function`` (its graph name), fed by one new
    0-dim float input, the trigger; frozen parameters stay plain inputs.

    The Function's forward returns parameter number ``index`` (its constant argument) of the
    current call and its backward hands the gradient ORT computed to torch; see
    :mod:`ortfx.runtime.memgrad`. The parameters' shapes stay known to ORT as value infos.
    """

    def run(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
        fed = tuple(s for s in info.inputs if s.kind is InputKind.PARAMETER and s.requires_grad)
        if not fed:
            return info
        model = onnx.load_model_from_string(info.model)
        graph, h = model.graph, onnx.helper
        names = {spec.name for spec in fed}
        values = {v.name: v for v in graph.input}
        kept = [v for v in graph.input if v.name not in names]
        del graph.input[:]
        graph.input.extend(kept)
        graph.input.append(h.make_tensor_value_info(TRIGGER, onnx.TensorProto.FLOAT, []))
        feeds = []
        for index, spec in enumerate(fed):
            tensor_type = values[spec.name].type.tensor_type
            feeds.append(
                h.make_node(
                    "PythonOp",
                    [TRIGGER],
                    [f"{spec.name}_feed_ctx", spec.name],
                    name=f"ortfx_feed_{index}",
                    domain="com.microsoft",
                    func_name=function,
                    input_convention="dc",
                    input_tensor_types=[onnx.TensorProto.FLOAT],
                    input_tensor_ranks=[0],
                    input_int_scalars=[index],
                    input_int_scalar_positions=[1],
                    output_tensor_types=[tensor_type.elem_type],
                    output_tensor_ranks=[len(tensor_type.shape.dim)],
                    training_mode=1,
                )
            )
            graph.value_info.append(values[spec.name])
        nodes = [*feeds, *graph.node]
        del graph.node[:]
        graph.node.extend(nodes)
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(h.make_opsetid("com.microsoft", 1))
        inputs = (
            *(spec for spec in info.inputs if spec.name not in names),
            InputSpec(TRIGGER, InputKind.TRIGGER, "", requires_grad=True),
        )
        return attrs.evolve(info, model=model.SerializeToString(), inputs=inputs, fed_params=fed)

    return run


# Nodes that only re-lay a value out: a reader of their output reads the parameter too.
_LAYOUT_OPS = frozenset(
    {"Transpose", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten", "Cast", "Expand"}
)


def _downstream(graph: onnx.GraphProto, start: set[str]) -> set[str]:
    """Names of the values computed (transitively) from the values ``start``."""
    reached = set(start)
    for node in graph.node:  # ORT's gradient model is topologically sorted
        if any(i in reached for i in node.input):
            reached.update(o for o in node.output if o)
    return reached


def feeds_after_readers(model: onnx.ModelProto, function: str) -> bool:
    """In a gradient model: each parameter-feeding PythonOp's gradient node runs only after
    every backward node that reads the parameter (directly or through layout nodes).

    Its gradient goes to torch there, and a hook may change the parameter in place (an
    optimizer stepped in backward) while ORT still holds its buffer. Each such gradient node
    gets a ``com.microsoft::PassThrough`` (outputs alias inputs, no copy) over its context input
    and one output of each reader, so it is ready only when they have run. The barrier passes
    the context, not the gradient: an aliased gradient would not own its buffer, and torch could
    not take it over (:func:`owned_gradients`). Readers that run in the forward (ancestors of
    ORT's ``YieldOp``) need no wait.
    """
    graph = model.graph
    feeds = {
        node.output[1]: node.output[0]
        for node in graph.node
        if node.op_type == "PythonOp"
        and any(a.name == "func_name" and a.s.decode() == function for a in node.attribute)
    }
    if not feeds:
        return False
    yields = [n for n in graph.node if n.op_type == "YieldOp"]
    backward = _downstream(graph, {o for n in yields for o in n.output})
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in set(node.input):
            consumers.setdefault(name, []).append(node)

    def readers(value: str) -> list[str]:
        found: list[str] = []
        for node in consumers.get(value, []):
            if node.op_type == "PythonOpGrad" or not node.output:
                continue
            if node.op_type in _LAYOUT_OPS and node.output[0] not in backward:
                found.extend(readers(node.output[0]))  # W^T etc.: wait for who reads that
            elif node.output[0] in backward or node.op_type in _LAYOUT_OPS:
                found.append(node.output[0])
        return found

    changed = False
    by_ctx = {node.input[0]: node for node in graph.node if node.op_type == "PythonOpGrad"}
    extra: list[tuple[onnx.NodeProto, onnx.NodeProto]] = []
    for param, ctx in feeds.items():
        grad_node = by_ctx.get(ctx)
        waits = sorted(set(readers(param)))
        if grad_node is None or not waits:
            continue
        tag = f"ortfx_after_readers_{param}"
        barrier = onnx.helper.make_node(
            "PassThrough",
            [ctx, *waits],
            [f"{tag}_ctx", *(f"{tag}_{k}" for k in range(len(waits)))],
            name=tag,
            domain="com.microsoft",
        )
        grad_node.input[0] = f"{tag}_ctx"
        extra.append((grad_node, barrier))
        changed = True
    if changed:
        # Keep ORT's order (its priority-based schedule follows it): a barrier and its
        # gradient node go right after the last producer of what they wait for, if later.
        index = {o: k for k, node in enumerate(graph.node) for o in node.output}
        keyed: list[tuple[float, onnx.NodeProto]] = []
        moved = {id(g): b for g, b in extra}
        for k, node in enumerate(graph.node):
            wait = moved.get(id(node))
            if wait is None:
                keyed.append((k, node))
                continue
            at = max([k, *(index[i] for i in wait.input if i in index)]) + 0.5
            keyed.extend([(at, wait), (at, node)])
        nodes = [node for _, node in sorted(keyed, key=lambda pair: pair[0])]
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


# ORT CPU kernels whose output is a buffer of its own (no Alias, MayInplace or strided-view
# output declared), so that the OrtValue ORT hands to a PythonOpGrad owns that buffer.
_ALLOCATING_OPS = frozenset(
    {
        "Gemm",
        "MatMul",
        "FusedMatMul",
        "ReduceSum",
        "LayerNormalizationGrad",
        "SimplifiedLayerNormalizationGrad",
        "GatherGrad",
    }
)


def owned_gradients(model: onnx.ModelProto, function: str) -> frozenset[int]:
    """In the graph an ORT session runs (after its own transformers): the indices of the
    parameter-feeding PythonOps whose gradient reaches their PythonOpGrad in a buffer of its own
    that nothing else reads, which torch may keep as ``.grad`` without a copy.

    ORT makes the output of an aliasing or in-place node (``Reshape``, ``PassThrough``, ``Add``
    ...) a view of another value's buffer that does not own it; that buffer goes back to ORT
    when the other value dies, while torch would still hold ``.grad``. Only the outputs of
    :data:`_ALLOCATING_OPS` with no ``C`` input (``Gemm`` may write into ``C``) qualify.
    """
    graph = model.graph
    index = {
        node.output[0]: next(a.ints[0] for a in node.attribute if a.name == "input_int_scalars")
        for node in graph.node
        if node.op_type == "PythonOp"
        and any(a.name == "func_name" and a.s.decode() == function for a in node.attribute)
    }
    producers = {o: node for node in graph.node for o in node.output}
    readers: dict[str, int] = {o.name: 1 for o in graph.output}  # the caller reads outputs
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    owned: set[int] = set()
    for node in graph.node:
        if node.op_type != "PythonOpGrad" or len(node.input) < 2:
            continue
        ctx = node.input[0]
        while ctx not in index and ctx in producers and producers[ctx].op_type == "PassThrough":
            barrier = producers[ctx]
            ctx = barrier.input[list(barrier.output).index(ctx)]
        made = producers.get(node.input[1])
        if (
            ctx in index
            and made is not None
            and made.op_type in _ALLOCATING_OPS
            and not (made.op_type == "Gemm" and len(made.input) > 2 and made.input[2])
            and readers[node.input[1]] == 1
        ):
            owned.add(index[ctx])
    return frozenset(owned)


def _elem_types(graph: onnx.GraphProto) -> dict[str, int]:
    values = [*graph.value_info, *graph.input, *graph.output]
    return {v.name: v.type.tensor_type.elem_type for v in values if v.type.tensor_type.elem_type}


def log_softmax_grad_in_torch(model: onnx.ModelProto) -> bool:
    """In a gradient model: each float32 ``LogSoftmaxGrad_13(dY, Y)`` runs torch's
    ``_log_softmax_backward_data`` through the ATen executor instead.

    The same arithmetic (``dY - exp(Y) * sum(dY)`` along the axis), but ORT's CPU kernel takes
    about twice torch's time: 45 against 22 ms for a [1024, 8192] loss gradient (GPT-2's
    vocabulary), 5 % of a training step. Tensors cross by DLPack, without copies.
    """
    h = onnx.helper
    types = _elem_types(model.graph)
    changed = False
    for i, node in enumerate(model.graph.node):
        if node.op_type != "LogSoftmaxGrad_13" or node.domain != "com.microsoft":
            continue
        dtype = types.get(node.output[0]) or types.get(node.input[0])
        if dtype != onnx.TensorProto.FLOAT:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        tag = f"{node.name or f'LogSoftmaxGrad_{i}'}_torch"
        dim = h.make_tensor(f"{tag}_dim", onnx.TensorProto.INT64, [], [axis])
        _to_torch(model, node, tag, "_log_softmax_backward_data", dim)
        changed = True
    return changed


def _to_torch(
    model: onnx.ModelProto, node: onnx.NodeProto, tag: str, operator: str, last: onnx.TensorProto
) -> None:
    """Make ``node`` (inputs 0 and 1, then the constant ``last``) the ATen node ``operator``."""
    model.graph.initializer.append(last)
    replacement = onnx.helper.make_node(
        "ATen",
        [node.input[0], node.input[1], last.name],
        list(node.output),
        name=tag,
        domain=aten.DOMAIN,
        operator=operator,
        overload_name="",
    )
    node.CopyFrom(replacement)
    if not any(o.domain == aten.DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(aten.DOMAIN, 1))


def relu_grad_in_torch(model: onnx.ModelProto) -> bool:
    """In a gradient model: each ``ReluGrad(dY, Y)`` runs torch's own ``threshold_backward(dY,
    Y, 0)`` through the ATen executor, as eager's ``ReluBackward0`` does (NaN rule included,
    see :func:`relu_grad_passes_nan`).

    ORT's CPU ``ReluGrad``, and the ``Where`` that gives it torch's NaN rule, are scalar loops:
    about 1.1-1.3 ms for a [256, 1024] gradient at 1 or 2 threads, against 30-60 µs for
    torch's vectorized kernel (``bench/results/grad_kernels-20261125-1528-*.md``).
    """
    changed = False
    for i, node in enumerate(model.graph.node):
        if node.op_type != "ReluGrad" or node.domain != "com.microsoft":
            continue
        tag = f"{node.name or f'ReluGrad_{i}'}_torch"
        zero = onnx.helper.make_tensor(f"{tag}_threshold", onnx.TensorProto.DOUBLE, [], [0.0])
        _to_torch(model, node, tag, "threshold_backward", zero)
        changed = True
    return changed


def relu_grad_passes_nan(model: onnx.ModelProto) -> bool:
    """In a gradient model: each ``ReluGrad(dY, X)`` passes ``dY`` where ``X`` is NaN.

    ORT's ``ReluGrad`` keeps ``dY`` where ``X > 0``, torch's ``threshold_backward`` blocks it
    where ``relu(X) <= 0``; the two differ only at NaN, where torch passes the gradient (a row
    with a NaN input got a zero input gradient in ORT, a finite one in torch). Torch's rule is
    ``Where(X <= 0, 0, dY)`` when the gradient's dtype is known (two elementwise passes, as
    cheap as ``ReluGrad``), else ``ReluGrad`` with ``dY`` put back where ``IsNaN(X)``. Used
    when the ATen executor is not available (:func:`relu_grad_in_torch` is faster).
    """
    h = onnx.helper
    types = _elem_types(model.graph)
    nodes: list[onnx.NodeProto] = []
    changed = False
    for i, node in enumerate(model.graph.node):
        if node.op_type != "ReluGrad" or node.domain != "com.microsoft":
            nodes.append(node)
            continue
        tag = f"{node.name or f'ReluGrad_{i}'}_nan"
        grad, x, out = node.input[0], node.input[1], node.output[0]
        dtype = types.get(out) or types.get(grad) or types.get(x)
        if dtype:
            zero = h.make_tensor(f"{tag}_zero_value", dtype, [], [0])
            nodes += [
                h.make_node("Constant", [], [f"{tag}_zero"], name=f"{tag}_zero", value=zero),
                h.make_node("LessOrEqual", [x, f"{tag}_zero"], [f"{tag}_off"], name=f"{tag}_off"),
                h.make_node("Where", [f"{tag}_off", f"{tag}_zero", grad], [out], name=tag),
            ]
        else:
            del node.output[:]
            node.output.append(f"{tag}_blocked")
            nodes += [
                node,
                h.make_node("IsNaN", [x], [f"{tag}_mask"], name=f"{tag}_mask"),
                h.make_node("Where", [f"{tag}_mask", grad, f"{tag}_blocked"], [out], name=tag),
            ]
        changed = True
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return changed


def with_dynamic_scalars(paths: frozenset[str]) -> Pass:
    """Record which scalar leaves the graph reads as tensors (``Options.dynamic_scalars``)."""

    def run(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
        return info if info.dynamic_scalars == paths else attrs.evolve(info, dynamic_scalars=paths)

    return run


def symbolic_shapes(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
    """Annotate intermediate values with sizes in terms of the input dims, so that ORT's
    memory estimates are expressions of input sizes; unchanged if inference fails."""
    # ORT's tool, imported here so that importing the passes needs no ORT.
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        model = SymbolicShapeInference.infer_shapes(
            onnx.load_model_from_string(info.model), auto_merge=True, guess_output_rank=True
        )
    except Exception:
        return info
    return attrs.evolve(info, model=model.SerializeToString())


# Operators whose ORT 1.19 CPU gradient kernel reads its output sizes from the graph when the
# session is created (MaxPoolGrad, AveragePoolGrad): a symbolic dim reads as 0 and the kernel
# writes out of bounds (SIGSEGV) or divides by zero (SIGFPE). Found by tests/test_layer_sweep.
READS_GRAPH_SIZES = frozenset({"MaxPool", "AveragePool"})

# Nodes whose outputs carry only the shape of their inputs, not their values.
_SHAPE_ONLY = frozenset({"Shape", "Size"})


def _subgraph_names(node: onnx.NodeProto) -> set[str]:
    """Every value name the node's subgraphs (If branches, Loop bodies) read."""
    names: set[str] = set()
    for attribute in node.attribute:
        for graph in (attribute.g, *attribute.graphs):
            for inner in graph.node:
                names.update(inner.input)
                names.update(_subgraph_names(inner))
    return names


def _dependent(model: onnx.ModelProto, seeds: set[str]) -> set[str]:
    """Names of values computed from the values (not only the shapes) of ``seeds``."""
    dependent = set(seeds)
    for node in model.graph.node:  # ONNX nodes are topologically sorted
        if node.op_type in _SHAPE_ONLY and node.domain in ("", "ai.onnx"):
            continue
        read = {*node.input, *_subgraph_names(node)}
        if not read.isdisjoint(dependent):
            dependent.update(node.output)
    return dependent


def _value_dependent(model: onnx.ModelProto) -> set[str]:
    return _dependent(model, {v.name for v in model.graph.input})


def _shape_dependent_ifs(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    dependent = _value_dependent(model)
    return [
        node
        for node in model.graph.node
        if _standard(node, "If") and node.input and node.input[0] not in dependent
    ]


def mark_static_sizes(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
    """Record the operators whose gradient needs concrete sizes in the graph.

    Those are :data:`READS_GRAPH_SIZES` and an ``If`` whose condition depends only on shapes
    (e.g. ``nn.LocalResponseNorm``): ORT's gradient builder aborts the process on an ``If``
    it cannot fold, and with concrete sizes its constant folding removes a shape-only one.
    """
    model = onnx.load_model_from_string(info.model)
    ops = sorted(
        {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")} & READS_GRAPH_SIZES
    )
    if _shape_dependent_ifs(model):
        ops.append("If")
    ops_t = tuple(ops)
    return info if ops_t == info.static_size_ops else attrs.evolve(info, static_size_ops=ops_t)


def _unsupported(node: onnx.NodeProto, detail: str) -> OrtfxUnsupportedOpError:
    where = f" (node {node.name})" if node.name else ""
    return OrtfxUnsupportedOpError(
        UNSUPPORTED_OP.format(what="differentiate", op=node.op_type, node=where, detail=detail),
        op=node.op_type,
        node=node.name,
    )


def refuse_unsafe_gradients(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
    """Raise :class:`~ortfx.errors.OrtfxUnsupportedOpError` before ORT builds a gradient that
    would kill the process or be wrong, for nodes on the differentiated path: an ``If`` whose
    condition depends on tensor values (ORT 1.19's gradient builder aborts) and a 3-d
    ``AveragePool`` (its CPU gradient kernel computes wrong values; torch exports
    ``nn.AvgPool3d`` and ``nn.LocalResponseNorm`` with it). Found by tests/test_layer_sweep."""
    model = onnx.load_model_from_string(info.model)
    trained = {s.name for s in info.inputs if s.requires_grad}
    differentiated = _dependent(model, trained)
    values = _value_dependent(model)
    for node in model.graph.node:
        read = {*node.input, *_subgraph_names(node)}
        if read.isdisjoint(differentiated):
            continue
        if _standard(node, "If") and node.input[0] in values:
            raise _unsupported(node, VALUE_DEPENDENT_CONTROL_FLOW.format(node=node.name or "If"))
        kernel = next((list(a.ints) for a in node.attribute if a.name == "kernel_shape"), [])
        if _standard(node, "AveragePool") and len(kernel) == 3:
            raise _unsupported(node, WRONG_AVERAGE_POOL_3D)
    return info


def pin_sizes(sizes: tuple[tuple[int, ...], ...]) -> Pass:
    """Make the user inputs' dims concrete (``sizes`` in graph order; ``()`` changes nothing),
    so that ORT infers concrete sizes for every node of the training graph."""

    @graph_pass
    def run(model: onnx.ModelProto) -> bool:
        if not sizes:
            return False
        for value, shape in zip(model.graph.input, sizes, strict=False):
            dims = value.type.tensor_type.shape.dim
            if len(dims) != len(shape):
                raise ValueError(f"pin_sizes: {value.name} has rank {len(dims)}, not {shape}")
            for dim, size in zip(dims, shape, strict=True):
                dim.Clear()
                dim.dim_value = size
        return True

    return run


def after_export(padding: Mapping[str, int]) -> Pass:
    """The graph edits applied once per export (see :func:`for_export`)."""
    return chain(
        add_pythonop_ctx,
        stop_edges_behind_identity,
        guard_integer_division,
        reductions_keep_dims,
        where_gradients_reduce,
        conv1d_grouped_as_2d,
        tanh_as_sigmoid,
        add_layernorm_stats,
        split_cross_entropy,
        add_cross_entropy_log_prob,
        add_dropout_masks,
        separate_outputs,
        embedding_padding(padding),
        user_inputs_first,
        mark_static_sizes,
    )


def for_export(padding: Mapping[str, int], dynamic_scalars: frozenset[str]) -> Pass:
    """Pipeline 1, once per export: make the exporter's graph trainable by ORT.

    ``padding`` maps embedding weights to their ``padding_idx``; ``dynamic_scalars`` are the
    scalar leaves fed as tensors.
    """
    return chain(after_export(padding), with_dynamic_scalars(dynamic_scalars))


def for_session(
    inputs_requiring_grad: frozenset[int],
    params_requiring_grad: frozenset[str],
    *,
    seed: int,
    symbolic: bool = False,
    sizes: tuple[tuple[int, ...], ...] = (),
    feed_params_through: str | None = None,
) -> Pass:
    """Pipeline 2, once per ORT training session: what this session differentiates, the
    dropout seeds of torch's current seed, the refusal of graphs whose gradient build would
    kill the process, the user inputs' concrete ``sizes`` when the graph needs them
    (``static_size_ops``), the parameters fed through the autograd.Function named
    ``feed_params_through`` (memory-efficient gradients, :func:`feed_parameters`), and (for the
    memory optimizer) symbolic intermediate shapes."""
    stages: list[Pass] = [
        with_grad_requirements(inputs_requiring_grad, params_requiring_grad),
        seed_dropouts(seed),
        refuse_unsafe_gradients,
        pin_sizes(sizes),
    ]
    if feed_params_through is not None:
        stages.append(feed_parameters(feed_params_through))
    if symbolic:
        stages.append(symbolic_shapes)
    return chain(*stages)
