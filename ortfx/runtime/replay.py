"""A second backward through one ORT forward (``retain_graph=True``): whether re-running the
forward gives back the activations the first backward consumed.

ORT's backward consumes the partial-run state of its forward (the activations are freed and
the state cannot run another backward). A second backward through the same autograd node, as
multi-loss training does (``l1.backward(retain_graph=True); l2.backward()``), re-runs the
forward on the same inputs for a fresh state. That is exact only when the forward computes the
same values again: no random node (Dropout draws new masks), no custom Function (its Python
would run again), no memory-efficient gradients (their parameter feeds are a one-shot
protocol), and no tensor the forward changes in place (a buffer ortfx writes back after the
run) among what the outputs are computed from. Each graph gets its answer once, when its
training runner is built.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx

from ortfx.model_info import InputKind, PostExportProcessedModelInfo
from ortfx.passes.core import all_nodes

# ONNX's random operators (see ortfx.passes.dropout, which seeds them).
_RANDOM = frozenset(
    {
        "Dropout",
        "RandomUniform",
        "RandomUniformLike",
        "RandomNormal",
        "RandomNormalLike",
        "Bernoulli",
        "Multinomial",
    }
)

RETAINED_GRAPH_REFUSED = (
    "a second backward through the same ortfx forward (retain_graph=True, or several losses "
    "from one output) needs that forward run again, since ONNX Runtime frees its activations "
    "in the first backward, and this graph would not compute the same values again: {why}. "
    "Sum the losses and call backward once ((l1 + l2).backward()), call the module again for "
    "the second loss, or run this module in PyTorch for such steps (model.module(...))."
)


def _read_names(node: onnx.NodeProto) -> set[str]:
    """What ``node`` reads, its subgraphs' outer names included."""
    names = set(node.input)
    for attribute in node.attribute:
        subgraphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else []
        for sub in [*subgraphs, *attribute.graphs]:
            for inner in all_nodes(sub):
                names.update(inner.input)
    return names


def computed_from(graph: onnx.GraphProto, outputs: Iterable[str]) -> set[str]:
    """The names ``outputs`` are computed from (themselves included), through subgraphs."""
    producers = {name: node for node in graph.node for name in node.output}
    pending = list(outputs)
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        node = producers.get(name)
        if node is not None:
            pending.extend(_read_names(node))
    return seen


def _zero_constants(graph: onnx.GraphProto) -> set[str]:
    """Names of the graph's constant zeros and falses (a Dropout's ratio or training flag)."""
    tensors = [(t.name, t) for t in graph.initializer]
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            for a in node.attribute:
                if a.name == "value":
                    tensors.append((node.output[0], a.t))
    found = set()
    for name, tensor in tensors:
        array = onnx.numpy_helper.to_array(tensor)
        if array.size == 1 and not array.any():
            found.add(name)
    return found


def _draws(node: onnx.NodeProto, zeros: set[str]) -> bool:
    """Whether ``node`` draws random numbers (a Dropout of ratio 0 or out of training does
    not)."""
    if node.op_type not in _RANDOM:
        return False
    if node.op_type == "Dropout":
        ratio, training = [*node.input, "", ""][1:3]
        return not (ratio in zeros or training in zeros or not training)
    return True


def refusal(info: PostExportProcessedModelInfo, *, python_ops: bool) -> str | None:
    """Why a second backward cannot re-run ``info``'s forward (the full message), or None
    when it can."""
    if python_ops:
        why = "it calls custom autograd Functions, whose forward would run a second time"
        return RETAINED_GRAPH_REFUSED.format(why=why)
    if info.fed_params:
        why = "memory-efficient gradients hand each parameter's gradient over once"
        return RETAINED_GRAPH_REFUSED.format(why=why)
    graph = onnx.load_model_from_string(info.model).graph
    zeros = _zero_constants(graph)
    random = sorted({n.op_type for n in all_nodes(graph) if _draws(n, zeros)})
    if random:
        why = f"it draws random numbers ({', '.join(random)}), which would differ"
        return RETAINED_GRAPH_REFUSED.format(why=why)
    updated = set()
    for update in info.updates:
        for spec in info.inputs:
            user = spec.kind is InputKind.USER
            if (update.kind == "input") == user and spec.source == update.target:
                updated.add(spec.name)
    if not updated:
        return None
    read = sorted(updated & computed_from(graph, info.output_names[: info.n_user_outputs]))
    if read:
        why = (
            f"its outputs are computed from {', '.join(read)}, which the forward changes in "
            "place (the value it read is gone)"
        )
        return RETAINED_GRAPH_REFUSED.format(why=why)
    return None
