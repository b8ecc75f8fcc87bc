"""What an ORT training session differentiates: the inputs and parameters that require grad,
and the refusal of gradients ORT would build wrong or die building."""

from __future__ import annotations

import attrs
import onnx

from ortfx.errors import (
    NO_LOOP_GRADIENT,
    UNSUPPORTED_OP,
    VALUE_DEPENDENT_CONTROL_FLOW,
    WRONG_AVERAGE_POOL_3D,
    WRONG_REDUCING_SCATTER,
    OrtfxUnsupportedOpError,
)
from ortfx.model_info import InputKind, PostExportProcessedModelInfo
from ortfx.passes.core import Pass, computed_from, computed_from_inputs, is_standard, subgraph_names


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
    condition depends on tensor values (ORT 1.19's gradient builder aborts), a ``Loop`` or
    ``Scan`` (ORT 1.19 has no gradient for either: its builder raises, or aborts the process
    when the body reads a value computed outside it, as ``F.embedding_bag`` on a computed
    table exports), and a 3-d
    ``AveragePool`` (its CPU gradient kernel computes wrong values; torch exports
    ``nn.AvgPool3d`` and ``nn.LocalResponseNorm`` with it), found by tests/test_layer_sweep;
    and a reducing ``ScatterElements``/``ScatterND`` whose gradient ORT builds as if it did
    not reduce: for its input under any reduction, for its updates under ``mul``/``max``/
    ``min`` (tests/test_indexing.py)."""
    model = onnx.load_model_from_string(info.model)
    trained = {s.name for s in info.inputs if s.requires_grad}
    differentiated = computed_from(model, trained)
    values = computed_from_inputs(model)
    for node in model.graph.node:
        read = {*node.input, *subgraph_names(node)}
        if read.isdisjoint(differentiated):
            continue
        if is_standard(node, "If") and node.input[0] in values:
            raise _unsupported(node, VALUE_DEPENDENT_CONTROL_FLOW.format(node=node.name or "If"))
        if is_standard(node, "Loop") or is_standard(node, "Scan"):
            raise _unsupported(node, NO_LOOP_GRADIENT.format(op=node.op_type))
        kernel = next((list(a.ints) for a in node.attribute if a.name == "kernel_shape"), [])
        if is_standard(node, "AveragePool") and len(kernel) == 3:
            raise _unsupported(node, WRONG_AVERAGE_POOL_3D)
        if _wrong_scatter_gradient(node, differentiated):
            reduction = _reduction(node)
            raise _unsupported(
                node, WRONG_REDUCING_SCATTER.format(op=node.op_type, reduction=reduction)
            )
    return info


def _reduction(node: onnx.NodeProto) -> str:
    found = next((a.s for a in node.attribute if a.name == "reduction"), b"none")
    return found.decode()


def _wrong_scatter_gradient(node: onnx.NodeProto, differentiated: set[str]) -> bool:
    """A reducing scatter whose input, or (for ``mul``/``max``/``min``) whose updates, ORT
    would differentiate as a plain scatter."""
    if not (is_standard(node, "ScatterElements") or is_standard(node, "ScatterND")):
        return False
    reduction = _reduction(node)
    if reduction == "none":
        return False
    updates_wrong = reduction != "add" and node.input[2] in differentiated
    return node.input[0] in differentiated or updates_wrong
