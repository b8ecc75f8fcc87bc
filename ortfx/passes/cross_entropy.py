"""The exporter's ``SoftmaxCrossEntropyLoss``, rewritten for ORT's CPU kernels.

- :func:`cross_entropy_in_torch` (float32 scores ``[N, C]`` or ``[C]``, no class weights, the
  log-probabilities unused, the compiled bridge present): one ATen node run by torch
  (``ortfx.aten._cross_entropy``: torch's log-softmax kernel a chunk of rows at a time) that
  returns the loss, and whose gradient recomputes the softmax from the scores. No ``[N, C]``
  log-softmax is kept from the forward to the backward, and no ``[N, C]`` gradient of it is
  made: for a language model's logits that is two tables of the largest activation (GPT-2 124M
  at 2 x 128 tokens: 2 x 51 MB).
- :func:`split_cross_entropy` (the other float32 ones): ``LogSoftmax`` + ``GatherElements`` + a
  masked reduction, the same values and gradients; ORT 1.19's kernels for the fused op and its
  gradient are several times slower (7.6 % of a GPT-2 training step).
"""

from __future__ import annotations

from typing import Any

import onnx

from ortfx.passes.core import graph_pass, is_standard

_F32, _I64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}  # torch's reduction enum


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    values = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    reduction = values.get("reduction", b"mean")
    values["reduction"] = reduction.decode() if isinstance(reduction, bytes) else reduction
    return values


def _float_losses(model: onnx.ModelProto) -> dict[int, int]:
    """Index -> rank of the scores, for each SoftmaxCrossEntropyLoss without class weights
    whose scores shape inference types as float32 and whose labels as int32/int64 class
    indices (rank -1 when unknown)."""
    candidates = [
        i
        for i, n in enumerate(model.graph.node)
        if is_standard(n, "SoftmaxCrossEntropyLoss") and not (len(n.input) > 2 and n.input[2])
    ]
    if not candidates:
        return {}
    inferred = onnx.shape_inference.infer_shapes(model).graph
    types = {v.name: v.type.tensor_type for v in (*inferred.value_info, *inferred.input)}
    found = {}
    for i in candidates:
        scores = types.get(model.graph.node[i].input[0])
        labels = types.get(model.graph.node[i].input[1])
        integer = labels is not None and labels.elem_type in (_I64, onnx.TensorProto.INT32)
        if scores is not None and scores.elem_type == _F32 and integer:
            found[i] = len(scores.shape.dim) if scores.HasField("shape") else -1
    return found


def _read(model: onnx.ModelProto) -> set[str]:
    graph = model.graph
    return {name for n in graph.node for name in n.input} | {o.name for o in graph.output}


@graph_pass
def cross_entropy_in_torch(model: onnx.ModelProto) -> bool:
    """Each float32 ``SoftmaxCrossEntropyLoss`` of ``[N, C]`` or ``[C]`` scores, without class
    weights and whose log-probabilities nothing reads, as the ATen node
    ``ortfx_cross_entropy``; see the module docstring. Apply only
    when :func:`ortfx.aten.install` succeeded."""
    from ortfx import aten

    read = _read(model)
    losses = {
        i: rank
        for i, rank in _float_losses(model).items()
        if rank in (1, 2)
        and not (len(model.graph.node[i].output) > 1 and model.graph.node[i].output[1] in read)
    }
    if not losses:
        return False
    h = onnx.helper
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(model.graph.node):
        if i not in losses:
            nodes.append(node)
            continue
        tag = f"ortfx_ce_torch_{i}"
        attributes = _attributes(node)
        ignore = attributes.get("ignore_index")
        constants = {
            "ignore_index": h.make_tensor(f"{tag}_ignore_index", _I64, [], [int(ignore or 0)]),
            "ignores": h.make_tensor(
                f"{tag}_ignores", onnx.TensorProto.BOOL, [], [ignore is not None]
            ),
            "reduction": h.make_tensor(
                f"{tag}_reduction", _I64, [], [_REDUCTIONS[attributes["reduction"]]]
            ),
        }
        model.graph.initializer.extend(constants.values())
        loss = f"{tag}_loss"
        nodes.append(
            h.make_node(
                "ATen",
                [node.input[0], node.input[1], *(c.name for c in constants.values())],
                [loss],
                name=tag,
                domain=aten.DOMAIN,
                operator="ortfx_cross_entropy",
                overload_name="",
            )
        )
        # ORT cannot infer an ATen node's output types; an Identity gives the loss a name of
        # its own when it is a graph output.
        nodes.append(h.make_node("Identity", [loss], [node.output[0]], name=f"{tag}_out"))
        loss_rank = 0 if attributes["reduction"] != "none" else losses[i] - 1
        model.graph.value_info.append(h.make_tensor_value_info(loss, _F32, [None] * loss_rank))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if not any(o.domain == aten.DOMAIN for o in model.opset_import):
        model.opset_import.append(h.make_opsetid(aten.DOMAIN, 1))
    return True


def _split_cross_entropy(node: onnx.NodeProto, tag: str, rank: int) -> list[onnx.NodeProto]:
    """LogSoftmax + GatherElements + a masked reduction, equal to SoftmaxCrossEntropyLoss;
    unbatched scores ``[C]`` (rank 1) as a batch of one."""
    h = onnx.helper
    nodes: list[onnx.NodeProto] = []
    attributes = _attributes(node)
    reduction, ignore = attributes["reduction"], attributes.get("ignore_index")
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

    axis = const("axis", [1], _I64)
    if rank == 1:  # [C] and a scalar label: a batch of one
        zero_axis = const("batch_axis", [0], _I64)
        scores = op("Unsqueeze", [scores, zero_axis], "batched")
        labels = op("Unsqueeze", [labels, zero_axis], "batched_labels")
        log_prob = f"{tag}_batched_log_prob"
    op("LogSoftmax", [scores], "log_softmax", log_prob, axis=1)
    index, valid = labels, ""
    if ignore is not None:
        ignored = op("Equal", [labels, const("ignore", int(ignore), _I64)], "ignored")
        valid = op("Not", [ignored], "valid")
        index = op("Where", [valid, labels, const("zero_index", 0, _I64)], "index")
    gathered = op(
        "GatherElements", [log_prob, op("Unsqueeze", [index, axis], "idx")], "gather", axis=1
    )
    nll = op("Neg", [op("Squeeze", [gathered, axis], "picked")], "nll")
    if valid:
        nll = op("Where", [valid, nll, const("zero", 0.0, _F32)], "masked")
    loss = node.output[0]
    if reduction == "none":
        if rank == 1:
            op("Squeeze", [nll, zero_axis], "loss", loss)
        else:
            op("Identity", [nll], "loss", loss)
    elif reduction == "sum":
        op("ReduceSum", [nll], "loss", loss, keepdims=0)
    elif not valid:
        op("ReduceMean", [nll], "loss", loss, keepdims=0)
    else:
        total = op("ReduceSum", [nll], "total", keepdims=0)
        count = op("ReduceSum", [op("Cast", [valid], "valid_f", to=_F32)], "count", keepdims=0)
        op("Div", [total, count], "loss", loss)
    return nodes


@graph_pass
def split_cross_entropy(model: onnx.ModelProto) -> bool:
    """Each float32 SoftmaxCrossEntropyLoss without class weights as LogSoftmax +
    GatherElements (see the module docstring)."""
    losses = {i: rank for i, rank in _float_losses(model).items() if rank != 0}
    if not losses:
        return False
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(model.graph.node):
        if i in losses:
            nodes.extend(_split_cross_entropy(node, f"ortfx_ce_{i}", losses[i]))
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return True
