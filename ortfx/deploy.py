"""Train, then deploy: a module written as one standard ONNX file for inference, checked in a
fresh ONNX Runtime session against the module's own eval outputs before it is handed back.

:func:`export_for_inference` is the one call. The file holds standard ONNX operators (and, where
ORT's optimizer puts them, its ``com.microsoft`` contrib operators), never ortfx's training-only
nodes (``PythonOp``, ``ATen``). Its inputs and outputs are the call's and the result's tensor
leaves, flattened as ortfx flattens a call (:mod:`ortfx.io`), named by their paths, and listed
with the call's structure in the model's ``metadata_props`` (key ``"ortfx"``, plain JSON).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, TypeAlias

import attrs
import numpy as np
import onnx
import torch

from ortfx import io
from ortfx.errors import (
    OrtfxExportError,
    OrtfxIOError,
    OrtfxUnsupportedOpError,
    OrtfxVerificationError,
)
from ortfx.export import exporters, rewrites, trace
from ortfx.model_info import Update
from ortfx.options import Options
from ortfx.runtime import logs
from ortfx.runtime.module import ORTModule
from ortfx.runtime.ort import ort, require_ort
from ortfx.schema import ModelSchema, StaticSpec, TensorSpec

# Domains a deployable graph may use: ONNX's and ORT's contrib operators.
STANDARD_DOMAINS: Final = frozenset({"", "ai.onnx", "com.microsoft"})
# Operators of an allowed domain that only ortfx's training runtime can run.
TRAINING_ONLY_OPS: Final = frozenset({"PythonOp", "PythonOpGrad"})
# protobuf cannot serialize a message of 2 GiB or more: weights beyond this go to a side file.
PROTOBUF_LIMIT: Final = 2**31 - 1
METADATA_KEY: Final = "ortfx"
_TRACED: Final = "traced"

# One call: positional args and keyword args.
Call: TypeAlias = tuple[tuple[Any, ...], dict[str, Any]]

NOT_STANDARD = (
    "the inference graph of {module} has operators outside ONNX and ORT's contrib domains, "
    "which a plain onnxruntime.InferenceSession cannot run: {ops}. {fix}"
)
FUNCTION_FIX = (
    "Give the custom autograd.Function {function} a `symbolic` staticmethod that writes it in "
    "standard ONNX operators, or compute it in torch outside the exported module."
)
OPS_FIX = (
    "Write these in standard ONNX operators (a custom symbolic), or compute them in torch "
    "outside the exported module."
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
    "file cannot hold)."
)
MISMATCH = (
    "ONNX Runtime's outputs of {path} differ from {module}'s own PyTorch eval outputs for "
    "{which}: {details} (tolerance: |difference| <= {atol:g} + {rtol:g} * |expected|). Nothing "
    "was written to {target}. If the differences are rounding, pass a larger atol/rtol; if "
    "they are not, the trace did not capture the forward (a branch or a value taken from a "
    "tensor): check the export's warnings."
)
CHECK_SCHEMA = (
    "check_inputs[{index}] does not have the example's structure: given {given}, expected "
    "{expected}. The file serves calls of the example's structure, dtypes and ranks (and its "
    "Python values, which are baked in); pass inputs of that structure with other sizes."
)
RUN_FAILED = (
    "ONNX Runtime could not run the file written for {module} on {which}: {error}. "
    "Nothing was written to {target}."
)
DYNAMIC_AXES_NEEDED = (
    "check_inputs[{index}] has other sizes than the example, but dynamic_axes=False fixes "
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
        leaves, schema = _schema_of((tuple(args), dict(kwargs)))
        if schema != self.input_schema:
            raise OrtfxIOError(
                CHECK_SCHEMA.format(
                    index="feeds", given=_render(schema), expected=_render(self.input_schema)
                )
            )
        tensors = [leaves[i] for i in schema.tensor_indices()]
        return {
            name: _numpy(t)
            for name, t in zip(_tensor_names(schema), tensors, strict=True)
            if name in self.inputs
        }

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
    example_inputs: Any = (),
    path: str | os.PathLike[str] = "model.onnx",
    /,
    kwargs: Mapping[str, Any] | None = None,
    *,
    check_inputs: Sequence[Any] = (),
    dynamic_axes: bool = True,
    optimize: bool = False,
    opset_version: int | None = None,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    external_data_threshold: int = PROTOBUF_LIMIT,
) -> InferenceExport:
    """Write ``model`` (an ``ORTModule`` or a plain module) in eval mode as an ONNX file at
    ``path`` and check it in a fresh ``onnxruntime.InferenceSession`` against the module's own
    eval outputs for ``model(*example_inputs, **kwargs)`` and each of ``check_inputs`` (a tuple
    of args, a dict of kwargs, or an ``(args, kwargs)`` pair); raise
    :class:`~ortfx.OrtfxVerificationError` above ``atol + rtol * |expected|``.

    Every dim of every input is dynamic unless ``dynamic_axes=False``. ``optimize``: ORT's
    extended graph optimizations written to ``<stem>.optimized.onnx`` beside it, checked the
    same way. Weights go to ``<file>.data`` when the model is larger than
    ``external_data_threshold`` bytes (protobuf's 2 GiB limit by default). The model, its modes,
    buffers and gradients, and the process's random streams are left as they were.
    """
    start = time.perf_counter()
    require_ort()
    module = model.module if isinstance(model, ORTModule) else model
    target = os.path.abspath(os.fspath(path))
    opset = Options().opset_version if opset_version is None else opset_version
    example = _as_call(example_inputs, kwargs)
    leaves, schema = _schema_of(example)
    checks = []
    for index, item in enumerate(check_inputs):
        check_leaves, check_schema = _schema_of(_check_call(item))
        if check_schema != schema:
            raise OrtfxIOError(
                CHECK_SCHEMA.format(
                    index=index, given=_render(check_schema), expected=_render(schema)
                )
            )
        if not dynamic_axes and _sizes(check_leaves) != _sizes(leaves):
            raise OrtfxIOError(DYNAMIC_AXES_NEEDED.format(index=index))
        checks.append((f"check_inputs[{index}]", check_leaves))
    calls = [("the example inputs", leaves), *checks]
    name = type(module).__name__
    staging = tempfile.mkdtemp(prefix=".ortfx-deploy-", dir=os.path.dirname(target))
    try:
        with _untouched(module):
            expected = [_eager(module, call_leaves, schema) for _, call_leaves in calls]
            output_schema, updates = expected[0][1], expected[0][2]
            outputs = _output_names(output_schema, updates, schema)
            axes = _dynamic_axes(schema, leaves, outputs, expected[0][0]) if dynamic_axes else {}
            _exported(module, leaves, schema, outputs, axes, opset, staging)
        written = os.path.join(staging, os.path.basename(target))
        inputs = _write(
            written, staging, name, schema, output_schema, outputs, external_data_threshold
        )
        feeds = [(which, _feeds(call_leaves, schema, inputs)) for which, call_leaves in calls]
        args = (name, feeds, [e[0] for e in expected], target, atol, rtol)
        differences = _verify(written, *args)
        optimized = optimized_differences = None
        if optimize:
            optimized = _optimized(written)
            optimized_differences = _verify(optimized, *args)
        moved = _move(staging, os.path.dirname(target))
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


def _render(schema: ModelSchema) -> str:
    pairs = zip(schema.paths, schema.leaves, strict=True)
    return "{" + ", ".join(f"{p}: {s.render()}" for p, s in pairs) + "}"


def _sizes(leaves: Sequence[Any]) -> list[tuple[int, ...]]:
    return [tuple(x.shape) for x in leaves if isinstance(x, torch.Tensor)]


def _numpy(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    array: np.ndarray[Any, Any] = tensor.detach().cpu().numpy()
    return array


# ---- names -------------------------------------------------------------------------------------


def _name(accessor: Any, *, call: bool) -> str:
    """A graph name from a leaf's path: ``kwargs['input_ids']`` -> ``input_ids``,
    ``args[0]`` -> ``input_0``, ``output.logits`` -> ``logits``, ``output[1]`` -> ``output_1``,
    ``output.past_key_values.layers[0].keys`` -> ``past_key_values.layers.0.keys``."""
    entries = [e.entry for e in accessor]
    if call:
        head, entries = ("input" if entries[0] == 0 else None), entries[1:]
    else:
        head = "output"
    if not entries:
        return head or "input"
    first, rest = entries[0], entries[1:]
    text = f"{head}_{first}" if isinstance(first, int) and head else str(first)
    return re.sub(r"[^0-9A-Za-z_.]+", "_", ".".join([text, *map(str, rest)]))


def _unique(name: str, taken: set[str]) -> str:
    unique, n = name, 1
    while unique in taken:
        unique, n = f"{name}_{n}", n + 1
    taken.add(unique)
    return unique


def _tensor_names(schema: ModelSchema) -> tuple[str, ...]:
    """The graph name of each tensor leaf of the call, in flat order."""
    accessors = schema.treespec.accessors()
    taken: set[str] = set()
    return tuple(_unique(_name(accessors[i], call=True), taken) for i in schema.tensor_indices())


def _output_names(
    output_schema: ModelSchema, updates: Sequence[Update], schema: ModelSchema
) -> tuple[str, ...]:
    """The graph name of each output: the result's tensors (one named like an input, a cache
    returned updated, is ``present.<name>``), then ``updated.<input or buffer>`` for each
    tensor the forward changed in place."""
    inputs = _tensor_names(schema)
    taken = set(inputs)
    accessors = output_schema.treespec.accessors()
    names = []
    for i in output_schema.tensor_indices():
        name = _name(accessors[i], call=False)
        names.append(_unique(f"present.{name}" if name in inputs else name, taken))
    positions = schema.tensor_indices()
    for u in updates:
        source = inputs[positions.index(int(u.target))] if u.kind == "input" else str(u.target)
        names.append(_unique(f"updated.{source}", taken))
    return tuple(names)


def _dynamic_axes(
    schema: ModelSchema,
    leaves: Sequence[Any],
    outputs: tuple[str, ...],
    expected: Sequence[np.ndarray[Any, Any]],
) -> dict[str, dict[int, str]]:
    """Every dim of every input and output dynamic, each its own symbol."""
    ranks = [leaves[i].dim() for i in schema.tensor_indices()] + [a.ndim for a in expected]
    names = [*_tensor_names(schema), *outputs]
    return {n: {d: f"{n}_dim{d}" for d in range(r)} for n, r in zip(names, ranks, strict=True)}


# ---- eager reference and export -----------------------------------------------------------------


@contextlib.contextmanager
def _untouched(module: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no grad for the block; afterwards every submodule's train/eval flag, the
    buffers and the random streams are what they were. One of ortfx's exports at a time (a
    wrapper inside the module runs as plain code, so the graph takes it in)."""
    modes = [(m, m.training) for m in module.modules()]
    try:
        with (
            trace.one_export_at_a_time(),
            rewrites.preserved_random_state(module),
            rewrites.state_preserved(module),
            torch.no_grad(),
        ):
            module.eval()
            yield
    finally:
        for m, training in modes:
            m.training = training


