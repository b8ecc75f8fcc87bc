"""The ONNX Runtime driver: gradient-graph build, sessions, and tensor crossing through DLPack.

Only this module (and nothing in the pure core) imports onnxruntime.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import attrs
import onnx
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack  # type: ignore[attr-defined]

from ortfx import aten
from ortfx._torch import engine_accumulates
from ortfx.errors import (
    CUDA_PROVIDER_MISSING,
    EMPTY_TENSOR_TRAINING,
    NOT_FLOAT32,
    ORT_MISSING,
    UNSUPPORTED_LAYOUT,
    UNSUPPORTED_OP,
    OrtfxDeviceError,
    OrtfxEmptyTensorError,
    OrtfxError,
    OrtfxInitError,
    OrtfxIOError,
    OrtfxRuntimeError,
    OrtfxUnsupportedOpError,
)
from ortfx.function_names import pythonop_functions
from ortfx.model_info import InputKind, PostExportProcessedModelInfo
from ortfx.options import Options
from ortfx.runtime import arena, events, memgrad, openmp, pythonop


class _WithoutFrontEnd(importlib.abc.MetaPathFinder):
    """Refuses ``onnxruntime.training`` while ``import onnxruntime`` runs.

    The training wheel's package ``__init__`` imports upstream's ORTModule front end only to
    find out whether it is there (``onnxruntime_validation``). That pulls in DeepSpeed, sympy
    and pydantic: about 1 s of import and 90 MB of resident memory, for code ortfx never calls
    (the C++ training layer is in ``_pybind_state``), and it replaces ``torch.manual_seed``.
    The package handles an ImportError there by design; the finder is removed right after, so
    a user's own ``import onnxruntime.training`` works as usual.
    """

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "onnxruntime.training" or name.startswith("onnxruntime.training."):
            raise ImportError(f"{name} is not imported by ortfx", name=name)
        return None


def _import_onnxruntime() -> tuple[Any, Any]:
    finder = None if "onnxruntime" in sys.modules else _WithoutFrontEnd()
    if finder is not None:
        sys.meta_path.insert(0, finder)
    try:
        import onnxruntime
        from onnxruntime.capi import _pybind_state
    finally:
        if finder is not None:
            sys.meta_path.remove(finder)
    return onnxruntime, _pybind_state


try:
    ort, C = _import_onnxruntime()
    _IMPORT_ERROR: Exception | None = None
except Exception as e:  # pragma: no cover - exercised only without the wheel
    ort = C = None
    _IMPORT_ERROR = e


def require_ort() -> None:
    if _IMPORT_ERROR is not None:
        raise OrtfxInitError(ORT_MISSING.format(error=_IMPORT_ERROR))


@attrs.frozen
class Timings:
    """One-time costs, in seconds, for the log line and for users."""

    export: float = 0.0
    gradient_build: float = 0.0
    session: float = 0.0

    def render(self) -> str:
        parts = [f"{k.replace('_', ' ')} {v:.3f} s" for k, v in attrs.asdict(self).items() if v]
        return ", ".join(parts) or "no one-time cost"


def _providers(device: torch.device) -> tuple[list[Any], Any]:
    """Execution providers and the OrtDevice for ``device``."""
    if device.type == "cpu":
        return ["CPUExecutionProvider"], C.OrtDevice(
            C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0
        )
    if device.type == "cuda":
        available = ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            raise OrtfxDeviceError(
                CUDA_PROVIDER_MISSING.format(device=device, providers=", ".join(available))
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        return (
            [("CUDAExecutionProvider", {"device_id": str(index)}), "CPUExecutionProvider"],
            C.OrtDevice(C.OrtDevice.cuda(), C.OrtDevice.default_memory(), index),
        )
    raise OrtfxDeviceError(
        f"the module is on {device}, but ortfx runs ONNX Runtime on 'cpu' or 'cuda' only. "
        "Move the module with model.to('cpu') or model.to('cuda')."
    )


SESSION_FAILED = (
    "ONNX Runtime could not create the {kind} session for the exported graph: {error}. "
    "Usually an operator has no kernel for these dtypes on {device} in ORT 1.19 (e.g. integer "
    "arithmetic on uint8); compute in a supported dtype, or let ortfx fall back to PyTorch."
)

# Where ORT's error texts name the node or the operator (gradient build and session creation).
_NODE_IN_ERROR = (
    re.compile(r"node with name '([^']+)'"),
    re.compile(r"for node:? ?(\S+?)\.?(?:\s|$)"),
)
_OP_IN_ERROR = (
    re.compile(r"has not been registered: (\w+)"),
    re.compile(r"implementation for (\w+)\("),
    re.compile(r"(\w+) gradient currently supports"),
    re.compile(r"(\w+) and \w+Grad kernel"),
)
# The sentence of an ORT error after its C++ location and signature.
_DETAIL_AFTER = ("was false. ", "NOT_IMPLEMENTED : ", "RUNTIME_EXCEPTION : ", "() const ")


def _detail(text: str) -> str:
    for marker in _DETAIL_AFTER:
        if marker in text:
            text = text.rsplit(marker, 1)[1]
            break
    return text.strip().rstrip(".")[:400]


def unsupported_op(model: bytes, error: Exception, *, what: str) -> OrtfxError | None:
    """An :class:`OrtfxUnsupportedOpError` naming the operator ORT's ``error`` is about, or None
    when the text names none (then the caller's generic error stands)."""
    text = " ".join(str(error).split())
    node = next((m.group(1) for p in _NODE_IN_ERROR if (m := p.search(text))), "")
    forward = node.split("_Grad/", 1)[0]
    ops = {n.name: n.op_type for n in onnx.load_model_from_string(model).graph.node if n.name}
    op = ops.get(forward) or next((m.group(1) for p in _OP_IN_ERROR if (m := p.search(text))), "")
    if not op:
        return None
    op = op.removesuffix("Grad") if op not in ops.values() else op
    message = UNSUPPORTED_OP.format(
        what=what,
        op=op,
        node=f" (node {forward})" if forward else "",
        detail=_detail(text),
    )
    dtypes = _float_dtypes(model) - {"float32"}
    if dtypes and "Could not find an implementation" in text:
        message += " " + NOT_FLOAT32.format(dtypes=", ".join(sorted(dtypes)))
    return OrtfxUnsupportedOpError(message, op=op, node=forward)


_FLOAT_NAMES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
}


