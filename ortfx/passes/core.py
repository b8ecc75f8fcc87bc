"""The pass machinery, and the graph queries several families share.

A pass is a pure function from one model record to a new one (:data:`Pass`); :func:`graph_pass`
lifts an in-place edit of a private ModelProto copy into one, and :func:`chain` composes passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import attrs
import onnx

from ortfx.model_info import PostExportProcessedModelInfo

Pass = Callable[[PostExportProcessedModelInfo], PostExportProcessedModelInfo]


Edit = Callable[[onnx.ModelProto], bool]


def _with_model(
    info: PostExportProcessedModelInfo, model: onnx.ModelProto
) -> PostExportProcessedModelInfo:
    """``info`` with an edited ``model``; the runners fetch outputs by ``output_names``, so
    they follow an edit that renames graph outputs (see
    :func:`~ortfx.passes.interface.separate_outputs`)."""
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


def is_standard(node: onnx.NodeProto, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


# Nodes whose outputs carry only the shape of their inputs, not their values.
_SHAPE_ONLY = frozenset({"Shape", "Size"})


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph`` and of its subgraphs (If branches, Loop bodies), depth first."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from all_nodes(attribute.g)
            for sub in attribute.graphs:
                yield from all_nodes(sub)


def subgraph_names(node: onnx.NodeProto) -> set[str]:
    """Every value name the node's subgraphs (If branches, Loop bodies) read."""
    names: set[str] = set()
    for attribute in node.attribute:
        for graph in (attribute.g, *attribute.graphs):
            for inner in graph.node:
                names.update(inner.input)
                names.update(subgraph_names(inner))
    return names


def computed_from(model: onnx.ModelProto, seeds: set[str]) -> set[str]:
    """Names of values computed from the values (not only the shapes) of ``seeds``."""
    dependent = set(seeds)
    for node in model.graph.node:  # ONNX nodes are topologically sorted
        if node.op_type in _SHAPE_ONLY and node.domain in ("", "ai.onnx"):
            continue
        read = {*node.input, *subgraph_names(node)}
        if not read.isdisjoint(dependent):
            dependent.update(node.output)
    return dependent


def computed_from_inputs(model: onnx.ModelProto) -> set[str]:
    return computed_from(model, {v.name for v in model.graph.input})