def _eager(
    module: torch.nn.Module, leaves: Sequence[Any], schema: ModelSchema
) -> tuple[list[np.ndarray[Any, Any]], ModelSchema, tuple[Update, ...]]:
    """The module's flat outputs for one call (the tensors it changes in place after its
    outputs, as the graph returns them), run on copies; its output schema and those changes."""
    flat = trace.FlatCall(module, leaves, schema)
    copies = tuple(leaves[i].detach().clone() for i in schema.tensor_indices())
    with rewrites.preserved_random_state(module), rewrites.state_preserved(module):
        out = flat(*copies)
        arrays = [_numpy(t).copy() for t in out]  # before the buffers are put back
    assert flat.output_schema is not None
    return arrays, flat.output_schema, flat.updates


def _exported(
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
    inputs = _tensor_names(schema)
    tensors = tuple(leaves[i].detach().clone() for i in schema.tensor_indices())
    file = _traced(staging)
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
                    error=_first_line(again),
                ),
                op="PythonOp",
            ) from again
        _log.info(
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


def _traced(staging: str) -> str:
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

    with exporters.quiet(), _torch.symbolics_registered(symbolics.standard(opset)):
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


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _export_failed(module: torch.nn.Module, error: Exception) -> OrtfxExportError:
    return OrtfxExportError(
        EXPORT_FAILED.format(
            module=type(module).__name__, error_type=type(error).__name__, error=_first_line(error)
        )
    )


# ---- the file ----------------------------------------------------------------------------------


def _nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph`` and of its subgraphs (If and Loop bodies)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(attribute.g)
            for sub in attribute.graphs:
                yield from _nodes(sub)


def _check_domains(model: onnx.ModelProto, module: str) -> None:
    """Refuse a node outside ONNX and ORT's contrib domains, and ortfx's training-only ones."""
    refused = [
        n
        for n in _nodes(model.graph)
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
        if attribute.name in ("func_name", "name") and attribute.type == onnx.AttributeProto.STRING:
            return f" ({attribute.s.decode()})"
    return ""


def _write(
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
    model = onnx.load(_traced(staging))  # with the side files torch writes above 2 GiB
    _check_domains(model, module)
    inputs = tuple(i.name for i in model.graph.input)
    metadata = _metadata(set(inputs), schema, output_schema, outputs)
    model.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value=metadata))
    _save(model, file, threshold)
    return inputs


def _metadata(
    present: set[str],
    schema: ModelSchema,
    output_schema: ModelSchema,
    outputs: tuple[str, ...],
) -> str:
    """The call's and the result's structure, as JSON: each graph input (of ``present``) and
    output with its path, dtype and rank, and the Python values the graph holds as constants
    (a call must pass the same)."""
    count = len(output_schema.tensor_indices())

    def listed(s: ModelSchema, names: Sequence[str], keep: set[str] | None) -> Any:
        tensors = [(p, spec) for p, spec in zip(s.paths, s.leaves, strict=True)]
        pairs = [(p, spec) for p, spec in tensors if isinstance(spec, TensorSpec)]
        return [
            {
                "name": n,
                "path": p,
                "dtype": str(spec.dtype).removeprefix("torch."),
                "rank": spec.rank,
            }
            for n, (p, spec) in zip(names, pairs, strict=True)
            if keep is None or n in keep
        ]

    def statics(s: ModelSchema) -> Any:
        return [
            {"path": p, "value": spec.value}
            for p, spec in zip(s.paths, s.leaves, strict=True)
            if isinstance(spec, StaticSpec)
        ]

    data = {
        "inputs": listed(schema, _tensor_names(schema), present),
        "static_inputs": statics(schema),
        "outputs": listed(output_schema, outputs[:count], None),
        "updated": list(outputs[count:]),
        "static_outputs": statics(output_schema),
    }
    return json.dumps(data)


def _weight_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) or t.ByteSize() for t in model.graph.initializer)