def _float_dtypes(model: bytes) -> set[str]:
    """The floating dtypes of the graph's inputs (the module's parameters among them)."""
    graph = onnx.load_model_from_string(model).graph
    types = {i.type.tensor_type.elem_type for i in graph.input}
    return {_FLOAT_NAMES[t] for t in types if t in _FLOAT_NAMES}


def _session(
    model: bytes, so: Any, providers: list[Any], *, kind: str, device: torch.device
) -> Any:
    try:
        return ort.InferenceSession(model, so, providers=providers)
    except Exception as e:
        named = unsupported_op(model, e, what="train" if kind == "training" else "run")
        if named is not None:
            raise named from e
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OrtfxInitError(SESSION_FAILED.format(kind=kind, error=first, device=device)) from e


def session_options(
    options: Options,
    *,
    training: bool,
    deterministic: bool,
    graph_optimizations: bool = True,
    shared_arena: bool = False,
) -> Any:
    so = ort.SessionOptions()
    if shared_arena and options.cpu_mem_arena:
        arena.use(so, ort)  # one CPU arena for all of ortfx's sessions (runtime/arena.py)
    if not graph_optimizations:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # Training: ORT would otherwise reuse a forward output's buffer during backward and silently
    # overwrite the tensor the user holds.
    so.enable_mem_reuse = not training
    so.enable_mem_pattern = False  # shapes change from call to call
    so.intra_op_num_threads = options.intra_op_threads or torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.enable_cpu_mem_arena = options.cpu_mem_arena
    so.add_session_config_entry(
        "session.intra_op.allow_spinning", "1" if options.allow_spinning else "0"
    )
    if deterministic:
        so.use_deterministic_compute = True
    if training and options.enable_mem_efficient_grad_management:
        # ORT's default order runs every parameter-feeding PythonOp's gradient at the very end
        # of the backward (all gradients alive at once, hooks after everything); priority-based
        # order runs each as soon as its gradient exists, last layer first (measured).
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    so.log_severity_level = 3
    for edit in events.session_option_edits:
        edit(so, training)
    return so


_BOOL = torch.bool


def _capsule(tensor: torch.Tensor) -> tuple[Any, bool]:
    """A DLPack capsule for ORT and whether it carries a bool tensor."""
    tensor = tensor.detach()
    if tensor.numel() == 0:
        # torch calls every empty tensor contiguous whatever its strides (an expanded gradient
        # has zeros); ORT's DLPack reader checks the strides: cross a fresh one.
        tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    elif not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype is torch.bool:
        # ORT's DLPack reader has no bool type: cross as uint8 and flag it.
        return to_dlpack(tensor.to(torch.uint8)), True
    return to_dlpack(tensor), False


