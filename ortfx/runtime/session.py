"""The ONNX Runtime driver: gradient-graph build, sessions, and tensor crossing through DLPack.

Only this module (and nothing in the pure core) imports onnxruntime.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack  # type: ignore[attr-defined]

from ortfx.errors import (
    CUDA_PROVIDER_MISSING,
    ORT_MISSING,
    OrtfxDeviceError,
    OrtfxInitError,
    OrtfxRuntimeError,
)
from ortfx.export import pythonop_functions
from ortfx.model_info import InputKind, PostExportProcessedModelInfo
from ortfx.options import Options
from ortfx.runtime import pythonop

try:
    import onnxruntime as ort
    from onnxruntime.capi import _pybind_state as C

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


def _session(
    model: bytes, so: Any, providers: list[Any], *, kind: str, device: torch.device
) -> Any:
    try:
        return ort.InferenceSession(model, so, providers=providers)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OrtfxInitError(SESSION_FAILED.format(kind=kind, error=first, device=device)) from e


def session_options(options: Options, *, training: bool, deterministic: bool) -> Any:
    so = ort.SessionOptions()
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
    so.log_severity_level = 3
    return so


def _capsule(tensor: torch.Tensor) -> tuple[Any, bool]:
    """A DLPack capsule for ORT and whether it carries a bool tensor."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype is torch.bool:
        # ORT's DLPack reader has no bool type: cross as uint8 and flag it.
        return to_dlpack(tensor.to(torch.uint8)), True
    return to_dlpack(tensor), False


def _to_ort(vector: Any, tensor: torch.Tensor) -> None:
    vector.push_back(*_capsule(tensor))


def _ort_value(tensor: torch.Tensor) -> Any:
    return C.OrtValue.from_dlpack(*_capsule(tensor))


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
    first = _first_line(error)
    shapes = ", ".join(str(list(t.shape)) for t in inputs)
    return OrtfxRuntimeError(
        f"ONNX Runtime failed to run the {what} graph on inputs of shapes {shapes}: {first}"
    )


