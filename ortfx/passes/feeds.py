"""Memory-efficient gradients, graph side (the torch side is :mod:`ortfx.runtime.memgrad`).

Parameters are fed through PythonOps (:func:`feed_parameters`); in ORT's gradient model, each
gradient goes to torch only after the parameter's backward readers (:func:`feeds_after_readers`);
in the graph the session runs, :func:`owned_gradients` finds the gradients torch may keep without
a copy. ZeRO-3's per-layer gathering is :mod:`ortfx.passes.layerwise`.
"""

from __future__ import annotations

import attrs
import onnx

from ortfx.model_info import InputKind, InputSpec, PostExportProcessedModelInfo
from ortfx.passes.core import Pass

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
LAYOUT_OPS = frozenset(
    {"Transpose", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten", "Cast", "Expand"}
)


def downstream(graph: onnx.GraphProto, start: set[str]) -> set[str]:
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
    backward = downstream(graph, {o for n in yields for o in n.output})
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in set(node.input):
            consumers.setdefault(name, []).append(node)

    def readers(value: str) -> list[str]:
        found: list[str] = []
        for node in consumers.get(value, []):
            if node.op_type == "PythonOpGrad" or not node.output:
                continue
            if node.op_type in LAYOUT_OPS and node.output[0] not in backward:
                found.extend(readers(node.output[0]))  # W^T etc.: wait for who reads that
            elif node.output[0] in backward or node.op_type in LAYOUT_OPS:
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