def _to_ort(vector: Any, tensor: torch.Tensor) -> None:
    # The common case inline (no detach: the capsule ignores autograd): 2 of 5 µs per 4 feeds.
    if tensor.dtype is not _BOOL and tensor.is_contiguous() and tensor.numel():
        vector.push_back(to_dlpack(tensor), False)
    else:
        vector.push_back(*_capsule(tensor))


def _ort_value(tensor: torch.Tensor) -> Any:
    return C.OrtValue.from_dlpack(*_capsule(tensor))


def _where(info: PostExportProcessedModelInfo, k: int) -> tuple[str, str]:
    """("input", leaf path) for a user input, (kind, graph name) for a parameter or buffer."""
    spec = info.inputs[k]
    if spec.kind is InputKind.USER and isinstance(spec.source, int):
        return "input", info.input_schema.paths[spec.source]
    return spec.kind.name.lower(), spec.name


def _check_not_empty(
    info: PostExportProcessedModelInfo, inputs: Sequence[torch.Tensor], slots: Sequence[int]
) -> None:
    """Raise before ORT's forward: its backward on an empty tensor fails or crashes."""
    for k in slots:
        if inputs[k].numel() == 0:
            where, path = _where(info, k)
            shape = list(inputs[k].shape)
            raise OrtfxEmptyTensorError(
                EMPTY_TENSOR_TRAINING.format(where=where, path=path, shape=shape)
            )


def _feed_error(
    info: PostExportProcessedModelInfo, inputs: Sequence[torch.Tensor], error: Exception
) -> Exception:
    """Why ``inputs`` could not cross into ORT: a typed error for what ortfx can name (a
    sparse or other non-dense tensor, which the fast path does not look at), else ``error``."""
    for k, tensor in enumerate(inputs):
        if tensor.layout is not torch.strided:
            where, path = _where(info, k)
            return OrtfxIOError(
                UNSUPPORTED_LAYOUT.format(where=where, path=path, layout=tensor.layout)
            )
    return error


def _to_torch(vector: Any) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = vector.to_dlpacks(from_dlpack)
    for i in vector.bool_tensor_indices():
        tensors[i] = tensors[i].to(torch.bool)
    return tensors


def _run_failed(what: str, inputs: Sequence[torch.Tensor], error: Exception) -> BaseException:
    # A custom autograd.Function raised inside the graph: the user gets that exception.
    original = pythonop.take_error()
    if original is not None:
        return original
    from ortfx.passes import ZERO_DIVISION_GUARD

    if ZERO_DIVISION_GUARD in str(error):
        return RuntimeError("ZeroDivisionError")  # torch's exception for integer division
    first = _first_line(error)
    shapes = ", ".join(str(list(t.shape)) for t in inputs)
    return OrtfxRuntimeError(
        f"ONNX Runtime failed to run the {what} graph on inputs of shapes {shapes}: {first}"
    )


GRADIENT_BUILD_FAILED = (
    "ONNX Runtime could not build the gradient graph: {error}. Save the graphs with "
    "DebugOptions(save_onnx=True, onnx_prefix=...) to see the operator involved, try "
    "Options(enable_compute_optimizer=False) or the other exporter, or let ortfx fall back "
    "to PyTorch."
)


def _build_failed(model: bytes, error: Exception) -> OrtfxError:
    """The operator ORT cannot differentiate, named; else the generic build failure."""
    named = unsupported_op(model, error, what="differentiate")
    if named is not None:
        return named
    return OrtfxInitError(GRADIENT_BUILD_FAILED.format(error=_first_line(error)))


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


_UNREACHABLE = re.compile(r"partial derivative for '([^']+)' as it's unreachable")


def _build_reachable(
    model: bytes, config: Any, compute_optimizer: bool, pre_grad: str | None
) -> tuple[Any, frozenset[str]]:
    """:func:`_build_gradient`, leaving out the inputs and parameters that require grad but
    reach no output through differentiable ops (a mask compared, a tensor only measured):
    ORT refuses to build for them, torch leaves their ``.grad`` None. Not when the path goes
    through rounding (torch gives zeros there): then the build error stands. Returns their
    names."""
    dropped: set[str] = set()
    while True:
        try:
            return _build_gradient(model, config, compute_optimizer, pre_grad), frozenset(dropped)
        except Exception as e:
            found = _UNREACHABLE.search(str(e))
            if (
                found is None
                or found.group(1) in dropped
                or _zero_gradient_path(model, found.group(1))
            ):
                raise
            name = found.group(1)
            dropped.add(name)
            config.input_names_require_grad = [
                n for n in config.input_names_require_grad if n != name
            ]
            config.initializer_names_to_train = [
                n for n in config.initializer_names_to_train if n != name
            ]


