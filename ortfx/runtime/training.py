"""Training runners: ORT's gradient graph (built by its C++ training layer), a session with a
``TrainingAgent`` over it, and the forward and backward runs the autograd bridge calls."""

from __future__ import annotations

import ast
import os
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import onnx
import torch

from ortfx import aten
from ortfx._torch import engine_accumulates
from ortfx.errors import (
    OrtfxInitError,
    OrtfxRuntimeError,
)
from ortfx.function_names import pythonop_functions
from ortfx.model_info import InputKind, PostExportProcessedModelInfo
from ortfx.options import LogLevel, Options
from ortfx.runtime import disk_cache, function_grads, memgrad, pythonop, replay
from ortfx.runtime.dlpack import to_ort, to_torch
from ortfx.runtime.failures import build_failed, check_not_empty, feed_error, first_line, run_failed
from ortfx.runtime.logs import wrapper_log
from ortfx.runtime.ort import C, providers_for, require_ort
from ortfx.runtime.session import (
    builder_optimized_is_enough,
    executed_model,
    install_aten,
    open_session,
    releases_torch_threads,
    releasing,
    serialized,
)

_UNREACHABLE = re.compile(r"partial derivative for '([^']+)' as it's unreachable")
_NO_PRODUCER = re.compile(r"(\S+): couldn't find the producer node, and it's not a graph input")


@attrs.frozen
class _Built:
    builder: Any
    unreachable: frozenset[str]  # inputs requiring grad that reach no output
    folded: frozenset[str]  # guard outputs ORT's optimizer found constant (left out)


def _build_reachable(
    model: bytes,
    config: Any,
    compute_optimizer: bool,
    pre_grad: str | None,
    guard_outputs: frozenset[str],
) -> _Built:
    """:func:`_build_gradient`, leaving out the inputs and parameters that require grad but
    reach no output through differentiable ops (a mask compared, a tensor only measured):
    ORT refuses to build for them, torch leaves their ``.grad`` None. Not when the path goes
    through rounding (torch gives zeros there): then the build error stands.

    Also leaves out the guard outputs (see :class:`~ortfx.model_info.Guard`) that ORT's
    optimizer folded into constants, which its builder then cannot find: they hold sizes the
    graph's static shapes already fix, so their value cannot change from run to run."""
    dropped: set[str] = set()
    folded: set[str] = set()
    while True:
        try:
            builder = _build_gradient(model, config, compute_optimizer, pre_grad)
            return _Built(builder, frozenset(dropped), frozenset(folded))
        except Exception as e:
            constant = _NO_PRODUCER.search(str(e))
            if constant and constant.group(1) in guard_outputs - folded:
                folded.add(constant.group(1))
                model = _without_outputs(model, folded)
                continue
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