def with_symbolic_shapes(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
    """Annotate intermediate values with sizes in terms of the input dims, so that ORT's
    memory estimates are expressions of input sizes; unchanged if inference fails."""
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        model = SymbolicShapeInference.infer_shapes(
            onnx.load_model_from_string(info.model), auto_merge=True, guess_output_rank=True
        )
    except Exception:
        return info
    return attrs.evolve(info, model=model.SerializeToString())


GRADIENT_BUILD_FAILED = (
    "ONNX Runtime could not build the gradient graph: {error}. Save the graphs with "
    "DebugOptions(save_onnx=True, onnx_prefix=...) to see the operator involved, try "
    "Options(enable_compute_optimizer=False) or the other exporter, or let ortfx fall back "
    "to PyTorch."
)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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

    __slots__ = ("contexts", "state")

    def __init__(self, state: Any, contexts: list[int]) -> None:
        self.state = state
        self.contexts = contexts

    def __del__(self) -> None:
        if self.contexts:
            pythonop.release(self.contexts)


class TrainingRunner:
    """A gradient graph in a session with a ``TrainingAgent``: forward now, backward later."""

    def __init__(
        self,
        info: PostExportProcessedModelInfo,
        device: torch.device,
        options: Options,
        *,
        deterministic: bool,
        save_prefix: str | None = None,
        memory: tuple[str, tuple[str, ...]] | None = None,
    ) -> None:
        """``memory`` is (probe config, plan strings) to turn the memory optimizer on."""
        require_ort()
        self.info = info
        pythonop.prepare(pythonop_functions(info.model))
        start = time.perf_counter()
        config = C.OrtModuleGraphBuilderConfiguration()
        config.initializer_names = [i.name for i in info.inputs if i.kind is not InputKind.USER]
        config.initializer_names_to_train = list(info.params_to_train)
        config.input_names_require_grad = list(info.user_inputs_requiring_grad)
        config.build_gradient_graph = True
        config.enable_caching = False
        config.use_memory_efficient_gradient = False
        config.loglevel = C.Severity.ERROR
        pre_grad = f"{save_prefix}_optimized_pre_grad_training.onnx" if save_prefix else None
        # Set when ORT's compute optimizer failed on this graph and the build went without it.
        self.compute_optimizer_failure: str | None = None
        try:
            builder = _build_gradient(
                info.model, config, options.enable_compute_optimizer, pre_grad
            )
        except Exception as e:
            if not options.enable_compute_optimizer:
                raise OrtfxInitError(GRADIENT_BUILD_FAILED.format(error=_first_line(e))) from e
            # ORT 1.19's compute optimizer crashes on some graphs (e.g. logits sliced before
            # the loss) that build fine without it.
            self.compute_optimizer_failure = _first_line(e)
            try:
                builder = _build_gradient(info.model, config, False, pre_grad)
            except Exception as again:
                raise OrtfxInitError(
                    GRADIENT_BUILD_FAILED.format(error=_first_line(again))
                ) from again
        self.graph_info = builder.get_graph_info()
        self.gradient_model: bytes = builder.get_gradient_model()
        self.gradient_build_seconds = time.perf_counter() - start

        start = time.perf_counter()
        providers, ort_device = _providers(device)
        so = session_options(options, training=True, deterministic=deterministic)
        plan_file = None
        if memory is not None:
            probe, plans = memory
            # ORT reads the plans from a JSON file while it creates the session.
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as plan_file:
                json.dump(list(plans), plan_file)
            so.add_session_config_entry("optimization.memory_optimizer_config", plan_file.name)
            so.add_session_config_entry("optimization.enable_memory_probe_recompute_config", probe)
            so.execution_order = ort.ExecutionOrder.MEMORY_EFFICIENT
        if save_prefix:
            with open(f"{save_prefix}_optimized_training.onnx", "wb") as f:
                f.write(self.gradient_model)
            so.optimized_model_filepath = f"{save_prefix}_execution_model_training.onnx"
        try:
            self.session = _session(
                self.gradient_model,
                so,
                providers,
                kind="training",
                device=device,
            )
        finally:
            if plan_file is not None:
                os.unlink(plan_file.name)
        gi = self.graph_info
        feeds = [*gi.user_input_names, *gi.initializer_names]
        ours = [i.name for i in info.inputs]
        if feeds != ours:
            raise OrtfxInitError(
                f"ORT orders the graph inputs as {feeds}, ortfx as {ours}; "
                "this is an ortfx bug, please report it."
            )
        fetches = [o.name for o in self.session.get_outputs()]
        # The device lists must match ORT's own counts exactly: a short list aborts the process.
        n_forward = len(gi.user_output_names) + len(gi.frontier_node_arg_map)
        self.agent = C.TrainingAgent(
            self.session._sess,
            feeds,
            [ort_device] * n_forward,
            fetches,
            [ort_device] * len(fetches),
            0,
        )
        self.session_seconds = time.perf_counter() - start
        self.non_differentiable = frozenset(gi.output_grad_indices_non_differentiable)
        self.full_shape = frozenset(gi.output_grad_indices_require_full_shape)
        self.saved_outputs = tuple(gi.module_output_indices_requires_save_for_backward)
        # Where each backward fetch goes among the autograd Function's inputs.
        self.grad_slots = tuple(k for k, spec in enumerate(info.inputs) if spec.requires_grad)

    def memory_stat(self, probe: str) -> dict[str, tuple[str, int]]:
        """ORT's recompute opportunities: cluster id -> (symbolic bytes saved, frequency)."""
        _, stat = self.agent.get_serialized_ortmodule_memory_stat("", probe, False)
        return {k: (str(v[0]), int(v[1])) for k, v in stat.items()}

    def forward(self, inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        feeds = C.OrtValueVector()
        feeds.reserve(len(inputs))
        for t in inputs:
            _to_ort(feeds, t)
        fetches = C.OrtValueVector()
        run_state = C.PartialGraphExecutionState()
        with pythonop.training_run() as contexts:
            try:
                self.agent.run_forward(feeds, fetches, run_state, C.OrtValueCache())
            except Exception as e:
                pythonop.release(contexts)
                raise _run_failed("forward", inputs, e) from e
        return _to_torch(fetches), ForwardRun(run_state, contexts)

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
        try:
            self.agent.run_backward(feeds, fetches, run_state.state)
        except Exception as e:
            raise _run_failed("backward", [g for g in grad_outputs if g is not None], e) from e
        return _to_torch(fetches)


class InferenceRunner:
    """A plain session over the forward graph, fed through I/O binding."""

    def __init__(
        self,
        info: PostExportProcessedModelInfo,
        device: torch.device,
        options: Options,
        *,
        deterministic: bool,
        save_prefix: str | None = None,
    ) -> None:
        require_ort()
        self.info = info
        pythonop.prepare(pythonop_functions(info.model))
        start = time.perf_counter()
        providers, _ = _providers(device)
        so = session_options(options, training=False, deterministic=deterministic)
        if save_prefix:
            with open(f"{save_prefix}_execution_model_inference.onnx", "wb") as f:
                f.write(info.model)
            so.optimized_model_filepath = f"{save_prefix}_optimized_inference.onnx"
        self.session = _session(
            info.model,
            so,
            providers,
            kind="inference",
            device=device,
        )
        _, self.ort_device = _providers(device)
        self.session_seconds = time.perf_counter() - start
        self.gradient_build_seconds = 0.0

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        binding = self.session.io_binding()._iobinding
        for spec, tensor in zip(self.info.inputs, inputs, strict=True):
            binding.bind_ortvalue_input(spec.name, _ort_value(tensor))
        for name in self.info.output_names:
            binding.bind_output(name, self.ort_device)
        try:
            self.session._sess.run_with_iobinding(binding, None)
        except Exception as e:
            raise _run_failed("inference", inputs, e) from e
        return _to_torch(binding.get_outputs())
