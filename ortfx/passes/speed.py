"""Rewrites for speed: the same values and gradients from ops whose ORT CPU kernels are
faster (``Tanh`` as ``Sigmoid``, weights read in their own layout). The cross-entropy's rewrites
are in :mod:`ortfx.passes.cross_entropy`."""

from __future__ import annotations

from typing import Any

import onnx

from ortfx.passes.core import graph_pass, is_standard


@graph_pass
def tanh_as_sigmoid(model: onnx.ModelProto) -> bool:
    """Write float32 ``Tanh(z)`` as ``2 * Sigmoid(2 * z) - 1``.

    ORT fuses the exporter's tanh GELU into ``FastGelu``, whose CPU gradient (``FastGeluGrad``)
    is several times slower than the unfused elementwise ops; without a ``Tanh`` the fusion
    does not match. Only tensors shape inference types as float32 are rewritten.
    """
    if not any(is_standard(n, "Tanh") for n in model.graph.node):
        return False
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    floats = {
        v.name
        for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
        if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    }
    h = onnx.helper
    nodes: list[onnx.NodeProto] = []
    changed = False
    for i, node in enumerate(model.graph.node):
        if not (is_standard(node, "Tanh") and node.input[0] in floats):
            nodes.append(node)
            continue
        tag = f"{node.name or f'Tanh_{i}'}_as_sigmoid"
        two = h.make_tensor(f"{tag}_two_value", onnx.TensorProto.FLOAT, [], [2.0])
        one = h.make_tensor(f"{tag}_one_value", onnx.TensorProto.FLOAT, [], [1.0])
        nodes += [
            h.make_node("Constant", [], [f"{tag}_two"], name=f"{tag}_two", value=two),
            h.make_node("Constant", [], [f"{tag}_one"], name=f"{tag}_one", value=one),
            h.make_node("Mul", [node.input[0], f"{tag}_two"], [f"{tag}_2z"], name=f"{tag}_2z"),
            h.make_node("Sigmoid", [f"{tag}_2z"], [f"{tag}_s"], name=f"{tag}_s"),
            h.make_node("Mul", [f"{tag}_s", f"{tag}_two"], [f"{tag}_2s"], name=f"{tag}_2s"),
            h.make_node("Sub", [f"{tag}_2s", f"{tag}_one"], [node.output[0]], name=tag),
        ]
        changed = True
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return changed


def _is_weight_transpose(node: onnx.NodeProto, matrices: set[str]) -> bool:
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
    return is_standard(node, "Transpose") and node.input[0] in matrices and perm == [1, 0]


@graph_pass
def weights_untransposed(model: onnx.ModelProto) -> bool:
    """``MatMul(X, Transpose(W))`` for a float32 matrix input ``W`` (a weight: ``nn.Linear`` on
    inputs of rank other than 2, a tied LM head) as ``Gemm(X as [-1, K], W, transB=1)``
    reshaped back. Same products, without a transposed copy of ``W`` in every forward and a
    transpose of its gradient in every backward (GPT-2 124M: 126 ms of a 3.3 s step for the
    50257 x 768 head); the Gemm's gradient writes ``dW`` in ``W``'s own layout.
    """
    graph = model.graph
    matrices = {
        v.name
        for v in graph.input
        if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        and len(v.type.tensor_type.shape.dim) == 2
    }
    transposes = {n.output[0]: n.input[0] for n in graph.node if _is_weight_transpose(n, matrices)}
    rewritten = {
        i
        for i, n in enumerate(graph.node)
        if is_standard(n, "MatMul") and n.input[1] in transposes and n.input[0] != n.input[1]
    }
    if not rewritten:
        return False
    h = onnx.helper
    sizes: dict[str, tuple[str, str]] = {}  # weight -> ([-1, K], [N]) tensors
    nodes: list[onnx.NodeProto] = []

    def const(name: str, values: list[int]) -> str:
        value = h.make_tensor(f"{name}_value", onnx.TensorProto.INT64, [len(values)], values)
        nodes.append(h.make_node("Constant", [], [name], name=name, value=value))
        return name

    def op(kind: str, inputs: list[str], name: str, **attributes: Any) -> str:
        nodes.append(h.make_node(kind, inputs, [name], name=name, **attributes))
        return name

    out: list[onnx.NodeProto] = []
    for i, node in enumerate(graph.node):
        if i not in rewritten:
            out.append(node)
            continue
        x, weight = node.input[0], transposes[node.input[1]]
        tag = f"ortfx_untransposed_{i}"
        nodes.clear()
        if weight not in sizes:
            wtag = f"ortfx_untransposed_{weight.replace('.', '_')}"
            shape = op("Shape", [weight], f"{wtag}_shape")
            k = op("Slice", [shape, const(f"{wtag}_1", [1]), const(f"{wtag}_2", [2])], f"{wtag}_k")
            n = op("Slice", [shape, const(f"{wtag}_0", [0]), f"{wtag}_1"], f"{wtag}_n")
            flat = op("Concat", [const(f"{wtag}_minus1", [-1]), k], f"{wtag}_flat", axis=0)
            sizes[weight] = (flat, n)
        flat, n = sizes[weight]
        x_shape = op("Shape", [x], f"{tag}_x_shape")
        lead = op(
            "Slice",
            [x_shape, const(f"{tag}_start", [0]), const(f"{tag}_end", [-1])],
            f"{tag}_lead",
        )
        back = op("Concat", [lead, n], f"{tag}_back", axis=0)
        x2 = op("Reshape", [x, flat], f"{tag}_x2")
        y2 = op("Gemm", [x2, weight], f"{tag}_gemm", transB=1)
        nodes.append(h.make_node("Reshape", [y2, back], [node.output[0]], name=tag))
        out.extend(nodes)
    used = {name for n in out for name in n.input}
    out = [
        n for n in out if not (n.output and n.output[0] in transposes and n.output[0] not in used)
    ]
    del graph.node[:]
    graph.node.extend(out)
    return True