def _save(model: onnx.ModelProto, file: str, threshold: int) -> None:
    """Write ``model`` to ``file``; its weights to ``<file>.data`` beside it when the model is
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


def _optimized(written: str) -> str:
    """ORT's extended graph optimizations of ``written``, saved beside it."""
    stem = os.path.basename(written).removesuffix(".onnx")
    file = os.path.join(os.path.dirname(written), stem + ".optimized.onnx")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = file
    if os.path.exists(written + ".data"):
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name",
            os.path.basename(file) + ".data",
        )
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
        )
    ort.InferenceSession(written, options, providers=["CPUExecutionProvider"])
    return file


def _feeds(
    leaves: Sequence[Any], schema: ModelSchema, inputs: tuple[str, ...]
) -> dict[str, np.ndarray[Any, Any]]:
    tensors = [leaves[i] for i in schema.tensor_indices()]
    pairs = zip(_tensor_names(schema), tensors, strict=True)
    return {n: _numpy(t) for n, t in pairs if n in inputs}


def _verify(
    file: str,
    module: str,
    feeds: Sequence[tuple[str, dict[str, np.ndarray[Any, Any]]]],
    expected: Sequence[Sequence[np.ndarray[Any, Any]]],
    target: str,
    atol: float,
    rtol: float,
) -> tuple[tuple[str, float], ...]:
    """Run ``file`` in a fresh CPU session on each call's feeds; per output, the largest
    difference from PyTorch's; raise :class:`OrtfxVerificationError` beyond the tolerance."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(file, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    worst = dict.fromkeys(names, 0.0)
    for (which, feed), reference in zip(feeds, expected, strict=True):
        try:
            got = session.run(names, feed)
        except Exception as e:
            raise OrtfxVerificationError(
                RUN_FAILED.format(module=module, which=which, error=_first_line(e), target=target)
            ) from e
        bad = []
        for name, actual, wanted in zip(names, got, reference, strict=True):
            difference, within = _compare(np.asarray(actual), wanted, atol, rtol)
            worst[name] = max(worst[name], difference)
            if not within:
                bad.append(f"{name}: max |difference| {difference:.3g}")
        if bad:
            raise OrtfxVerificationError(
                MISMATCH.format(
                    path=os.path.basename(file),
                    module=module,
                    which=which,
                    details="; ".join(bad),
                    atol=atol,
                    rtol=rtol,
                    target=target,
                )
            )
    return tuple(worst.items())


def _compare(
    actual: np.ndarray[Any, Any], wanted: np.ndarray[Any, Any], atol: float, rtol: float
) -> tuple[float, bool]:
    """The largest ``|actual - wanted|`` (inf for other shapes, or NaN against a number) and
    whether every element is within ``atol + rtol * |wanted|``."""
    if actual.shape != wanted.shape:
        return float("inf"), False
    if actual.size == 0:
        return 0.0, True
    a, w = actual.astype(np.float64), wanted.astype(np.float64)
    both_nan = np.isnan(a) & np.isnan(w)
    same = (a == w) | both_nan  # equal infinities too
    difference = np.where(same, 0.0, np.abs(a - w))
    difference = np.where(np.isnan(difference), np.inf, difference)
    return float(difference.max()), bool((difference <= atol + rtol * np.abs(w)).all())


def _move(staging: str, directory: str) -> dict[str, str]:
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
