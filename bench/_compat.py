"""Bench-local workarounds for ortfx gaps, applied by monkeypatching (bench must not edit ortfx).

``add_softmax_ce_log_prob``: ORT's SoftmaxCrossEntropyLoss gradient reads the node's second
output (``log_prob``), which the TorchScript exporter does not emit, so any model computing
``F.cross_entropy`` inside the graph fails in ``OrtModuleGraphBuilder.build`` with
``GradientBuilderBase::O(size_t, bool) const i < node_->OutputDefs().size() was false``.
The pass is a no-op on nodes that already have the output, so it stays harmless once ortfx
ships the same fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx

from ortfx import passes

_PATCHED = False


@passes.graph_pass
def add_softmax_ce_log_prob(model: onnx.ModelProto) -> bool:
    changed = False
    for i, node in enumerate(model.graph.node):
        if node.op_type != "SoftmaxCrossEntropyLoss" or node.domain not in ("", "ai.onnx"):
            continue
        if len(node.output) < 2 or not node.output[1]:
            outputs = [*node.output, ""][:2]
            outputs[1] = f"{node.name or f'SoftmaxCrossEntropyLoss_{i}'}_log_prob"
            del node.output[:]
            node.output.extend(outputs)
            changed = True
    return changed


def apply() -> None:
    """Run the pass on the graph each ``TrainingRunner`` receives (a stable seam: the shape of
    ``ortfx.passes.after_export`` is still changing)."""
    global _PATCHED
    if _PATCHED:
        return
    from ortfx.runtime import session

    original = session.TrainingRunner.__init__

    def __init__(self: Any, info: Any, *args: Any, **kwargs: Any) -> None:
        original(self, add_softmax_ce_log_prob(info), *args, **kwargs)

    session.TrainingRunner.__init__ = __init__  # type: ignore[method-assign]
    _PATCHED = True


def apply_pass(graph_pass: passes.Pass, when: Callable[[], bool] = lambda: True) -> None:
    """Run ``graph_pass`` on the graph of every ``TrainingRunner`` created from now on (while
    ``when()`` is true)."""
    from ortfx.runtime import session

    original = session.TrainingRunner.__init__

    def __init__(self: Any, info: Any, *args: Any, **kwargs: Any) -> None:
        original(self, graph_pass(info) if when() else info, *args, **kwargs)

    session.TrainingRunner.__init__ = __init__  # type: ignore[method-assign]


def _split_sce(node: onnx.NodeProto, b: str, lse: bool = False) -> list[onnx.NodeProto]:
    """The replacement of one SoftmaxCrossEntropyLoss node (without class weights).

    ``lse``: nll = ReduceLogSumExp(x) - x[label] instead of -LogSoftmax(x)[label]."""
    from onnx import TensorProto, helper

    nodes: list[onnx.NodeProto] = []
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    reduction = attrs.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    ignore = attrs.get("ignore_index")
    scores, labels = node.input[0], node.input[1]
    logp = node.output[1] if len(node.output) > 1 and node.output[1] else f"{b}_logp"

    def const(name: str, value: float | int | list[int], dtype: int) -> str:
        dims = [len(value)] if isinstance(value, list) else []
        vals = value if isinstance(value, list) else [value]
        tensor = helper.make_tensor(f"{b}_{name}_t", dtype, dims, vals)
        nodes.append(helper.make_node("Constant", [], [f"{b}_{name}"], value=tensor))
        return f"{b}_{name}"

    def op(kind: str, inputs: list[str], name: str, out: str = "", **kw: Any) -> str:
        out = out or f"{b}_{name}"
        nodes.append(helper.make_node(kind, inputs, [out], name=f"{b}_{name}", **kw))
        return out

    if not lse:
        op("LogSoftmax", [scores], "logsoftmax", logp, axis=1)
    axis1 = const("axis1", [1], TensorProto.INT64)
    index, valid = labels, ""
    if ignore is not None:
        ii = const("ignore", int(ignore), TensorProto.INT64)
        valid = op("Not", [op("Equal", [labels, ii], "eq")], "valid")
        index = op("Where", [valid, labels, const("zero_i", 0, TensorProto.INT64)], "safe")
    idx = op("Unsqueeze", [index, axis1], "idx")
    source = scores if lse else logp
    picked = op("Squeeze", [op("GatherElements", [source, idx], "gather", axis=1), axis1], "picked")
    if lse:
        # keepdims=1: ORT 1.19's ReduceLogSumExp gradient emits an invalid Unsqueeze otherwise
        norm = op("ReduceLogSumExp", [scores], "lse", axes=[1], keepdims=1)
        norm = op("Squeeze", [norm, axis1], "lse_squeezed")
        nll = op("Sub", [norm, picked], "nll")
    else:
        nll = op("Neg", [picked], "nll")
    if valid:
        nll = op("Where", [valid, nll, const("zero_f", 0.0, TensorProto.FLOAT)], "masked")
    loss = node.output[0]
    if reduction == "none":
        op("Identity", [nll], "out", loss)
    elif reduction == "sum":
        op("ReduceSum", [nll], "out", loss, keepdims=0)
    elif not valid:
        op("ReduceMean", [nll], "out", loss, keepdims=0)
    else:
        total = op("ReduceSum", [nll], "total", keepdims=0)
        validf = op("Cast", [valid], "validf", to=TensorProto.FLOAT)
        op("Div", [total, op("ReduceSum", [validf], "count", keepdims=0)], "out", loss)
    return nodes


def _rewrite_sce(model: onnx.ModelProto, *, lse: bool) -> bool:
    changed = False
    out: list[onnx.NodeProto] = []
    for i, node in enumerate(model.graph.node):
        if (
            node.op_type != "SoftmaxCrossEntropyLoss"
            or node.domain not in ("", "ai.onnx")
            or (len(node.input) > 2 and node.input[2])
        ):
            out.append(node)
            continue
        if lse and len(node.output) > 1 and node.output[1]:
            out.append(node)  # log_prob is used downstream: keep the node
            continue
        out.extend(_split_sce(node, f"ortfx_sce_{i}", lse))
        changed = True
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(out)
    return changed


@passes.graph_pass
def split_softmax_cross_entropy(model: onnx.ModelProto) -> bool:
    """Experimental speed pass: ``SoftmaxCrossEntropyLoss`` (no class weights) -> ``LogSoftmax``
    + ``GatherElements`` + masked reduction, all ops with ORT gradients (ORT 1.19 has no
    gradient for ``NegativeLogLikelihoodLoss``). ORT's CPU SoftmaxCrossEntropyLoss(Grad)
    kernels are several times slower than torch's log_softmax + nll_loss on a large vocabulary;
    LogSoftmax runs vectorised. Measured by ``bench.session_settings --variants sce-split``."""
    return _rewrite_sce(model, lse=False)


@passes.graph_pass
def logsumexp_cross_entropy(model: onnx.ModelProto) -> bool:
    """As :func:`split_softmax_cross_entropy`, with nll = ReduceLogSumExp(x) - x[label]."""
    return _rewrite_sce(model, lse=True)
