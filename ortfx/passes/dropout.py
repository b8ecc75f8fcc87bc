"""Dropout: the mask output its gradient reads, and seeds derived from torch's, so that the
same torch seed gives the same masks."""

from __future__ import annotations

import onnx

from ortfx.passes.core import Pass, graph_pass, is_standard


@graph_pass
def add_dropout_masks(model: onnx.ModelProto) -> bool:
    """Give every Dropout its mask output: DropoutGrad reads it (dynamo exports omit it)."""
    changed = False
    for i, node in enumerate(model.graph.node):
        if is_standard(node, "Dropout") and len(node.output) < 2:
            node.output.append(f"{node.name or f'Dropout_{i}'}_mask")
            changed = True
    return changed


def seed_dropouts(seed: int) -> Pass:
    """Give each Dropout a seed derived from ``seed``: same torch seed, same masks, run to run."""

    @graph_pass
    def run(model: onnx.ModelProto) -> bool:
        changed = False
        for i, node in enumerate(model.graph.node):
            if is_standard(node, "Dropout"):
                kept = [a for a in node.attribute if a.name != "seed"]
                del node.attribute[:]
                node.attribute.extend(kept)
                node.attribute.append(onnx.helper.make_attribute("seed", (seed + 7919 * i) % 2**31))
                changed = True
        return changed

    return run
