"""``export_for_inference``: the one call, and the record it returns."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import attrs
import numpy as np
import torch

from ortfx import io
from ortfx.deploy import check, files, names, tracing
from ortfx.errors import OrtfxIOError, OrtfxTorchModelError
from ortfx.options import Options
from ortfx.runtime import logs
from ortfx.runtime.api import options_of
from ortfx.runtime.module import ORTModule
from ortfx.runtime.ort import require_ort
from ortfx.schema import ModelSchema, TensorSpec

# One call: positional args and keyword args.
Call: TypeAlias = tuple[tuple[Any, ...], dict[str, Any]]

CHECK_SCHEMA = (
    "{which} does not have the example's structure: given {given}, expected "
    "{expected}. The file serves calls of the example's structure, dtypes and ranks (and its "
    "Python values, which are baked in); pass inputs of that structure with other sizes."
)
NOT_A_MODULE = (
    "ortfx.export_for_inference expects a torch.nn.Module or an ortfx.ORTModule, got "
    "{type_name}. Pass the model object itself."
)
DYNAMIC_AXES_NEEDED = (
    "{which} has other sizes than the example, but dynamic_axes=False fixes "
    "every size: pass dynamic_axes=True (the default) or inputs of the example's sizes."
)
_log = logs.logger


@attrs.frozen
class InferenceExport:
    """What :func:`export_for_inference` wrote and how it was checked.

    ``inputs`` and ``outputs`` are the graph's names, in the order of the call's and the
    result's tensor leaves (outputs named ``updated.*`` after them: tensors the forward changes
    in place); ``max_differences`` is ``(output name, max |ORT - PyTorch|)`` over every checked
    call, for the written file and (``optimized_max_differences``) for the optimized one.
    """

    path: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    max_differences: tuple[tuple[str, float], ...]
    optimized_path: str | None
    seconds: float
    input_schema: ModelSchema = attrs.field(repr=False)
    output_schema: ModelSchema = attrs.field(repr=False)
    optimized_max_differences: tuple[tuple[str, float], ...] = ()

    @property
    def max_difference(self) -> float:
        """The largest difference over every output and checked call (both files)."""
        pairs = (*self.max_differences, *self.optimized_max_differences)
        return max((d for _, d in pairs), default=0.0)

    def feeds(self, *args: Any, **kwargs: Any) -> dict[str, np.ndarray[Any, Any]]:
        """The ``InferenceSession.run`` feeds for ``module(*args, **kwargs)``."""
        leaves = _like(self.input_schema, (tuple(args), dict(kwargs)), "the call to feeds()")
        return check.feeds(leaves, self.input_schema, self.inputs)

    def unflatten(self, outputs: Sequence[Any]) -> Any:
        """The module's result rebuilt from ``session.run(record.outputs, feeds)``: its
        containers (a ``ModelOutput``, a ``DynamicCache``) with torch tensors, and the Python
        values the graph holds as constants."""
        values = iter(outputs)
        leaves = [
            torch.as_tensor(next(values)) if isinstance(s, TensorSpec) else s.value
            for s in self.output_schema.leaves
        ]
        return io.unflatten(self.output_schema.treespec, leaves)


def export_for_inference(
    model: torch.nn.Module,
    example_inputs: Any,
    path: str | os.PathLike[str],
    /,
    kwargs: Mapping[str, Any] | None = None,
    *,
    check_inputs: Sequence[Any] = (),
    dynamic_axes: bool = True,
    optimize: bool = False,
    opset_version: int | None = None,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    external_data_threshold: int = files.EXTERNAL_DATA_ABOVE,
) -> InferenceExport:
    """Write ``model`` (an ``ORTModule`` or a plain module) in eval mode as an ONNX file at
    ``path`` and check it in a fresh ``onnxruntime.InferenceSession`` against the module's own
    eval outputs for ``model(*example_inputs, **kwargs)`` and each of ``check_inputs`` (a tuple
    of args, a dict of kwargs, or an ``(args, kwargs)`` pair); raise
    :class:`~ortfx.OrtfxVerificationError` above ``atol + rtol * |expected|``.

    Every dim of every input is dynamic unless ``dynamic_axes=False``. ``optimize``: ORT's
    extended graph optimizations written to ``<stem>.optimized.onnx`` beside it, checked the
    same way. Weights go to ``<file>.data`` when they are larger than
    ``external_data_threshold`` bytes (by default about protobuf's 2 GiB limit). The model, its
    modes, buffers and gradients, and the process's random streams are left as they were.
    """
    start = time.perf_counter()
    require_ort()
    if not isinstance(model, torch.nn.Module):
        raise OrtfxTorchModelError(NOT_A_MODULE.format(type_name=type(model).__qualname__))
    module = model.module if isinstance(model, ORTModule) else model
    target = os.path.abspath(os.fspath(path))
    if opset_version is None:  # the wrapper's own, as it trained (Options' default otherwise)
        opset_version = (options_of(model) if module is not model else Options()).opset_version
    example = _as_call(example_inputs, kwargs)
    leaves, schema = _schema_of(example)
    calls = [("the example inputs", leaves)]
    for index, item in enumerate(check_inputs):
        which = f"check_inputs[{index}]"
        check_leaves = _like(schema, _check_call(item), which)
        if not dynamic_axes and _sizes(check_leaves) != _sizes(leaves):
            raise OrtfxIOError(DYNAMIC_AXES_NEEDED.format(which=which))
        calls.append((which, check_leaves))
    name = type(module).__name__
    staging = tempfile.mkdtemp(prefix=".ortfx-deploy-", dir=os.path.dirname(target))
    try:
        with tracing.untouched(module):
            expected = [tracing.eager(module, call_leaves, schema) for _, call_leaves in calls]
            output_schema, updates = expected[0][1], expected[0][2]
            outputs = names.output_names(output_schema, updates, schema)
            axes = (
                names.dynamic_axes(schema, leaves, outputs, expected[0][0]) if dynamic_axes else {}
            )
            tracing.exported(module, leaves, schema, outputs, axes, opset_version, staging)
        written = os.path.join(staging, os.path.basename(target))
        inputs = files.write(
            written, staging, name, schema, output_schema, outputs, external_data_threshold
        )
        feeds = [(which, check.feeds(call_leaves, schema, inputs)) for which, call_leaves in calls]
        args = (name, feeds, [e[0] for e in expected], target, atol, rtol)
        differences = check.verify(written, *args)
        optimized = optimized_differences = None
        if optimize:
            optimized = check.optimized(written, name, target)
            optimized_differences = check.verify(optimized, *args)
        moved = files.move(staging, os.path.dirname(target))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    record = InferenceExport(
        path=target,
        inputs=inputs,
        outputs=outputs,
        max_differences=differences,
        optimized_path=moved.get(optimized) if optimized is not None else None,
        seconds=time.perf_counter() - start,
        input_schema=schema,
        output_schema=output_schema,
        optimized_max_differences=optimized_differences or (),
    )
    _log.info(
        "export_for_inference: %s -> %s%s, %d inputs, %d outputs, %d call(s) checked, "
        "max difference %.3g, %.2f s",
        name,
        target,
        f" (+ {record.optimized_path})" if record.optimized_path else "",
        len(inputs),
        len(outputs),
        len(calls),
        record.max_difference,
        record.seconds,
    )
    return record


# ---- the call ----------------------------------------------------------------------------------


def _as_call(example_inputs: Any, kwargs: Mapping[str, Any] | None) -> Call:
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    return args, dict(kwargs or {})


def _check_call(item: Any) -> Call:
    """A ``check_inputs`` item: an ``(args, kwargs)`` pair, a dict of kwargs or a tuple of args."""
    if (
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], tuple)
        and isinstance(item[1], dict)
    ):
        return item[0], dict(item[1])
    if isinstance(item, dict):
        return (), dict(item)
    return _as_call(item, None)


def _schema_of(call: Call) -> tuple[list[Any], ModelSchema]:
    leaves, spec = io.flatten(io.call_tree(*call))
    io.check_leaves(leaves, spec, root="call", where="input")
    return leaves, ModelSchema.from_flat(leaves, spec)


def _like(schema: ModelSchema, call: Call, which: str) -> list[Any]:
    """The leaves of ``call``, which must have ``schema`` (sizes may differ)."""
    leaves, given = _schema_of(call)
    if given != schema:
        raise OrtfxIOError(
            CHECK_SCHEMA.format(which=which, given=_render(given), expected=_render(schema))
        )
    return leaves


def _render(schema: ModelSchema) -> str:
    pairs = zip(schema.paths, schema.leaves, strict=True)
    return "{" + ", ".join(f"{p}: {s.render()}" for p, s in pairs) + "}"


def _sizes(leaves: Sequence[Any]) -> list[tuple[int, ...]]:
    return [tuple(x.shape) for x in leaves if isinstance(x, torch.Tensor)]
