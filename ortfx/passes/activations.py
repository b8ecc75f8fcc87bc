"""Activations written out of elementwise ops, run instead by torch's fused kernel.

:func:`tanh_gelu_in_torch`: the tanh GELU written by hand (transformers' ``gelu_new``,
``NewGELUActivation``: ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3))))``, GPT-2's
activation) exports as eight elementwise ops; their gradients are a dozen more, each a pass
over the MLP's widest activation, several of them kept from the forward for the backward. The
ATen node ``ortfx_gelu`` runs torch's fused ``gelu(approximate="tanh")`` and its fused gradient:
2.3 % of a GPT-2-like training step, 3.6 % at GPT-2 124M (paired A/Bs, ``bench.session_settings``
variant ``gelu-decomposed``). ORT's memory optimizer does not recompute an ATen node: with
layer-wise recompute it keeps the GELU's output and recomputes around it, which measured less
memory and less time than recomputing the eight ops (GPT-2-like: step growth 100 against
117 MB). ``F.gelu`` exports as ORT's own fused ``Gelu`` and is left alone.
"""

from __future__ import annotations

import math

import numpy as np
import onnx

from ortfx.passes.core import graph_pass, is_standard

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _scalars(model: onnx.ModelProto) -> dict[str, float]:
    """The value of every one-element constant (Constant nodes and initializers)."""
    found: dict[str, float] = {}
    for tensor in model.graph.initializer:
        if int(np.prod(tensor.dims)) == 1:
            found[tensor.name] = float(onnx.numpy_helper.to_array(tensor).reshape(()))
    for node in model.graph.node:
        if is_standard(node, "Constant"):
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None and int(np.prod(value.dims)) == 1:
                found[node.output[0]] = float(onnx.numpy_helper.to_array(value).reshape(()))
    return found


def _close(value: float | None, expected: float) -> bool:
    return value is not None and abs(value - expected) <= 1e-6 * abs(expected)


