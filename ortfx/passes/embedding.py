"""Embeddings keep PyTorch's ``padding_idx``: no gradient reaches the padding row."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import onnx

from ortfx.errors import OrtfxExportError
from ortfx.model_info import InputKind, InputSpec, PostExportProcessedModelInfo
from ortfx.passes.core import Pass, is_standard

PADDED_GATHER = "PaddedGather"  # ortfx.symbolics marks F.embedding(padding_idx=...) with it
PADDED_GATHER_DOMAIN = "ortfx"
PADDING_ON_COMPUTED_WEIGHT = (
    "F.embedding with padding_idx={index} reads a weight computed in the forward ({weight}), not a "
    "parameter: ortfx keeps a padding row out of the gradient only for parameters. Embed from "
    "a parameter (nn.Embedding), or let ortfx fall back to PyTorch."
)


def _padded_gather(
    h: Any, weight: str, frozen: str, ids: str, out: str, index: int, tag: str
) -> list[onnx.NodeProto]:
    """``out = weight[ids]``, taken from ``frozen`` (same values, no gradient) where
    ``ids == index``."""
    i64 = onnx.TensorProto.INT64
    return [
        h.make_node("Gather", [weight, ids], [f"{tag}_trained"], name=f"{tag}_g"),
        h.make_node("Gather", [frozen, ids], [f"{tag}_kept"], name=f"{tag}_k"),
        h.make_node(
            "Constant",
            [],
            [f"{tag}_idx"],
            name=f"{tag}_c",
            value=h.make_tensor(f"{tag}_idx", i64, [], [index]),
        ),
        h.make_node("Cast", [ids], [f"{tag}_ids"], name=f"{tag}_cast", to=i64),
        h.make_node("Equal", [f"{tag}_ids", f"{tag}_idx"], [f"{tag}_is_pad"], name=f"{tag}_eq"),
        h.make_node(
            "Constant",
            [],
            [f"{tag}_axes"],
            name=f"{tag}_a",
            value=h.make_tensor(f"{tag}_axes", i64, [1], [-1]),
        ),
        h.make_node(
            "Unsqueeze", [f"{tag}_is_pad", f"{tag}_axes"], [f"{tag}_mask"], name=f"{tag}_u"
        ),
        h.make_node(
            "Where", [f"{tag}_mask", f"{tag}_kept", f"{tag}_trained"], [out], name=f"{tag}_w"
        ),
    ]


def embedding_padding(padding: Mapping[str, int]) -> Pass:
    """Keep PyTorch's ``padding_idx`` semantics: no gradient reaches an embedding's padding row.

    The exported ``Gather`` forgets ``padding_idx``. At padding positions the result is taken from
    a second, non-trainable feed of the same weight (an ``INTERNAL`` input), so the values are
    identical and ORT's gradient skips exactly those positions. The embeddings are found two
    ways: ``padding`` maps the parameter names of ``nn.Embedding`` modules to their
    ``padding_idx`` (any exporter), and the TorchScript export marks every
    ``F.embedding(..., padding_idx=...)``, functional calls included, as ``ortfx::PaddedGather``.
    """

    def run(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
        params = {spec.name: spec for spec in info.inputs if spec.kind is InputKind.PARAMETER}
        named = {n: spec for n, spec in params.items() if spec.source in padding}
        model = onnx.load_model_from_string(info.model)
        marked = [n for n in model.graph.node if n.op_type == PADDED_GATHER]
        if not (named or marked):
            return info
        values = {v.name: v for v in model.graph.input}
        added: list[InputSpec] = []
        nodes: list[onnx.NodeProto] = []
        h = onnx.helper
        for node in model.graph.node:
            if node.op_type == PADDED_GATHER and node.domain == PADDED_GATHER_DOMAIN:
                index = next(a.i for a in node.attribute if a.name == "padding_idx")
                spec = params.get(node.input[0])
                if spec is None:
                    raise OrtfxExportError(
                        PADDING_ON_COMPUTED_WEIGHT.format(index=index, weight=node.input[0])
                    )
            else:
                spec = named.get(node.input[0]) if is_standard(node, "Gather") else None
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                if spec is None or axis != 0:
                    nodes.append(node)
                    continue
                index = padding[str(spec.source)]
            frozen = f"{spec.name}__no_grad"
            if frozen not in values:
                value = onnx.ValueInfoProto()
                value.CopyFrom(values[spec.name])
                value.name = frozen
                values[frozen] = value
                model.graph.input.append(value)
                added.append(InputSpec(frozen, InputKind.INTERNAL, spec.source))
            tag = f"ortfx_pad_{len(nodes)}"
            nodes += _padded_gather(h, spec.name, frozen, node.input[1], node.output[0], index, tag)
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        # The exporter gave a PaddedGather's output fresh symbolic sizes of its own; left in
        # place they contradict the ids' sizes the Gather now infers, and ORT's gradient
        # builder then knows no shape for what the output meets (a broadcasting Mul fails).
        outputs = {n.output[0] for n in marked}
        kept = [v for v in model.graph.value_info if v.name not in outputs]
        if len(kept) != len(model.graph.value_info):
            del model.graph.value_info[:]
            model.graph.value_info.extend(kept)
        return attrs.evolve(info, model=model.SerializeToString(), inputs=(*info.inputs, *added))

    return run
