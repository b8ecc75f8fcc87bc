"""The inference file: refused for non-standard operators, written with its metadata (and its
weights beside it when large), checked by ONNX's checker, moved into place once verified."""

from __future__ import annotations

import os
from typing import Final

import onnx

from ortfx.deploy import names, tracing
from ortfx.deploy.tracing import FUNCTION_FIX, first_line
from ortfx.errors import OrtfxExportError, OrtfxUnsupportedOpError
from ortfx.passes.core import all_nodes
from ortfx.schema import ModelSchema

# Domains a deployable graph may use: ONNX's and ORT's contrib operators.
STANDARD_DOMAINS: Final = frozenset({"", "ai.onnx", "com.microsoft"})
# Operators of an allowed domain that only ortfx's training runtime can run.
TRAINING_ONLY_OPS: Final = frozenset({"PythonOp", "PythonOpGrad"})
# protobuf cannot serialize a message of 2 GiB or more: weights beyond this (2 GiB less room for
# the graph itself) go to a side file.
EXTERNAL_DATA_ABOVE: Final = 2**31 - 2**26
METADATA_KEY: Final = "ortfx"

NOT_STANDARD = (
    "the inference graph of {module} has operators outside ONNX and ORT's contrib domains, "
    "which a plain onnxruntime.InferenceSession cannot run: {ops}. {fix}"
)
OPS_FIX = (
    "Write these in standard ONNX operators (a custom symbolic), or compute them in torch "
    "outside the exported module."
)
INVALID = (
    "the inference graph of {module} is not a valid ONNX model: {error}. This is a bug of "
    "the exporter or of ortfx; please report it."
)


def _check_domains(model: onnx.ModelProto, module: str) -> None:
    """Refuse a node outside ONNX and ORT's contrib domains, and ortfx's training-only ones."""
    refused = [
        n
        for n in all_nodes(model.graph)
        if n.domain not in STANDARD_DOMAINS or n.op_type in TRAINING_ONLY_OPS
    ]
    if not refused:
        return
    ops = ", ".join(
        sorted({f"{n.domain or 'ai.onnx'}::{n.op_type}{_function_of(n)}" for n in refused})
    )
    functions = sorted({f for n in refused if (f := _function_of(n))})
    fix = FUNCTION_FIX.format(function=", ".join(functions).strip(" ()")) if functions else OPS_FIX
    first = refused[0]
    raise OrtfxUnsupportedOpError(
        NOT_STANDARD.format(module=module, ops=ops, fix=fix), op=first.op_type, node=first.name
    )


def _function_of(node: onnx.NodeProto) -> str:
    """`` (Function Name)`` for a PythonOp node, else ``""``."""
    for attribute in node.attribute:
        if attribute.name == "func_name" and attribute.type == onnx.AttributeProto.STRING:
            return f" ({attribute.s.decode()})"
    return ""


def write(
    file: str,
    staging: str,
    module: str,
    schema: ModelSchema,
    output_schema: ModelSchema,
    outputs: tuple[str, ...],
    threshold: int,
) -> tuple[str, ...]:
    """The traced graph checked for its domains and written to ``file`` with its metadata;
    its input names. (The model, a few GB for a large one, lives only here.)"""
    model = onnx.load(tracing.traced(staging))  # with the side files torch writes above 2 GiB
    _check_domains(model, module)
    inputs = tuple(i.name for i in model.graph.input)
    metadata = names.metadata(set(inputs), schema, output_schema, outputs)
    model.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value=metadata))
    _save(model, file, threshold)
    del model
    try:
        onnx.checker.check_model(file)  # from the path: a model over 2 GiB included
    except onnx.checker.ValidationError as e:
        raise OrtfxExportError(INVALID.format(module=module, error=first_line(e))) from e
    return inputs


def _weight_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer)


def _save(model: onnx.ModelProto, file: str, threshold: int) -> None:
    """Write ``model`` to ``file``; its weights to ``<file>.data`` beside it when they are
    larger than ``threshold`` bytes."""
    external = _weight_bytes(model) > threshold
    onnx.save_model(
        model,
        file,
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location=os.path.basename(file) + ".data",
        size_threshold=0 if threshold < 1024 else 1024,
    )


def move(staging: str, directory: str) -> dict[str, str]:
    """Every file of ``staging`` moved into ``directory`` (replacing files of the same name);
    staging path -> final path."""
    moved = {}
    for entry in sorted(os.listdir(staging)):
        source = os.path.join(staging, entry)
        if os.path.isdir(source):  # the traced file and its side files
            continue
        destination = os.path.join(directory, entry)
        os.replace(source, destination)
        moved[source] = destination
    return moved