# Ops through which torch passes a zero gradient (not None): an input reached only through
# them must get zeros, which leaving it out of the build would not give.
_ZERO_GRADIENT_OPS = frozenset({"Round", "Floor", "Ceil", "Sign"})


def _zero_gradient_path(model: bytes, name: str) -> bool:
    """Whether ``name`` feeds (at any depth) an op torch differentiates as zero."""
    graph = onnx.load_model_from_string(model).graph
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    seen, pending = {name}, [name]
    while pending:
        for node in consumers.get(pending.pop(), []):
            if node.op_type in _ZERO_GRADIENT_OPS:
                return True
            fresh = [o for o in node.output if o and o not in seen]
            seen.update(fresh)
            pending.extend(fresh)
    return False


def _build_gradient(
    model: bytes, config: Any, compute_optimizer: bool, pre_grad: str | None
) -> Any:
    transforms = C.TrainingGraphTransformerConfiguration()
    transforms.enable_compute_optimizer = compute_optimizer
    if pre_grad:
        transforms.optimized_pre_grad_filepath = pre_grad
    builder = C.OrtModuleGraphBuilder()
    builder.initialize(model, config)
    builder.build(transforms)
    return builder


class ForwardRun:
    """ORT's partial-run state of one training forward, and the PythonOp contexts it kept.

    Dropping it (after backward, or when autograd frees a graph whose backward never ran)
    releases those contexts.
    """

    __slots__ = ("contexts", "fed", "state", "trigger")

    def __init__(
        self,
        state: Any,
        contexts: list[int],
        trigger: torch.Tensor | None,
        fed: Sequence[torch.Tensor] = (),
    ) -> None:
        self.state = state
        self.contexts = contexts
        self.trigger = trigger  # memory-efficient gradients: the call's trigger leaf
        self.fed = fed  # and its parameters (backward nodes may feed them again)

    def __del__(self) -> None:
        if self.contexts:
            pythonop.release(self.contexts)


def _serialized(python_ops: bool) -> contextlib.AbstractContextManager[Any]:
    return pythonop.RUN_LOCK if python_ops else contextlib.nullcontext()


def _releasing(releases: bool) -> contextlib.AbstractContextManager[Any]:
    return openmp.released() if releases else contextlib.nullcontext()


def _releases_torch_threads(options: Options, device: torch.device) -> bool:
    # On CUDA, ORT's CPU threads mostly wait on the device: a release would be pure cost.
    threads = options.intra_op_threads or torch.get_num_threads()
    return device.type == "cpu" and openmp.wanted(options, threads)


def session_settings(options: Options) -> tuple[tuple[str, Any], ...]:
    """The options that shape an ORT session (not the graph): part of the session key."""
    return (
        ("intra_op_threads", options.intra_op_threads or torch.get_num_threads()),
        ("allow_spinning", options.allow_spinning),
        ("release_torch_threads", options.release_torch_threads),
        ("cpu_mem_arena", options.cpu_mem_arena),
        ("zero3_layerwise", options.zero3_layerwise),
    )


def _open(
    model: bytes,
    device: torch.device,
    options: Options,
    *,
    training: bool,
    deterministic: bool,
    optimized_path: str | None,
    memory: tuple[str, tuple[str, ...]] | None = None,
    graph_optimizations: bool = True,
) -> Any:
    """An ``InferenceSession`` over ``model`` with ortfx's settings (one place for both kinds)."""
    providers, _ = _providers(device)
    so = session_options(
        options,
        training=training,
        deterministic=deterministic,
        graph_optimizations=graph_optimizations,
        shared_arena=device.type == "cpu",
    )
    if optimized_path:
        so.optimized_model_filepath = optimized_path
    plan_file = None
    if memory is not None:
        probe, plans = memory
        # ORT reads the plans from a JSON file while it creates the session.
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as plan_file:
            json.dump(list(plans), plan_file)
        so.add_session_config_entry("optimization.memory_optimizer_config", plan_file.name)
        so.add_session_config_entry("optimization.enable_memory_probe_recompute_config", probe)
        so.execution_order = ort.ExecutionOrder.MEMORY_EFFICIENT
    try:
        session = _session(
            model, so, providers, kind="training" if training else "inference", device=device
        )
        arena.track(session, so, ort)
        return session
    finally:
        if plan_file is not None:
            os.unlink(plan_file.name)


