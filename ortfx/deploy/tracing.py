"""The module in eval mode: its eager outputs for reference, and its trace as an ONNX file.

Both run under :func:`untouched`, which puts back everything the runs could change.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any, Final

import numpy as np
import onnx
import torch

from ortfx.deploy.names import tensor_names
from ortfx.errors import OrtfxExportError, OrtfxUnsupportedOpError
from ortfx.export import exporters, restore, rewrites, trace
from ortfx.model_info import Update
from ortfx.runtime import logs
from ortfx.schema import ModelSchema

_TRACED: Final = "traced"

FUNCTION_FIX = (
    "Give the custom autograd.Function {function} a `symbolic` staticmethod that writes it in "
    "standard ONNX operators, or compute it in torch outside the exported module."
)
FUNCTION_NOT_EXPRESSIBLE = (
    "the custom autograd.Function {function} of {module} has no `symbolic` staticmethod, and "
    "its forward could not be traced into standard ONNX operators either: {error_type}: "
    "{error}. " + FUNCTION_FIX
)
EXPORT_FAILED = (
    "exporting {module} for inference with the TorchScript exporter failed: {error_type}: "
    "{error}. The module's forward must be traceable with the example inputs (ortfx's training "
    "exports run ops torch cannot write in ONNX as ATen or PythonOp nodes, which an inference "
    "file cannot hold).{hint}"
)
# Ops the exporter cannot write, with the way around them a user has.
HINTS = {
    ("aten::histc", "aten::_grouped_mm"): (
        " transformers' default mixture-of-experts layers (grouped_mm experts) count tokens "
        "with histc and multiply with torch._grouped_mm; call "
        "model.set_experts_implementation('batched_mm') before exporting (the same arithmetic "
        "in standard ONNX operators; switch back afterwards for training)."
    ),
}


@contextlib.contextmanager
def untouched(module: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no grad for the block; afterwards every submodule's train/eval flag, the
    buffers and the random streams are what they were. One of ortfx's exports at a time (a
    wrapper inside the module runs as plain code, so the graph takes it in). Outside
    ``torch.inference_mode()``: the tracer cannot record inference tensors, and the runs take
    normal copies of the caller's."""
    modes = [(m, m.training) for m in module.modules()]
    try:
        with (
            torch.inference_mode(False),
            trace.one_export_at_a_time(),
            rewrites.preserved_random_state(module),
            restore.state_preserved(module),
            torch.no_grad(),
        ):
            module.eval()
            yield
    finally:
        for m, training in modes:
            m.training = training


def eager(
    module: torch.nn.Module, leaves: Sequence[Any], schema: ModelSchema
) -> tuple[list[np.ndarray[Any, Any]], ModelSchema, tuple[Update, ...]]:
    """The module's flat outputs for one call (the tensors it changes in place after its
    outputs, as the graph returns them), run on copies; its output schema and those changes."""
    flat = trace.FlatCall(module, leaves, schema)
    copies = tuple(leaves[i].detach().clone() for i in schema.tensor_indices())
    with rewrites.preserved_random_state(module), restore.state_preserved(module):
        out = flat(*copies)
        arrays = [numpy(t).copy() for t in out]  # before the buffers are put back
    assert flat.output_schema is not None
    return arrays, flat.output_schema, flat.updates


def exported(
    module: torch.nn.Module,
    leaves: Sequence[Any],
    schema: ModelSchema,
    outputs: tuple[str, ...],
    axes: dict[str, dict[int, str]],
    opset: int,
    staging: str,
) -> None:
    """The module traced in eval mode into ``staging`` with the TorchScript exporter: weights
    as initializers, constants folded, ortfx's standard-ONNX symbolics only. A custom
    autograd.Function without a ``symbolic`` has its forward traced into the graph (inference
    never runs its backward); one whose forward cannot be traced either is named in the error."""
    inputs = tensor_names(schema)
    tensors = tuple(leaves[i].detach().clone() for i in schema.tensor_indices())
    file = traced(staging)
    os.mkdir(os.path.dirname(file))

    def run(inline: bool) -> None:
        flat = trace.FlatCall(module, leaves, schema)
        _torchscript(flat, tensors, file, opset, inputs, outputs, axes, inline=inline)

    try:
        run(inline=False)
    except Exception as e:
        found = re.search(r"Couldn't export Python operator (\S+)", str(e))
        if found is None:
            raise _export_failed(module, e) from e
        try:
            run(inline=True)
        except Exception as again:
            raise OrtfxUnsupportedOpError(
                FUNCTION_NOT_EXPRESSIBLE.format(
                    function=found.group(1),
                    module=type(module).__name__,
                    error_type=type(again).__name__,
                    error=first_line(again),
                ),
                op="PythonOp",
            ) from again
        logs.logger.info(
            "export_for_inference: the custom autograd.Function %s has no symbolic; its "
            "forward was traced into the graph (checked against PyTorch below)",
            found.group(1),
        )
    written = [o.name for o in onnx.load(file, load_external_data=False).graph.output]
    if written != list(outputs):
        raise OrtfxExportError(
            f"the inference graph of {type(module).__name__} has outputs {written}, but the "
            f"module returned {list(outputs)}; this is an ortfx bug, please report it."
        )


def traced(staging: str) -> str:
    """Where the exporter writes, in a directory of its own: for a model over 2 GiB torch
    writes a side file per weight."""
    return os.path.join(staging, _TRACED, "model.onnx")


def _torchscript(
    flat: trace.FlatCall,
    tensors: tuple[torch.Tensor, ...],
    file: str,
    opset: int,
    inputs: tuple[str, ...],
    outputs: tuple[str, ...],
    axes: dict[str, dict[int, str]],
    *,
    inline: bool,
) -> None:
    from ortfx import _torch
    from ortfx.export import symbolics  # imports torch's TorchScript exporter

    with (
        exporters.quiet(),
        _torch.symbolics_registered(symbolics.standard(opset)),
        _torch.shape_inference_without_weights(),  # no two copies of every weight (issue 31)
    ):
        torch.onnx.export(
            flat,
            tensors,
            file,
            dynamo=False,
            export_params=True,
            do_constant_folding=True,
            keep_initializers_as_inputs=False,
            opset_version=opset,
            training=torch.onnx.TrainingMode.EVAL,
            input_names=list(inputs),
            output_names=list(outputs),
            dynamic_axes=axes or None,
            autograd_inlining=inline,
        )


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _export_failed(module: torch.nn.Module, error: Exception) -> OrtfxExportError:
    text = first_line(error)
    hint = "".join(h for ops, h in HINTS.items() if any(op in str(error) for op in ops))
    return OrtfxExportError(
        EXPORT_FAILED.format(
            module=type(module).__name__, error_type=type(error).__name__, error=text, hint=hint
        )
    )


def numpy(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    array: np.ndarray[Any, Any] = tensor.detach().cpu().numpy()
    return array