def _without_outputs(model: bytes, names: set[str]) -> bytes:
    proto = onnx.load_model_from_string(model)
    kept = [o for o in proto.graph.output if o.name not in names]
    del proto.graph.output[:]
    proto.graph.output.extend(kept)
    data: bytes = proto.SerializeToString()
    return data


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
    # (output position, value) of the guard outputs ORT folded into constants (see
    # _build_reachable): the forward puts their values back where ortfx expects them.
    constants: tuple[tuple[int, torch.Tensor], ...] = ()
    # Why a second backward through one forward cannot run the forward again (see
    # ortfx.runtime.replay); None when it can.
    replay_refused: str | None = None
    # Outputs the graph also consumes inside (a returned hidden state the next layer reads).
    inner_outputs: tuple[int, ...] = ()

    def memory_stat(self, probe: str) -> dict[str, tuple[str, int]]:
        """ORT's recompute opportunities: cluster id -> (symbolic bytes saved, frequency)."""
        _, stat = self.agent.get_serialized_ortmodule_memory_stat("", probe, False)
        return {k: (str(v[0]), int(v[1])) for k, v in stat.items()}

    def forward(self, inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        check_not_empty(self.info, inputs, self.user_slots)
        n = len(self.info.inputs)
        graph_inputs = inputs[:n]
        fed: Sequence[torch.Tensor] = inputs[n] if len(inputs) > n else ()  # type: ignore[assignment]
        feeds = C.OrtValueVector()
        feeds.reserve(n)
        try:
            for t in graph_inputs:
                to_ort(feeds, t)
        except Exception as e:
            raise feed_error(self.info, graph_inputs, e) from e
        fetches = C.OrtValueVector()
        run_state = C.PartialGraphExecutionState()
        contexts: list[int] = []
        if not (self.python_ops or fed or self.releases_torch_threads):
            # No Python in the graph and no threads to release: no thread state to set.
            try:
                self.agent.run_forward(feeds, fetches, run_state, C.OrtValueCache())
            except Exception as e:
                raise run_failed("forward", graph_inputs, e) from e
        else:
            with (
                serialized(self.python_ops),
                releasing(self.releases_torch_threads),
                pythonop.training_run() as contexts,
                memgrad.feeding(fed),
            ):
                try:
                    self.agent.run_forward(feeds, fetches, run_state, C.OrtValueCache())
                except Exception as e:
                    pythonop.release(contexts)
                    raise run_failed("forward", graph_inputs, e) from e
        trigger = None if self.trigger_slot is None else inputs[self.trigger_slot]
        outputs = to_torch(fetches)
        for k, value in self.constants:
            outputs.insert(k, value.clone())
        return outputs, ForwardRun(run_state, contexts, trigger, fed)

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
            to_ort(feeds, grad)
        fetches = C.OrtValueVector()
        trigger = run_state.trigger
        if trigger is not None and not engine_accumulates(trigger):
            # autograd.grad / backward(inputs=...): the parameters are no inputs of the
            # autograd node, so what torch would hand them cannot reach them.
            raise OrtfxRuntimeError(RESTRICTED_BACKWARD)
        cut: list[tuple[int, int]] = []  # where a Function's backward gave no gradient
        # Outputs without a gradient (unused by the loss): what only they reach gets None.
        # Only the user's outputs can go unused: the buffer updates and guards after them
        # never take a gradient (BatchNorm models skip this on every step).
        unused = any(
            grad_outputs[k] is None
            for k in range(self.info.n_user_outputs)
            if k not in self.non_differentiable
        )
        seeded = (
            [self.info.output_names[k] for k, g in enumerate(grad_outputs) if g is not None]
            if unused
            else None
        )
        if not (self.python_ops or run_state.fed or self.releases_torch_threads):
            try:
                self.agent.run_backward(feeds, fetches, run_state.state)
            except Exception as e:
                raise run_failed("backward", [g for g in grad_outputs if g is not None], e) from e
        else:
            with (
                serialized(self.python_ops),
                releasing(self.releases_torch_threads),
                memgrad.accumulating(self.owned_grads),
                memgrad.feeding(run_state.fed),
                pythonop.recording_no_gradient(self.info.model, seeded) as cut,
            ):
                try:
                    self.agent.run_backward(feeds, fetches, run_state.state)
                except Exception as e:
                    failed = [g for g in grad_outputs if g is not None]
                    raise run_failed("backward", failed, e) from e
        grads: list[torch.Tensor | None] = list(to_torch(fetches))
        if cut or seeded is not None:
            # A Function's backward gave None for an input, or some outputs got no gradient:
            # ORT computed with zeros there, and the inputs no other path reaches get None,
            # as in eager (a head whose output the loss does not use keeps .grad None, and
            # an optimizer then leaves it alone).
            names = [self.info.inputs[slot].name for slot in self.grad_slots]
            none = function_grads.no_gradient_inputs(self.info.model, cut, names, seeded)
            grads = [None if name in none else g for name, g in zip(names, grads, strict=True)]
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
    # ORT's registry of Python functions is locked while a graph with PythonOps builds, opens
    # or runs: a build waiting for the GIL under that lock while another thread's PythonOp
    # run waits for the lock under the GIL deadlocked (two threads' first calls, 1 in ~50).
    with serialized(bool(functions)):
        return _open_training(
            info,
            functions,
            device,
            options,
            deterministic=deterministic,
            save_prefix=save_prefix,
            memory=memory,
            mode=mode,
            probe=probe,
        )


def _open_training(
    info: PostExportProcessedModelInfo,
    functions: dict[str, type],
    device: torch.device,
    options: Options,
    *,
    deterministic: bool,
    save_prefix: str | None,
    memory: tuple[str, tuple[str, ...]] | None,
    mode: str,
    probe: bool,
) -> TrainingRunner:
    pythonop.prepare(functions)
    install_aten(info.model)
    aten.install_standard_gradients()  # gradients ORT lacks for standard ops (Atan)
    start = time.perf_counter()
    config = C.OrtModuleGraphBuilderConfiguration()
    config.initializer_names = [i.name for i in info.inputs if i.kind is not InputKind.USER]
    config.initializer_names_to_train = list(info.params_to_train)
    config.input_names_require_grad = list(info.user_inputs_requiring_grad)
    config.build_gradient_graph = True
    config.enable_caching = False
    config.use_memory_efficient_gradient = False
    verbose = options.log_level <= LogLevel.VERBOSE  # ORT's own log, as in session_options
    config.loglevel = C.Severity.VERBOSE if verbose else C.Severity.ERROR
    pre_grad = f"{save_prefix}_optimized_pre_grad_{mode}.onnx" if save_prefix else None
    # The persistent cache keys ORT's gradient graph on everything its build reads; not with
    # PythonOps (ORT's build may call their Python) nor when the build saves a file.
    gradient = disk_cache.cached_gradient(
        options.cache_dir,
        info.model,
        {
            "initializers": tuple(config.initializer_names),
            "to train": tuple(config.initializer_names_to_train),
            "inputs requiring grad": tuple(config.input_names_require_grad),
            "compute optimizer": options.enable_compute_optimizer,
            "fed params": bool(info.fed_params),
            "layerwise": options.zero3_layerwise,
            "device": device.type,
        },
        lambda: _gradient(info, config, options, pre_grad),
        wrapper_log(options.log_level),
        refused="the graph calls Python (PythonOp nodes), which its build may run"
        if functions
        else "",
        off=bool(pre_grad),
    )
    gradient_build_seconds = time.perf_counter() - start

    start = time.perf_counter()
    if save_prefix:
        with open(f"{save_prefix}_optimized_{mode}.onnx", "wb") as f:
            f.write(gradient.model)
    with executed_model(save_prefix, mode, bool(info.fed_params)) as executed:
        session = open_session(
            gradient.model,
            device,
            options,
            training=True,
            deterministic=deterministic,
            optimized_path=executed,
            memory=memory,
            graph_optimizations=not builder_optimized_is_enough(info, device, memory, probe),
        )
        owned = _owned_gradients(executed) if info.fed_params else frozenset()
    feeds = [*gradient.user_input_names, *gradient.initializer_names]
    ours = [i.name for i in info.inputs]
    if feeds != ours:
        raise OrtfxInitError(
            f"ORT orders the graph inputs as {feeds}, ortfx as {ours}; "
            "this is an ortfx bug, please report it."
        )
    fetches = [o.name for o in session.get_outputs()]
    # ORT numbers the outputs it kept; ortfx's numbering has the folded guards too.
    kept = [k for k, name in enumerate(info.output_names) if name not in gradient.folded]
    constants = {
        k: _guard_constant(info, k, device)
        for k, name in enumerate(info.output_names)
        if name in gradient.folded
    }
    _, ort_device = providers_for(device)
    # The device lists must match ORT's own counts exactly: a short list aborts the process.
    n_forward = gradient.forward_outputs
    agent = C.TrainingAgent(
        session._sess, feeds, [ort_device] * n_forward, fetches, [ort_device] * len(fetches), 0
    )
    return TrainingRunner(
        info=info,
        session=session,
        agent=agent,
        gradient_build_seconds=gradient_build_seconds,
        session_seconds=time.perf_counter() - start,
        non_differentiable=frozenset(
            {kept[k] for k in gradient.non_differentiable} | set(constants)
        ),
        full_shape=frozenset(kept[k] for k in gradient.full_shape),
        saved_outputs=tuple(kept[k] for k in gradient.saved_outputs),
        constants=tuple(sorted(constants.items())),
        grad_slots=tuple(
            k
            for k, spec in enumerate(info.inputs)
            if spec.requires_grad and spec.name not in gradient.unreachable
        ),
        guarded_inputs=_guarded_inputs(info),
        user_slots=tuple(k for k, spec in enumerate(info.inputs) if spec.kind is InputKind.USER),
        python_ops=bool(functions),
        compute_optimizer_failure=gradient.compute_optimizer_failure,
        releases_torch_threads=releases_torch_threads(options, device),
        trigger_slot=next(
            (k for k, spec in enumerate(info.inputs) if spec.kind is InputKind.TRIGGER), None
        ),
        owned_grads=owned,
        replay_refused=replay.refusal(info, python_ops=bool(functions)),
        inner_outputs=_inner_outputs(
            info, {kept[k] for k in gradient.non_differentiable} | set(constants)
        ),
    )


def _gradient(
    info: PostExportProcessedModelInfo, config: Any, options: Options, pre_grad: str | None
) -> disk_cache.Gradient:
    """ORT's gradient graph of ``info``'s graph, after ``for_gradient``."""
    from ortfx import passes

    failure: str | None = None
    n_outputs = len(info.output_names)
    guard_outputs = frozenset(info.output_names[n_outputs - len(info.guards) :])
    try:
        built = _build_reachable(
            info.model, config, options.enable_compute_optimizer, pre_grad, guard_outputs
        )
    except Exception as e:
        if not options.enable_compute_optimizer:
            raise build_failed(info.model, e) from e
        # ORT 1.19's compute optimizer crashes on some graphs (e.g. logits sliced before
        # the loss) that build fine without it.
        failure = first_line(e)
        try:
            built = _build_reachable(info.model, config, False, pre_grad, guard_outputs)
        except Exception as again:
            raise build_failed(info.model, again) from again
    builder, unreachable = built.builder, built.unreachable
    gi = builder.get_graph_info()
    return disk_cache.Gradient(
        model=passes.for_gradient(
            builder.get_gradient_model(),
            fed_params=bool(info.fed_params),
            forward=info.model,
            layerwise=options.zero3_layerwise,
        ),
        user_input_names=tuple(gi.user_input_names),
        initializer_names=tuple(gi.initializer_names),
        forward_outputs=len(gi.user_output_names) + len(gi.frontier_node_arg_map),
        non_differentiable=tuple(gi.output_grad_indices_non_differentiable),
        full_shape=tuple(gi.output_grad_indices_require_full_shape),
        saved_outputs=tuple(gi.module_output_indices_requires_save_for_backward),
        unreachable=tuple(sorted(unreachable)),
        folded=tuple(sorted(built.folded)),
        compute_optimizer_failure=failure,
    )


def _inner_outputs(info: PostExportProcessedModelInfo, skip: Iterable[int]) -> tuple[int, ...]:
    """The positions of the outputs that also pass a gradient inside the forward graph to
    another output (not through sizes, comparisons or a detach; ``skip``: outputs that take no
    gradient). An output copied by an Identity, a clone, gets only its own gradient, as in
    eager."""
    names = info.output_names
    skipped = set(skip)
    found = []
    for k, name in enumerate(names):
        others = [n for j, n in enumerate(names) if j != k and j not in skipped and n != name]
        if others and function_grads.receives_gradient(info.model, name, others):
            found.append(k)
    return tuple(found)


def _guard_constant(
    info: PostExportProcessedModelInfo, position: int, device: torch.device
) -> torch.Tensor:
    """The tensor a guard output that ORT folded would give: its baked value."""
    guard = info.guards[position - (len(info.output_names) - len(info.guards))]
    output = onnx.load_model_from_string(info.model).graph.output[position]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(output.type.tensor_type.elem_type)
    value = float(guard.value[1]) if guard.value[0] == "float" else ast.literal_eval(guard.value[1])
    return torch.from_numpy(np.array(value, dtype=dtype)).to(device)


def _owned_gradients(path: str | None) -> frozenset[int]:
    """:func:`ortfx.passes.owned_gradients` over the graph the session runs (after ORT's own
    transformers, which decide what aliases what); none if ORT saved no graph."""
    from ortfx import passes

    if path is None or not os.path.exists(path):
        return frozenset()
    return passes.owned_gradients(onnx.load(path, load_external_data=False), memgrad.FUNCTION_NAME)
