"""Bench-local workarounds for ortfx gaps, applied by monkeypatching (bench must not edit ortfx).

``add_softmax_ce_log_prob``: ORT's SoftmaxCrossEntropyLoss gradient reads the node's second
output (``log_prob``), which the TorchScript exporter does not emit, so any model computing
``F.cross_entropy`` inside the graph fails in ``OrtModuleGraphBuilder.build`` with
``GradientBuilderBase::O(size_t, bool) const i < node_->OutputDefs().size() was false``.
The pass is a no-op on nodes that already have the output, so it stays harmless once ortfx
ships the same fix.
"""

from __future__ import annotations

from typing import Any

import onnx

from ortfx import passes

_PATCHED = False


@passes.graph_pass
def add_softmax_ce_log_prob(model: onnx.ModelProto) -> bool:
    changed = False
    for i, node in enumerate(model.graph.node):
        if node.op_type == "SoftmaxCrossEntropyLoss" and node.domain in ("", "ai.onnx"):
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