@attrs.frozen(eq=False)
class TrainingRunner:
    """A gradient graph in a session with a ``TrainingAgent``: forward now, backward later.

    Built by :func:`open_training`; the ORT objects inside are handles nobody rebinds.
    """

    info: PostExportProcessedModelInfo
    session: Any
    agent: Any
    gradient_build_seconds: float
    session_seconds: float
    non_differentiable: frozenset[int]
    full_shape: frozenset[int]
    saved_outputs: tuple[int, ...]
    # Where each backward fetch goes among the autograd Function's inputs.
    grad_slots: tuple[int, ...]
    # Graph inputs whose in-place change before backward must raise (all but the tensors the
    # graph itself updates, which ortfx writes right after the forward).
    guarded_inputs: tuple[int, ...] = ()
    # The user inputs among the graph inputs (checked for empty tensors before ORT runs).
    user_slots: tuple[int, ...] = ()
    # The graph calls Python (PythonOp nodes): its runs hold pythonop.RUN_LOCK.
    python_ops: bool = False
    # Set when ORT's compute optimizer failed on this graph and the build went without it.
    compute_optimizer_failure: str | None = None
    # Memory-efficient gradients: where the trigger is among the graph inputs (the fed
    # parameters follow the graph inputs, see PostExportProcessedModelInfo.fed_params).
    trigger_slot: int | None = None
    # ... and the fed parameters whose gradient buffer torch may keep (memgrad.accumulating).
    owned_grads: frozenset[int] = frozenset()
    # Runs release torch's idle OpenMP threads first (ortfx.runtime.openmp).
    releases_torch_threads: bool = False

    def memory_stat(self, probe: str) -> dict[str, tuple[str, int]]:
        """ORT's recompute opportunities: cluster id -> (symbolic bytes saved, frequency)."""
        _, stat = self.agent.get_serialized_ortmodule_memory_stat("", probe, False)
        return {k: (str(v[0]), int(v[1])) for k, v in stat.items()}

    def forward(self, inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        _check_not_empty(self.info, inputs, self.user_slots)
        n = len(self.info.inputs)
        graph_inputs = inputs[:n]
        fed: Sequence[torch.Tensor] = inputs[n] if len(inputs) > n else ()  # type: ignore[assignment]
        feeds = C.OrtValueVector()
        feeds.reserve(n)
        try:
            for t in graph_inputs:
                _to_ort(feeds, t)
        except Exception as e:
            raise _feed_error(self.info, graph_inputs, e) from e
        fetches = C.OrtValueVector()
        run_state = C.PartialGraphExecutionState()
        contexts: list[int] = []
        if not (self.python_ops or fed or self.releases_torch_threads):
            # No Python in the graph and no threads to release: no thread state to set.
            try:
                self.agent.run_forward(feeds, fetches, run_state, C.OrtValueCache())
            except Exception as e:
                raise _run_failed("forward", graph_inputs, e) from e
        else:
            with (
                _serialized(self.python_ops),
                _releasing(self.releases_torch_threads),
                pythonop.training_run() as contexts,
                memgrad.feeding(fed),
            ):
                try:
                    self.agent.run_forward(feeds, fetches, run_state, C.OrtValueCache())
                except Exception as e:
                    pythonop.release(contexts)
                    raise _run_failed("forward", graph_inputs, e) from e
        trigger = None if self.trigger_slot is None else inputs[self.trigger_slot]
        return _to_torch(fetches), ForwardRun(run_state, contexts, trigger, fed)

    def backward(
        self,
        run_state: ForwardRun,
        grad_outputs: Sequence[torch.Tensor | None],
        outputs_meta: Sequence[tuple[torch.Size, torch.dtype, torch.device]],
    ) -> list[torch.Tensor]:
        feeds = C.OrtValueVector()
        for k, grad in enumerate(grad_outputs):
            if k in self.non_differentiable:
                continue
            if grad is None:
                shape, dtype, device = outputs_meta[k]
                # An unused output's gradient is zero; most feed an Add and broadcast a scalar.
                grad = torch.zeros(
                    shape if k in self.full_shape else (), dtype=dtype, device=device
                )
            _to_ort(feeds, grad)
        fetches = C.OrtValueVector()
        trigger = run_state.trigger
        if trigger is not None and not engine_accumulates(trigger):
            # autograd.grad / backward(inputs=...): the parameters are no inputs of the
            # autograd node, so what torch would hand them cannot reach them.
            raise OrtfxRuntimeError(RESTRICTED_BACKWARD)
        if not (self.python_ops or run_state.fed or self.releases_torch_threads):
            try:
                self.agent.run_backward(feeds, fetches, run_state.state)
            except Exception as e:
                raise _run_failed("backward", [g for g in grad_outputs if g is not None], e) from e
        else:
            with (
                _serialized(self.python_ops),
                _releasing(self.releases_torch_threads),
                memgrad.accumulating(self.owned_grads),
                memgrad.feeding(run_state.fed),
            ):
                try:
                    self.agent.run_backward(feeds, fetches, run_state.state)
                except Exception as e:
                    failed = [g for g in grad_outputs if g is not None]
                    raise _run_failed("backward", failed, e) from e
        grads: list[torch.Tensor | None] = list(_to_torch(fetches))
        if trigger is not None:
            # The trigger's own gradient, last among ORT's (it is the last graph input).
            grads[-1] = None
        return grads  # type: ignore[return-value]


RESTRICTED_BACKWARD = (
    "this backward asks for the gradients of some tensors only (torch.autograd.grad or "
    "backward(inputs=...)) through an ORTModule with "
    "Options(enable_mem_efficient_grad_management=True), which hands parameter gradients to "
    "torch only by accumulating them into .grad during a full backward (loss.backward()). "
    "Turn the option off for this module (ortfx.configure(model, "
    "enable_mem_efficient_grad_management=False)) to compute restricted gradients."
)


def _guarded_inputs(info: PostExportProcessedModelInfo) -> tuple[int, ...]:
    updated = {(u.kind == "input", u.target) for u in info.updates}
    return tuple(
        k
        for k, spec in enumerate(info.inputs)
        if spec.kind not in (InputKind.INTERNAL, InputKind.TRIGGER)
        and (spec.kind is InputKind.USER, spec.source) not in updated
    )


def _gradient_passes(model: bytes, *, fed_params: bool, forward: bytes = b"") -> bytes:
    """Edits of ORT's gradient model, each from :mod:`ortfx.passes`:

    - broadcast reductions that never reduce, dropped
      (``reductions.drop_empty_broadcast_reductions``, with ``forward``'s inferred shapes);
    - ``ReluGrad`` as torch's ``threshold_backward`` (``relu_grad_in_torch``; without the
      bridge, torch's NaN semantics in ONNX ops, ``relu_grad_passes_nan``);
    - torch's log-softmax gradient (``log_softmax_grad_in_torch``);
    - for memory-efficient gradients, ``feeds_after_readers``.

    The model is parsed only if one applies."""
    from ortfx import passes
    from ortfx.passes import reductions

    relu = b"ReluGrad" in model
    # torch's log-softmax gradient through the ATen executor, when the bridge is built
    log_softmax = b"LogSoftmaxGrad_13" in model and aten.install()
    broadcasts = b"BroadcastGradientArgs" in model
    if not (relu or log_softmax or fed_params or broadcasts):
        return model
    proto = onnx.load_model_from_string(model)
    shapes = reductions.forward_shapes(forward) if broadcasts and forward else {}
    changed = broadcasts and reductions.drop_empty_broadcast_reductions(proto, shapes) > 0
    # torch's ReluGrad through the ATen executor; without it (no bridge), torch's NaN rule
    # in ONNX ops for every ReluGrad left
    changed = (relu and aten.install() and passes.relu_grad_in_torch(proto)) or changed
    changed = (relu and passes.relu_grad_passes_nan(proto)) or changed
    changed = (log_softmax and passes.log_softmax_grad_in_torch(proto)) or changed
    if fed_params:
        changed = passes.feeds_after_readers(proto, memgrad.FUNCTION_NAME) or changed
    if not changed:
        return model
    edited: bytes = proto.SerializeToString()
    return edited


def _gather_per_layer(model: bytes) -> bytes:
    """ZeRO-3 layer-wise gathering: see :func:`ortfx.passes.layerwise.gather_per_layer`."""
    from ortfx.passes import layerwise

    proto = onnx.load_model_from_string(model)
    if not layerwise.gather_per_layer(proto, memgrad.FUNCTION_NAME):
        return model
    edited: bytes = proto.SerializeToString()
    return edited


def _install_aten(model: bytes) -> None:
    """A graph with ops run by torch (ATen nodes) needs the executor and their gradient
    definitions registered in this process: an export registers them, but a graph loaded from
    the persistent export cache was not exported here."""
    if aten.DOMAIN.encode() in model and not aten.install():
        raise OrtfxInitError(ATEN_NEEDS_BRIDGE)


ATEN_NEEDS_BRIDGE = (
    "this graph runs ops in torch inside ONNX Runtime (ATen nodes, e.g. histc, ctc_loss, "
    "index_add), which needs ortfx's compiled bridge (ortfx._bridge), and it is not built; "
    "reinstall ortfx from source with a C++ compiler (pip install -e .) or run `make test`, "
    "which builds it."
)


def _builder_optimized_is_enough(
    info: PostExportProcessedModelInfo,
    device: torch.device,
    memory: tuple[str, tuple[str, ...]] | None,
    probe: bool,
) -> bool:
    """Whether the session may skip ORT's graph optimizations: the gradient builder has already
    run the training transformers, and on CPU the session's own passes bought no step time but
    cost 0.1 s of session creation (GPT-2-like model; bench.session_settings, docs/performance).
    Kept where they do work: the memory optimizer's plans (recompute), and the sessions that
    discover them (``probe``: plan names follow the fused ops, so discovery must see the graph
    the plans are applied to), memory-efficient gradients (the buffers handed to torch without
    a copy), and on other devices (untested)."""
    return device.type == "cpu" and memory is None and not probe and not info.fed_params


def open_training(
    info: PostExportProcessedModelInfo,
    device: torch.device,
    options: Options,
    *,
    deterministic: bool,
    save_prefix: str | None = None,
    memory: tuple[str, tuple[str, ...]] | None = None,
    mode: str = "training",
    probe: bool = False,
) -> TrainingRunner:
    """Build ``info``'s gradient graph and open a training session over it.

    ``memory`` is (probe config, plan strings) to turn the memory optimizer on; ``probe`` says
    the session serves the discovery of those plans. Saved files are
    named by ``mode``, the export mode ("training", or "inference" for an eval-mode graph).
    """
    require_ort()
    functions = pythonop_functions(info.model)
    pythonop.prepare(functions)
    _install_aten(info.model)
    aten.install_standard_gradients()  # gradients ORT lacks for standard ops (Atan)
    start = time.perf_counter()
    config = C.OrtModuleGraphBuilderConfiguration()
    config.initializer_names = [i.name for i in info.inputs if i.kind is not InputKind.USER]
    config.initializer_names_to_train = list(info.params_to_train)
    config.input_names_require_grad = list(info.user_inputs_requiring_grad)
    config.build_gradient_graph = True
    config.enable_caching = False
    config.use_memory_efficient_gradient = False
    config.loglevel = C.Severity.ERROR
    pre_grad = f"{save_prefix}_optimized_pre_grad_{mode}.onnx" if save_prefix else None
    failure: str | None = None
    try:
        builder, unreachable = _build_reachable(
            info.model, config, options.enable_compute_optimizer, pre_grad
        )
    except Exception as e:
        if not options.enable_compute_optimizer:
            raise _build_failed(info.model, e) from e
        # ORT 1.19's compute optimizer crashes on some graphs (e.g. logits sliced before
        # the loss) that build fine without it.
        failure = _first_line(e)
        try:
            builder, unreachable = _build_reachable(info.model, config, False, pre_grad)
        except Exception as again:
            raise _build_failed(info.model, again) from again
    gi = builder.get_graph_info()
    gradient_model: bytes = builder.get_gradient_model()
    gradient_model = _gradient_passes(
        gradient_model, fed_params=bool(info.fed_params), forward=info.model
    )
    if info.fed_params and options.zero3_layerwise:
        gradient_model = _gather_per_layer(gradient_model)
    gradient_build_seconds = time.perf_counter() - start

    start = time.perf_counter()
    if save_prefix:
        with open(f"{save_prefix}_optimized_{mode}.onnx", "wb") as f:
            f.write(gradient_model)
    with _executed_model(save_prefix, mode, bool(info.fed_params)) as executed:
        session = _open(
            gradient_model,
            device,
            options,
            training=True,
            deterministic=deterministic,
            optimized_path=executed,
            memory=memory,
            graph_optimizations=not _builder_optimized_is_enough(info, device, memory, probe),
        )
        owned = _owned_gradients(executed) if info.fed_params else frozenset()
    feeds = [*gi.user_input_names, *gi.initializer_names]
    ours = [i.name for i in info.inputs]
    if feeds != ours:
        raise OrtfxInitError(
            f"ORT orders the graph inputs as {feeds}, ortfx as {ours}; "
            "this is an ortfx bug, please report it."
        )
    fetches = [o.name for o in session.get_outputs()]
    _, ort_device = _providers(device)
    # The device lists must match ORT's own counts exactly: a short list aborts the process.
    n_forward = len(gi.user_output_names) + len(gi.frontier_node_arg_map)
    agent = C.TrainingAgent(
        session._sess, feeds, [ort_device] * n_forward, fetches, [ort_device] * len(fetches), 0
    )
    return TrainingRunner(
        info=info,
        session=session,
        agent=agent,
        gradient_build_seconds=gradient_build_seconds,
        session_seconds=time.perf_counter() - start,
        non_differentiable=frozenset(gi.output_grad_indices_non_differentiable),
        full_shape=frozenset(gi.output_grad_indices_require_full_shape),
        saved_outputs=tuple(gi.module_output_indices_requires_save_for_backward),
        grad_slots=tuple(
            k
            for k, spec in enumerate(info.inputs)
            if spec.requires_grad and spec.name not in unreachable
        ),
        guarded_inputs=_guarded_inputs(info),
        user_slots=tuple(k for k, spec in enumerate(info.inputs) if spec.kind is InputKind.USER),
        python_ops=bool(functions),
        compute_optimizer_failure=failure,
        releases_torch_threads=_releases_torch_threads(options, device),
        trigger_slot=next(
            (k for k, spec in enumerate(info.inputs) if spec.kind is InputKind.TRIGGER), None
        ),
        owned_grads=owned,
    )


@contextlib.contextmanager
def _executed_model(save_prefix: str | None, mode: str, needed: bool) -> Any:
    """Where the session saves the graph it runs: the debug file, or (memory-efficient
    gradients read it) a temporary one, deleted after."""
    if save_prefix:
        yield f"{save_prefix}_execution_model_{mode}.onnx"
        return
    if not needed:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="ortfx-") as tmp:
        yield os.path.join(tmp, "executed.onnx")


