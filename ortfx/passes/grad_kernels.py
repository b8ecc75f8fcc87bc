"""Edits of ORT's gradient model, kernel by kernel: gradients run by torch's kernels through
the ATen executor (faster, and torch's NaN rule), or torch's NaN rule in ONNX ops without it."""

from __future__ import annotations

import onnx

from ortfx import aten


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


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def embedding_grads_scattered(model: onnx.ModelProto) -> bool:
    """In a gradient model: a weight read both by a ``Gather`` (an embedding) and by another
    node (a tied LM head) has its two gradients summed, ``Sum(GatherGrad(...), dW)``, where
    ``GatherGrad`` writes a dense table of zeros and the gathered rows' gradients. Written
    instead as ``ScatterND(dW, rows, their gradients, reduction="add")``: the rows added into
    the other gradient, without the dense table (154 MB and 29 ms per step for GPT-2's 50257 x
    768 embedding at 124M). Only ORT's accumulation nodes (``AccumulateGrad_*``, same-shaped
    gradients of one tensor) with a ``GatherGrad`` on axis 0 read by nothing else."""
    if _opset(model) < 16:  # ScatterND's reduction
        return False
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for name in graph.output:
        readers[name.name] = readers.get(name.name, 0) + 1
    h = onnx.helper
    rewritten: dict[int, list[onnx.NodeProto]] = {}
    dropped: set[str] = set()  # the GatherGrad outputs replaced
    for i, node in enumerate(graph.node):
        if not (
            node.op_type == "Sum"
            and node.domain in ("", "ai.onnx")
            and node.name.startswith("AccumulateGrad_")
            and len(node.input) == 2
        ):
            continue
        gathers = [
            k
            for k, name in enumerate(node.input)
            if (g := producer.get(name)) is not None
            and g.op_type == "GatherGrad"
            and g.domain == "com.microsoft"
            and next((a.i for a in g.attribute if a.name == "axis"), 0) == 0
            and readers.get(name) == 1
        ]
        if len(gathers) != 1:
            continue
        gather = producer[node.input[gathers[0]]]
        other = node.input[1 - gathers[0]]
        shape, indices, grad = gather.input[:3]
        tag = f"{node.name}_scattered"
        consts = [
            h.make_tensor(f"{tag}_rows_shape", onnx.TensorProto.INT64, [2], [-1, 1]),
            h.make_tensor(f"{tag}_one", onnx.TensorProto.INT64, [1], [1]),
            h.make_tensor(f"{tag}_end", onnx.TensorProto.INT64, [1], [2**62]),
            h.make_tensor(f"{tag}_minus1", onnx.TensorProto.INT64, [1], [-1]),
        ]
        graph.initializer.extend(consts)
        replacement = [
            h.make_node("Reshape", [indices, consts[0].name], [f"{tag}_rows"], name=f"{tag}_rows"),
            h.make_node(
                "Slice", [shape, consts[1].name, consts[2].name], [f"{tag}_tail"],
                name=f"{tag}_tail",
            ),
            h.make_node(
                "Concat", [consts[3].name, f"{tag}_tail"], [f"{tag}_updates_shape"],
                name=f"{tag}_updates_shape", axis=0,
            ),
            h.make_node(
                "Reshape", [grad, f"{tag}_updates_shape"], [f"{tag}_updates"],
                name=f"{tag}_updates",
            ),
            h.make_node(
                "ScatterND", [other, f"{tag}_rows", f"{tag}_updates"], list(node.output),
                name=tag, reduction="add",
            ),
        ]  # fmt: skip
        rewritten[i] = replacement
        dropped.add(gather.output[0])
    if not rewritten:
        return False
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(graph.node):
        if i in rewritten:
            nodes.extend(rewritten[i])
        elif not (node.op_type == "GatherGrad" and node.output[0] in dropped):
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return True


def cross_entropy_grads_summed(model: onnx.ModelProto) -> bool:
    """In a gradient model: the cross-entropy's gradient (``ortfx_cross_entropy_backward``)
    summed with another gradient of the scores made before it, ``Add(other, Reshape(dS))``
    (a language model's logits are an output too: the gradient fed for them), is computed by
    the same node: it adds the other gradient chunk by chunk, or nothing when that is the
    scalar zero fed for an unused output. One [N, C] pass and one [N, C] buffer fewer per
    backward."""
    graph = model.graph
    # where each value is made (graph inputs and initializers before every node)
    made = {v.name: -1 for v in (*graph.input, *graph.initializer)}
    made.update({out: k for k, node in enumerate(graph.node) for out in node.output})
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    dropped: set[int] = set()
    for k, node in enumerate(graph.node):
        operator = next((a.s for a in node.attribute if a.name == "operator"), b"")
        if not (node.op_type == "ATen" and operator == b"ortfx_cross_entropy_backward"):
            continue
        grad = node.output[0]
        if grad in outputs or len(readers.get(grad, [])) != 1:
            continue
        reshape = readers[grad][0]
        if not (reshape.op_type == "Reshape" and reshape.domain in ("", "ai.onnx")):
            continue
        after = reshape.output[0]
        if after in outputs or len(readers.get(after, [])) != 1:
            continue
        add = readers[after][0]
        if not (add.op_type == "Add" and add.domain in ("", "ai.onnx") and len(add.input) == 2):
            continue
        extra = add.input[1] if add.input[0] == after else add.input[0]
        if made.get(extra, k) >= k:  # made after the node (or from its output): cannot move in
            continue
        node.input.append(extra)
        for a in node.attribute:
            if a.name == "operator":
                a.s = b"ortfx_cross_entropy_backward_plus"
        reshape.output[0] = add.output[0]
        dropped.add(id(add))
    if not dropped:
        return False
    kept = [n for n in graph.node if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    return True