class _Graph:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.scalars = _scalars(model)
        self.producer = {out: node for node in model.graph.node for out in node.output}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for node in model.graph.node:
            for name in node.input:
                self.readers.setdefault(name, []).append(node)
        for output in model.graph.output:
            self.readers.setdefault(output.name, []).append(onnx.NodeProto())

    def op(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and is_standard(node, op_type) else None

    def only_reader(self, name: str) -> onnx.NodeProto | None:
        readers = self.readers.get(name, [])
        return readers[0] if len(readers) == 1 else None

    def split(self, node: onnx.NodeProto, constant: float) -> str | None:
        """The other input of a binary ``node`` whose one input is ``constant``."""
        a, b = str(node.input[0]), str(node.input[1])
        if _close(self.scalars.get(b), constant):
            return a
        if _close(self.scalars.get(a), constant):
            return b
        return None


def _cubic(graph: _Graph, inner: onnx.NodeProto) -> tuple[str, list[onnx.NodeProto]] | None:
    """``(x, [Pow, Mul])`` when ``inner`` is ``x + 0.044715 * x ** 3``."""
    for x, cubic_name in (inner.input, reversed(inner.input)):
        cubic = graph.op(cubic_name, "Mul")
        power_name = graph.split(cubic, 0.044715) if cubic is not None else None
        power = graph.op(power_name, "Pow") if power_name else None
        if (
            cubic is not None
            and power is not None
            and power.input[0] == x
            and _close(graph.scalars.get(power.input[1]), 3.0)
        ):
            return x, [power, cubic]
    return None


def _match(graph: _Graph, tanh: onnx.NodeProto) -> tuple[str, list[onnx.NodeProto]] | None:
    """``(x, the pattern's nodes, last one first)`` when ``tanh`` is the hand-written GELU's."""
    scaled = graph.op(tanh.input[0], "Mul")
    inner_name = graph.split(scaled, _SQRT_2_OVER_PI) if scaled is not None else None
    inner = graph.op(inner_name, "Add") if inner_name else None
    cubic = _cubic(graph, inner) if inner is not None else None
    if scaled is None or inner is None or cubic is None:
        return None
    x, first = cubic
    plus_one = graph.only_reader(tanh.output[0])
    if (
        plus_one is None
        or not is_standard(plus_one, "Add")
        or graph.split(plus_one, 1.0) != tanh.output[0]
    ):
        return None
    product = graph.only_reader(plus_one.output[0])
    if product is None or not is_standard(product, "Mul"):
        return None
    half_name = product.input[0] if product.input[1] == plus_one.output[0] else product.input[1]
    half = graph.op(half_name, "Mul")
    if half is None or graph.split(half, 0.5) != x:
        return None
    inside = [*first, inner, scaled, tanh, plus_one]
    if any(graph.only_reader(n.output[0]) is None for n in inside):
        return None
    dropped = [product, *reversed(inside)]
    if graph.only_reader(half.output[0]) is not None:
        dropped.append(half)
    return x, dropped


@graph_pass
def tanh_gelu_in_torch(model: onnx.ModelProto) -> bool:
    """Each hand-written tanh GELU (see the module docstring) as the ATen node ``ortfx_gelu``.
    Apply only when :func:`ortfx.aten.install` succeeded."""
    from ortfx import aten

    graph = _Graph(model)
    found = [m for n in model.graph.node if is_standard(n, "Tanh") and (m := _match(graph, n))]
    if not found:
        return False
    h = onnx.helper
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    types = {
        v.name: v.type.tensor_type
        for v in (*inferred.value_info, *inferred.input, *inferred.output)
    }
    found = [(x, nodes) for x, nodes in found if types.get(x) is not None and types[x].elem_type]
    if not found:
        return False
    code = h.make_tensor("ortfx_gelu_tanh", onnx.TensorProto.INT64, [], [1])
    model.graph.initializer.append(code)
    outputs = {o.name for o in model.graph.output}
    replacements: dict[int, list[onnx.NodeProto]] = {}
    dropped: set[int] = set()
    for x, nodes in found:
        product = nodes[0]
        out = product.output[0]
        tag = f"{product.name or out}_gelu"
        # ORT cannot infer an ATen node's output type: a graph output gets an Identity
        target = f"{tag}_out" if out in outputs else out
        gelu = h.make_node(
            "ATen", [x, code.name], [target], name=tag, domain=aten.DOMAIN,
            operator="ortfx_gelu", overload_name="",
        )  # fmt: skip
        replacements[id(product)] = [gelu]
        rank = len(types[x].shape.dim) if types[x].HasField("shape") else None
        model.graph.value_info.append(
            h.make_tensor_value_info(
                target, types[x].elem_type, None if rank is None else [None] * rank
            )
        )
        if target != out:
            replacements[id(product)].append(
                h.make_node("Identity", [target], [out], name=tag + "_output")
            )
        dropped.update(id(n) for n in nodes[1:])
    kept: list[onnx.NodeProto] = []
    constants: set[str] = set()  # the dropped nodes' constants
    for node in model.graph.node:
        if id(node) in replacements:
            kept.extend(replacements[id(node)])
            constants.update(i for i in node.input if i in graph.scalars)
        elif id(node) not in dropped:
            kept.append(node)
        else:
            constants.update(i for i in node.input if i in graph.scalars)
    # constants nothing reads any more go too (ORT warns about each unused one)
    read = {i for n in kept for i in n.input} | {o.name for o in model.graph.output}
    unused = constants - read
    kept = [n for n in kept if not (is_standard(n, "Constant") and n.output[0] in unused)]
    initializers = [t for t in model.graph.initializer if t.name not in unused]
    del model.graph.initializer[:]
    model.graph.initializer.extend(initializers)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    if not any(o.domain == aten.DOMAIN for o in model.opset_import):
        model.opset_import.append(h.make_opsetid(aten.DOMAIN, 1))
    return True
