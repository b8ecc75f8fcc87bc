"""ORT sessions as ortfx opens them: session options (threads, spinning, arena, order), the
settings in the session key, the ATen executor check, and the serialization of graphs that call
Python (PythonOp) against ORT's own lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any

import attrs
import torch

from ortfx import aten
from ortfx.errors import (
    OrtfxGraphBuildError,
    OrtfxInitError,
)
from ortfx.model_info import PostExportProcessedModelInfo
from ortfx.options import LogLevel, Options
from ortfx.runtime import arena, events, openmp, pythonop
from ortfx.runtime.failures import SESSION_FAILED, unsupported_op
from ortfx.runtime.ort import ort, providers_for


@attrs.frozen
class Timings:
    """One-time costs, in seconds, for the log line and for users."""

    export: float = 0.0
    gradient_build: float = 0.0
    session: float = 0.0

    def render(self) -> str:
        parts = [f"{k.replace('_', ' ')} {v:.3f} s" for k, v in attrs.asdict(self).items() if v]
        return ", ".join(parts) or "no one-time cost"


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
        raise OrtfxGraphBuildError(
            SESSION_FAILED.format(kind=kind, error=first, device=device)
        ) from e


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
    # ORT prints its own log on stderr: errors only, everything at ortfx's VERBOSE level.
    so.log_severity_level = 0 if options.log_level <= LogLevel.VERBOSE else 3
    for edit in events.session_option_edits:
        edit(so, training)
    return so


def serialized(python_ops: bool) -> contextlib.AbstractContextManager[Any]:
    return pythonop.RUN_LOCK if python_ops else contextlib.nullcontext()


def releasing(releases: bool) -> contextlib.AbstractContextManager[Any]:
    return openmp.released() if releases else contextlib.nullcontext()


def releases_torch_threads(options: Options, device: torch.device) -> bool:
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


def open_session(
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
    providers, _ = providers_for(device)
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


def install_aten(model: bytes) -> None:
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


def builder_optimized_is_enough(
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


@contextlib.contextmanager
def executed_model(save_prefix: str | None, mode: str, needed: bool) -> Any:
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