def _owned_gradients(path: str | None) -> frozenset[int]:
    """:func:`ortfx.passes.owned_gradients` over the graph the session runs (after ORT's own
    transformers, which decide what aliases what); none if ORT saved no graph."""
    from ortfx import passes

    if path is None or not os.path.exists(path):
        return frozenset()
    return passes.owned_gradients(onnx.load(path, load_external_data=False), memgrad.FUNCTION_NAME)


@attrs.frozen(eq=False)
class InferenceRunner:
    """A plain session over the forward graph, fed through I/O binding (:func:`open_inference`)."""

    info: PostExportProcessedModelInfo
    session: Any
    ort_device: Any
    session_seconds: float
    gradient_build_seconds: float = 0.0
    python_ops: bool = False  # the graph calls Python: its runs hold pythonop.RUN_LOCK
    releases_torch_threads: bool = False  # see TrainingRunner

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        binding = self.session.io_binding()._iobinding
        try:
            for spec, tensor in zip(self.info.inputs, inputs, strict=True):
                binding.bind_ortvalue_input(spec.name, _ort_value(tensor))
        except Exception as e:
            raise _feed_error(self.info, inputs, e) from e
        for name in self.info.output_names:
            binding.bind_output(name, self.ort_device)
        try:
            with _serialized(self.python_ops), _releasing(self.releases_torch_threads):
                self.session._sess.run_with_iobinding(binding, None)
        except Exception as e:
            raise _run_failed("inference", inputs, e) from e
        return _to_torch(binding.get_outputs())


def open_inference(
    info: PostExportProcessedModelInfo,
    device: torch.device,
    options: Options,
    *,
    deterministic: bool,
    save_prefix: str | None = None,
) -> InferenceRunner:
    """Open an inference session over ``info``'s forward graph."""
    require_ort()
    functions = pythonop_functions(info.model)
    pythonop.prepare(functions)
    _install_aten(info.model)
    start = time.perf_counter()
    if save_prefix:
        with open(f"{save_prefix}_execution_model_inference.onnx", "wb") as f:
            f.write(info.model)
    session = _open(
        info.model,
        device,
        options,
        training=False,
        deterministic=deterministic,
        optimized_path=f"{save_prefix}_optimized_inference.onnx" if save_prefix else None,
    )
    _, ort_device = _providers(device)
    return InferenceRunner(
        info,
        session,
        ort_device,
        time.perf_counter() - start,
        python_ops=bool(functions),
        releases_torch_threads=_releases_torch_threads(options, device),
    )
