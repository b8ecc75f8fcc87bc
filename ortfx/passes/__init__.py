"""Post-export processing: pure passes over a model record, composed with :func:`chain`.

Each pass takes a :class:`PostExportProcessedModelInfo` and returns a new one; none mutates its
input (graph edits happen on a private copy of the decoded model).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs
import onnx

from ortfx.model_info import InputKind, PostExportProcessedModelInfo

Pass = Callable[[PostExportProcessedModelInfo], PostExportProcessedModelInfo]


def chain(*passes: Pass) -> Pass:
    """Compose passes left to right (Optax's ``chain`` for graphs)."""

    def run(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
        return functools.reduce(lambda acc, p: p(acc), passes, info)

    return run


def graph_pass(edit: Callable[[onnx.ModelProto], bool]) -> Pass:
    """Lift an in-place edit of a private ModelProto copy into a pure pass.

    ``edit`` returns whether it changed anything; an unchanged model keeps its bytes.
    """

    @functools.wraps(edit)
    def run(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
        model = onnx.load_model_from_string(info.model)
        if not edit(model):
            return info
        return attrs.evolve(info, model=model.SerializeToString())

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
def add_dropout_masks(model: onnx.ModelProto) -> bool:
    """Give every Dropout its mask output: DropoutGrad reads it (dynamo exports omit it)."""
    changed = False
    for i, node in enumerate(model.graph.node):
        if _standard(node, "Dropout") and len(node.output) < 2:
            node.output.append(f"{node.name or f'Dropout_{i}'}_mask")
            changed = True
    return changed


@graph_pass
def separate_outputs(model: onnx.ModelProto) -> bool:
    """Give each graph output its own value: a returned input or a tensor returned twice gets
    an Identity, so ORT yields (and takes gradients for) every output position separately."""
    inputs = {i.name for i in model.graph.input}
    seen: set[str] = set()
    changed = False
    for k, output in enumerate(model.graph.output):
        if output.name in inputs or output.name in seen:
            fresh = f"{output.name}_output_{k}"
            model.graph.node.append(
                onnx.helper.make_node("Identity", [output.name], [fresh], name=f"ortfx_{fresh}")
            )
            output.name = fresh
            changed = True
        seen.add(output.name)
    return changed


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


# Applied once per export; grad requirements and seeds are applied per session.
after_export: Pass = chain(add_layernorm_stats, add_dropout_masks, separate_outputs, user_inputs_first)
