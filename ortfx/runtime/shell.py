"""The call path: functions ``(shell, module, args, kwargs) -> (result, new shell)``.

A :class:`Shell` is the whole state of one wrapper, frozen. :func:`call` runs one forward: the
fallback gate, then :func:`run`, a bounded loop of :func:`attempt` s; an attempt takes the fast
path (same kind of call as the last one) or the slow one (key, decide, realize) and then
:func:`execute` s the graph in ORT. Recoveries (a dynamic scalar found baked in, parameters
changed behind the wrapper, the exporter switch) return :class:`Retry` with a new shell instead
of recursing, so the bound on them is visible in :func:`run`. Nothing here mutates a shell: the
façade (:mod:`ortfx.runtime.module`) commits the shell a call returns, or the one a failed call
carries in :class:`CallFailed`.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import sys
import warnings
from collections.abc import Hashable, Sequence
from typing import Any, TypeAlias

import attrs
import onnx
import optree
import torch

from ortfx import io, memory, module_state, passes
from ortfx._torch import any_autocast, in_functorch_transform
from ortfx.errors import (
    BUFFER_REQUIRES_GRAD,
    FUNCTORCH_TRANSFORM,
    INPUT_CHANGED_IN_PLACE,
    INPUT_ON_OTHER_DEVICE,
    NO_GRADIENT_GRAPH,
    NO_TRAINING_GRAPH,
    OUTPUT_DTYPE_CHANGED,
    PINNED_SIZES_CHANGED,
    STATIC_SIZES_SESSION,
    STRICT_TRACING_REFUSED,
    TOO_MANY_RECOVERIES,
    OrtfxDeviceError,
    OrtfxEmptyTensorError,
    OrtfxError,
    OrtfxExportError,
    OrtfxInitError,
    OrtfxIOError,
    OrtfxRuntimeError,
    OrtfxTorchModelError,
    OrtfxWarning,
)
from ortfx.export import (
    BRANCH,
    Exported,
    export,
    exporting,
    raise_if_pytorch_raises,
    resolve_exporter,
)
from ortfx.io import STATIC_TYPES
from ortfx.memory import MemoryPlan
from ortfx.model_info import InputKind, PostExportProcessedModelInfo
from ortfx.options import FallbackPolicy, Options
from ortfx.runtime import disk_cache, events, logs, memgrad, watch
from ortfx.runtime.autograd import RunORT
from ortfx.runtime.logs import WrapperLog
from ortfx.runtime.session import (
    InferenceRunner,
    Timings,
    TrainingRunner,
    open_inference,
    open_training,
    session_settings,
)
from ortfx.runtime.watch import Fingerprint, Tracked
from ortfx.schema import ModelSchema, TensorSpec, leaf_spec, tensorize_scalars
from ortfx.transitions import (
    REPEATED_REEXPORT,
    Call,
    CallContext,
    Decision,
    ExportState,
    GradState,
    Reason,
    Reexport,
    Reuse,
    Transition,
    apply,
    bump_module_version,
    count_failure,
    count_reuse,
    decide,
    decision_name,
    make_call,
    note_fallback_call,
    note_session,
    replace_payload,
    resolve,
    signature,
    start_fallback,
    traced_for_grad_flags,
    traced_for_grad_mode,
)

VERSIONS = (torch.__version__, onnx.__version__)

# At most this many recoveries (each a different cause) before a call gives up.
MAX_RECOVERIES = 3

# Training sessions kept per graph whose gradient needs concrete sizes (one per input size).
SIZED_RUNNERS = 4


@attrs.frozen
class Compiled:
    """The shell's artifacts for one cache entry: the processed graph and its runners.

    Runners are built on first use; the new record replaces the old one in the state
    (:func:`~ortfx.transitions.replace_payload`), so nothing in the state is changed in place.
    """

    info: PostExportProcessedModelInfo
    timings: Timings
    fingerprint: Fingerprint
    training: TrainingRunner | None = None
    inference: InferenceRunner | None = None
    ran: bool = False  # ORT ran this graph once: a later shape failure means baked sizes
    memory: tuple[MemoryPlan, ...] | None = None  # the recompute report, once known
    dims: tuple[tuple[str, int], ...] = ()  # input dim name -> size when the runner was built
    # For a graph with static_size_ops: the user input sizes ``training`` was built for, and
    # the most recent runners per size (most recent last, at most SIZED_RUNNERS).
    sizes: tuple[tuple[int, ...], ...] = ()
    sized: tuple[tuple[tuple[tuple[int, ...], ...], TrainingRunner], ...] = ()
    # Why ORT could not build this eval-mode graph's gradient (its calls with grad run forward)
    forward_only: str = ""
    # Input sizes whose empty outputs PyTorch was found to give too (see _check_empty_outputs)
    empty_checked: frozenset[tuple[tuple[int, ...], ...]] = frozenset()
    # The export call's input sizes, when the graph returns Python numbers the user's code
    # computed from tensors (``int(x.shape[0])``): they hold only for these sizes.
    pinned_sizes: tuple[tuple[int, ...], ...] | None = None
    # The attributes its traced forward set (see Traced.writes).
    writes: tuple[tuple[int, str], ...] = ()


@attrs.frozen
class FastPath:
    """What the slow path leaves for the next call: the signature it keyed on and its call."""

    signature: tuple[Any, ...]
    call: Call


@attrs.frozen
class Shell:
    """The whole state of one wrapper; the façade holds exactly one and swaps it whole."""

    options: Options
    exporter: str  # the exporter in use ("auto" resolved; may be switched to "dynamo")
    state: ExportState[Compiled]
    tracked: Tracked | None = None
    watched: frozenset[int] = frozenset()  # ids of the modules in the wrapped tree
    baked: frozenset[str] = frozenset()  # dynamic scalar paths found baked into a graph
    fast: FastPath | None = None
    said: frozenset[str] = frozenset()  # one-time warnings already given

    @classmethod
    def create(cls, options: Options) -> Shell:
        return cls(options, resolve_exporter(options.exporter), ExportState(options.cache_size))

    def with_state(self, state: ExportState[Compiled]) -> Shell:
        """``attrs.evolve(self, state=state)``, spelled out for the fast path."""
        return Shell(
            options=self.options,
            exporter=self.exporter,
            state=state,
            tracked=self.tracked,
            watched=self.watched,
            baked=self.baked,
            fast=self.fast,
            said=self.said,
        )

    @property
    def log(self) -> WrapperLog:
        return logs.wrapper_log(self.options.log_level)

    def configured(self, options: Options, *, exporter_changed: bool) -> Shell:
        """The shell with new options; the cache is resized, an exporter switched automatically
        is kept unless the exporter itself is among the changes."""
        state = self.state
        if state.maxsize != options.cache_size:
            state = attrs.evolve(
                state, maxsize=options.cache_size, entries=state.entries[-options.cache_size :]
            )
        exporter = resolve_exporter(options.exporter) if exporter_changed else self.exporter
        return attrs.evolve(self, options=options, exporter=exporter, state=state, fast=None)


def rebase(result: Shell, *, base: Shell, current: Shell) -> Shell:
    """``result`` (computed from ``base``) with what was committed meanwhile (``current``)
    applied on top, so that no commit is lost: invalidations (a new module version), options
    (``configure``), a forgotten view of the module (``.to()``), a permanent fallback. What
    another call on another thread cached meanwhile is not merged (it is built again if
    needed); nothing that makes a graph stale is dropped."""
    if current.state.module_version.number != base.state.module_version.number:
        result = invalidate(result, current.state.module_version.cause)
    if current.options != base.options:
        result = result.configured(
            current.options, exporter_changed=current.options.exporter != base.options.exporter
        )
    if current.tracked is None and base.tracked is not None:
        result = attrs.evolve(result, tracked=None, fast=None)
    if current.state.fallbacks != base.state.fallbacks:
        fallbacks = tuple(dict.fromkeys((*result.state.fallbacks, *current.state.fallbacks)))
        state = attrs.evolve(result.state, fallbacks=fallbacks)
        result = attrs.evolve(result, state=state, fast=None)
    return result


def invalidate(shell: Shell, cause: str) -> Shell:
    """A new module version: every cached graph becomes unreachable; track the module again."""
    return attrs.evolve(
        shell, state=bump_module_version(shell.state, cause), tracked=None, fast=None
    )


@attrs.frozen
class Traced:
    """What an export found the forward depending on, beyond its key (a graph from the disk
    cache depends on none of these: such graphs are never stored)."""

    numbers_from_tensors: bool = False  # the trace turned tensors into Python numbers
    reads_grad_mode: bool = False  # the module asked torch.is_grad_enabled()
    reads_grad_flags: bool = False  # the forward read requires_grad of inputs or parameters
    # (module id, name) of the public attributes the forward set while traced: the graph
    # cannot follow them (warned), and later writes of them are no change behind it.
    writes: tuple[tuple[int, str], ...] = ()


@attrs.frozen
class Retry:
    """An attempt found something to repair; the next attempt starts from ``shell``."""

    shell: Shell
    cause: str


class CallFailed(Exception):
    """Carries a failed call's exception to the façade with the shell to commit."""

    def __init__(self, error: BaseException, shell: Shell) -> None:
        super().__init__(error)
        self.error = error
        self.shell = shell


Outcome: TypeAlias = "tuple[Any, Shell] | Retry"


# ---- fallback ----------------------------------------------------------------------------------

# The fallback key of failures that no later call can fix (unsupported module, no ORT).
ALWAYS = "every call"

# Which policy flag allows falling back from which error (first match wins).
_FALLBACK_FLAGS: tuple[tuple[type[OrtfxError], FallbackPolicy], ...] = (
    (OrtfxIOError, FallbackPolicy.UNSUPPORTED_DATA),
    (OrtfxDeviceError, FallbackPolicy.UNSUPPORTED_DEVICE),
    (OrtfxTorchModelError, FallbackPolicy.UNSUPPORTED_TORCH_MODEL),
    (OrtfxExportError, FallbackPolicy.UNSUPPORTED_ONNX_MODEL),
    (OrtfxRuntimeError, FallbackPolicy.UNSUPPORTED_ONNX_MODEL),
    (OrtfxError, FallbackPolicy.BAD_INITIALIZATION),
)


def fallback_key(
    args: tuple[Any, ...], kwargs: dict[str, Any], module: torch.nn.Module | None = None
) -> Hashable:
    """What makes a call "the same" for fallback: structure, static values, tensor kinds, the
    autocast state, the default dtype, whether a torch.func transform or inference mode is
    active, grad mode and the module's train/eval mode (a call under torch.autocast, vmap or
    in eval mode that fell back says nothing about a training call)."""
    leaves, spec = io.flatten(io.call_tree(args, kwargs))
    # The device too: one input on 'meta' must not send later CPU calls to PyTorch.
    kinds = tuple(
        (leaf_spec(x), x.device.type)
        if isinstance(x, torch.Tensor)
        else leaf_spec(x)
        if isinstance(x, STATIC_TYPES)
        else type(x)
        for x in leaves
    )
    autocast = tuple(_autocast(torch.device(kind)) for kind in ("cpu", "cuda"))
    modes = (
        _default_dtype(),
        in_functorch_transform(),
        torch.is_inference_mode_enabled(),
        torch.is_grad_enabled(),
        None if module is None else module.training,
    )
    return (spec, kinds, autocast, modes)


def fall_back(
    shell: Shell, error: OrtfxError, *, key: Hashable, retry: bool = True, during_call: bool = True
) -> Shell:
    """Calls like this one run in PyTorch from now on, if the policy allows; else re-raise."""
    flag = next(f for t, f in _FALLBACK_FLAGS if isinstance(error, t))
    options = shell.options
    if not options.fallback_policy.allows(flag):
        raise error
    reason = f"{type(error).__name__}: {str(error).rstrip('.')}"
    later = (
        "a call with a new input schema will try ONNX Runtime again"
        if retry and options.fallback_retry
        else "every later call runs in PyTorch"
    )
    logs.fallback(shell.log, flag, reason, later=later)
    state = start_fallback(shell.state, key, reason, during_call=during_call)
    return attrs.evolve(shell, state=state, fast=None)


def _fallback_reason(
    shell: Shell, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    state = shell.state
    key = ALWAYS if state.fallbacks[0][0] is ALWAYS else fallback_key(args, kwargs, module)
    reason = state.fallback_reason(key)
    if reason is None and not shell.options.fallback_retry:
        reason = state.fallbacks[-1][1]
    return reason


def _in_torch(
    shell: Shell, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Shell]:
    try:
        result = module(*args, **kwargs)
    except BaseException as error:
        raise CallFailed(error, _attributes_seen(shell)) from None
    return result, _attributes_seen(shell)


def _attributes_seen(shell: Shell) -> Shell:
    """The shell after the forward ran in eager inside this call: the module's attribute
    writes there are its own (as in eager), not a change behind a graph."""
    if shell.tracked is None:
        return shell
    return attrs.evolve(shell, tracked=shell.tracked.with_fresh_attributes())


# ---- one call ----------------------------------------------------------------------------------


def call(
    shell: Shell, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Shell]:
    """Run ``module(*args, **kwargs)`` in ORT (or in PyTorch, as the fallback policy says).

    Returns the result and the shell to commit; raises :class:`CallFailed` otherwise.
    """
    if exporting():
        # Called from a forward that ortfx is exporting (a nested ORTModule): plain code, so
        # the outer graph takes this module in.
        return _in_torch(shell, module, args, kwargs)
    if shell.state.fallbacks:
        reason = _fallback_reason(shell, module, args, kwargs)
        if reason is not None:
            shell = attrs.evolve(shell, state=note_fallback_call(shell.state, reason))
            return _in_torch(shell, module, args, kwargs)
    try:
        if in_functorch_transform():
            raise OrtfxIOError(FUNCTORCH_TRANSFORM)
        return run(shell, module, args, kwargs)
    except OrtfxEmptyTensorError as error:
        # Only this call: an empty batch says nothing about the next one.
        logs.empty_batch(shell.log, str(error))
        reason = f"{type(error).__name__}: {error}"
        return _in_torch(
            shell.with_state(note_fallback_call(shell.state, reason)), module, args, kwargs
        )
    except OrtfxError as error:
        failed = attrs.evolve(shell, state=count_failure(shell.state))
        try:
            fallen = fall_back(shell, error, key=fallback_key(args, kwargs, module))
        except OrtfxError:
            raise CallFailed(error, failed) from None
        return _in_torch(fallen, module, args, kwargs)
    except BaseException as error:
        raise CallFailed(error, attrs.evolve(shell, state=count_failure(shell.state))) from None


def run(
    shell: Shell, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Shell]:
    """The fast path if it applies, else attempts; repair and attempt again at most
    :data:`MAX_RECOVERIES` times."""
    leaves, spec = io.flatten(io.call_tree(args, kwargs))
    fast, tracked, state = shell.fast, shell.tracked, shell.state
    if (
        fast is not None
        and tracked is not None
        and state.entries
        and state.entries[-1].key is fast.call.key
        and not tracked.replaced()
        and not tracked.moved()
        and tracked.clock == watch.hook_clock()
        and not tracked.hooks_removed()
        and not tracked.buffer_grad_changed()
        and not tracked.attributes_changed()
        and not tracked.configs_differ()
        and fast.signature == _signature(leaves, spec, module, state, tracked)
    ):
        # Steady state: the same kind of call as the last one, whose entry is still the most
        # recent. The signature the slow path left stands in for schema, Call and decide.
        entry = state.entries[-1]
        outcome = execute(
            shell, module, leaves, tracked, fast.call, entry.payload, count_reuse(state)
        )
        if not isinstance(outcome, Retry):
            return outcome
        shell = outcome.shell
    causes: list[str] = []
    for _ in range(MAX_RECOVERIES + 1):
        outcome = attempt(shell, module, args, kwargs, leaves, spec)
        if not isinstance(outcome, Retry):
            return outcome
        shell = outcome.shell
        causes.append(outcome.cause)
    raise OrtfxRuntimeError(TOO_MANY_RECOVERIES.format(count=len(causes), causes="; ".join(causes)))


def track(shell: Shell, module: torch.nn.Module) -> tuple[Shell, Tracked]:
    """The shell with a current view of the module's tensors."""
    tracked = shell.tracked
    if tracked is not None and tracked.replaced():
        shell = invalidate(shell, "the parameters were replaced outside the wrapper")
        tracked = None
    if tracked is not None and (tracked.clock != watch.hook_clock() or tracked.hooks_removed()):
        cause = tracked.hooks_change()
        if cause is not None:
            shell = invalidate(shell, cause)
            tracked = None
        else:  # a hook elsewhere in the process: this tree's graphs stand
            tracked = tracked.with_fresh_hooks()
            shell = attrs.evolve(shell, tracked=tracked, fast=None)
    if tracked is not None and tracked.attributes_changed():
        assert tracked.attributes is not None
        cause = tracked.attributes.cause()
        if cause is not None:
            shell = invalidate(shell, cause)
            tracked = None
        else:  # private names or objects only: the traced attributes stand
            tracked = tracked.with_fresh_attributes()
            shell = attrs.evolve(shell, tracked=tracked, fast=None)
    if tracked is not None and tracked.configs_differ():
        cause = tracked.config_change()
        if cause is not None:
            shell = invalidate(shell, cause)
            tracked = None
        else:  # metadata only: the graphs stand; compare against the new values from now on
            tracked = tracked.with_fresh_configs()
            shell = attrs.evolve(shell, tracked=tracked, fast=None)
    if tracked is not None and tracked.buffer_grad_changed():
        tracked = None  # a buffer's flag moved: take the view again (checked in attempt)
    if tracked is None or tracked.moved():
        tracked = watch.track(module)
        shell = attrs.evolve(shell, tracked=tracked, watched=watch.module_ids(module))
    return shell, tracked


def attempt(
    shell: Shell,
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    leaves: list[Any],
    spec: optree.PyTreeSpec,
) -> Outcome:
    """The slow path: key, decide, realize, then execute."""
    shell, tracked = track(shell, module)
    state = shell.state
    io.check_leaves(leaves, spec, root="call", where="input")
    # ZeRO-3 partitioned parameters need ortfx's hooks; imported late: the hooks import this.
    from ortfx.hooks.zero3 import check_partitioned

    check_partitioned(module, tracked.named_tensors)
    if tracked.buffer_grad and torch.is_grad_enabled():
        name = tracked.buffer_requiring_grad()
        raise OrtfxTorchModelError(BUFFER_REQUIRES_GRAD.format(name=name))
    fed, tensorized = _tensorize(shell, leaves, spec)
    call = resolve(state, make_call(fed, spec, _context(shell, module, tracked)))
    _check_input_devices(fed, call.key.schema, tracked.device)
    decision = decide(state, call)
    events.emit("decide", call, decision)
    if isinstance(decision, Reuse):
        hit = state.lookup(call.key)
        assert hit is not None
        compiled = hit.payload
    else:
        compiled, call = realize(shell, module, decision, call, fed, tracked, args, kwargs)
        baked = _baked_dynamic_scalars(compiled.info, call.key.schema, tensorized)
        if baked:
            # The module turned these tensors back into Python values (range(n), if n):
            # the graph holds the export-time value. Correctness first: make them static.
            logs.baked_scalars(shell.log, baked)
            return Retry(
                attrs.evolve(shell, baked=shell.baked | set(baked), fast=None),
                f"{', '.join(baked)} baked in",
            )
    if compiled.writes:
        # The forward's own writes (warned): never a change behind its graph.
        tracked = tracked.with_fresh_attributes(compiled.writes)
        shell = attrs.evolve(shell, tracked=tracked)
    new_state = apply(state, call, decision, compiled)
    result = execute(shell, module, fed, tracked, call, compiled, new_state)
    if isinstance(result, Retry):
        return result
    output, after = result
    after = _attributes_seen(after)  # the export's own writes (warned) are the new baseline
    if shell.options.dynamic_scalars:
        return output, after
    if after.state.entries[-1].key is call.key:
        now = _signature(leaves, spec, module, state, tracked)
        after = attrs.evolve(after, fast=FastPath(now, call))
    return output, after


def _signature(
    leaves: list[Any],
    spec: optree.PyTreeSpec,
    module: torch.nn.Module,
    state: ExportState[Compiled],
    tracked: Tracked,
) -> tuple[Any, ...]:
    return signature(
        leaves,
        spec,
        module.training,
        state.module_version.number,
        tracked.requires_grad(),
        torch.are_deterministic_algorithms_enabled(),
        tracked.device,
        torch.is_grad_enabled(),
        tracked.modes(),
        _autocast(tracked.device),
        # The dtype object itself: equal exactly when the name in the key is.
        torch.get_default_dtype(),
    )


def _default_dtype() -> str:
    return str(torch.get_default_dtype()).removeprefix("torch.")


def _autocast(device: torch.device) -> str | None:
    """The dtype torch.autocast runs ``device``'s ops in, or None when it is off there."""
    if not any_autocast():  # one cheap question on every steady-state call
        return None
    kind = device.type
    try:
        if not torch.is_autocast_enabled(kind):
            return None
    except RuntimeError:  # a device type autocast does not know ('meta'): no autocast there
        return None
    return str(torch.get_autocast_dtype(kind)).removeprefix("torch.")


def _context(shell: Shell, module: torch.nn.Module, tracked: Tracked) -> CallContext:
    options = shell.options
    return CallContext(
        # The user module's own flag: model.module.eval() must take effect too.
        training=module.training,
        module_version=shell.state.module_version,
        export_options=options.export_options(shell.exporter),
        versions=VERSIONS,
        param_names=tracked.param_names,
        params_requiring_grad=tracked.requires_grad(),
        memory=(options.memory_opt_level, options.memory_opt_config),
        device=str(tracked.device),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        settings=session_settings(options),
        mem_efficient_grad=options.enable_mem_efficient_grad_management,
        grad_enabled=torch.is_grad_enabled(),
        other_mode=tracked.other_mode(module.training),
        autocast=_autocast(tracked.device),
        default_dtype=_default_dtype(),
    )


def _tensorize(
    shell: Shell, leaves: list[Any], spec: optree.PyTreeSpec
) -> tuple[list[Any], tuple[int, ...]]:
    """The leaves as fed to the graph (dynamic scalars as tensors) and which were tensorized."""
    dynamic = frozenset(shell.options.dynamic_scalars)
    if not dynamic:
        return leaves, ()
    fed = tensorize_scalars(leaves, spec, paths=dynamic)
    if shell.baked:
        # Leaves found baked in stay Python values (see _baked_dynamic_scalars).
        paths = io.leaf_paths(spec, root="call")
        fed = [leaves[i] if paths[i] in shell.baked else leaf for i, leaf in enumerate(fed)]
    tensorized = tuple(i for i, (a, b) in enumerate(zip(leaves, fed, strict=True)) if a is not b)
    return fed, tensorized


def _check_input_devices(leaves: list[Any], schema: ModelSchema, device: torch.device) -> None:
    for i, spec in enumerate(schema.leaves):
        if isinstance(spec, TensorSpec) and leaves[i].device != device:
            raise OrtfxDeviceError(
                INPUT_ON_OTHER_DEVICE.format(
                    path=schema.paths[i], given=str(leaves[i].device), expected=str(device)
                )
            )


def _baked_dynamic_scalars(
    info: PostExportProcessedModelInfo, schema: ModelSchema, tensorized: tuple[int, ...]
) -> list[str]:
    """Paths of scalars fed as tensors that the graph does not consume: their value was
    turned back into a Python value while traced, and so baked in."""
    if not tensorized:
        return []
    model = onnx.load_model_from_string(info.model)
    consumed = {name for node in model.graph.node for name in node.input}
    fed = {spec.source: spec.name for spec in info.inputs if spec.kind is InputKind.USER}
    return [schema.paths[i] for i in tensorized if fed.get(i) not in consumed]


# ---- realize: the effectful part of a transition -----------------------------------------------


def realize(
    shell: Shell,
    module: torch.nn.Module,
    decision: Decision,
    call: Call,
    leaves: list[Any],
    tracked: Tracked,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Compiled, Call]:
    """Export (or reuse an entry's graph for a new session); the old state stays valid if this
    raises. The call comes back with the key its entry gets (grad mode added when the export
    found the module asking for it)."""
    assert not isinstance(decision, Reuse)
    timings = Timings()
    pinned: tuple[tuple[int, ...], ...] | None = None
    writes: tuple[tuple[int, str], ...] = ()
    if isinstance(decision, Reexport):
        # Bind first: a wrong call raises the same TypeError PyTorch would, before export.
        inspect.signature(module.forward).bind(*args, **kwargs)
        info, timings, traced = _export(shell, module, call, leaves)
        writes = traced.writes
        if traced.numbers_from_tensors and _returns_numbers(info):
            pinned = _tensor_sizes(leaves, call)
            logs.sizes_pinned(shell.log, pinned)
        if traced.reads_grad_mode:  # the entry serves calls in this grad mode only
            call = traced_for_grad_mode(call)
            logs.grad_mode_traced(shell.log, call.grad_enabled)
        if traced.reads_grad_flags:  # the entry serves calls with these flags only
            call = traced_for_grad_flags(call)
            logs.grad_flags_traced(shell.log)
    else:
        entry = shell.state.lookup(call.key)
        assert entry is not None
        info, pinned = entry.payload.info, entry.payload.pinned_sizes
    state = shell.state
    first = state.stats.exports == 0 and isinstance(decision, Reexport)
    line = str(
        Transition(state.stats.calls, decision_name(decision, first=first), decision.reasons)
    )
    logs.transition(shell.log, line, timings.render() if timings.export else "")
    return (
        Compiled(info, timings, tracked.fingerprint(), pinned_sizes=pinned, writes=writes),
        call,
    )


def _returns_numbers(info: PostExportProcessedModelInfo) -> bool:
    kinds = {spec.kind for spec in info.output_schema.leaves}
    return bool(kinds & {"int", "float", "bool"})


def _tensor_sizes(leaves: Sequence[Any], call: Call) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(leaves[i].shape) for i in call.key.schema.tensor_indices())


def _sizes_changed(
    shell: Shell, compiled: Compiled, leaves: Sequence[Any], call: Call
) -> Retry | None:
    """A graph pinned to its export's sizes, called with others: export again for these."""
    pinned = compiled.pinned_sizes
    if pinned is None:
        return None
    sizes = _tensor_sizes(leaves, call)
    if sizes == pinned:
        return None
    cause = PINNED_SIZES_CHANGED.format(before=list(map(list, pinned)), now=list(map(list, sizes)))
    return Retry(invalidate(shell, cause), cause)


LAYERDROP_REFUSED = (
    "{module} uses LayerDrop in training ({where}.layerdrop = {p}): each step draws whether to "
    "skip a layer and branches on it in Python, which a traced graph would decide once, at "
    "export, for every later step. ortfx does not train it in ORT; set layerdrop to 0 (e.g. "
    "model.config.layerdrop = 0.0) to train in ORT, or let the fallback policy run it in "
    "PyTorch (the default does). Evaluation is unaffected."
)


def _refuse_layerdrop(module: torch.nn.Module) -> None:
    """LayerDrop (transformers' ``config.layerdrop``, an attribute ``layerdrop`` of a module):
    a random Python branch per layer and step, which no exported graph can carry."""
    for name, sub in module.named_modules():
        path = name or type(module).__name__
        holders = ((f"{path}.config", getattr(sub, "config", None)), (path, sub))
        for where, holder in holders:
            p = getattr(holder, "layerdrop", None)
            if isinstance(p, float | int) and not isinstance(p, bool) and p > 0 and sub.training:
                raise OrtfxTorchModelError(
                    LAYERDROP_REFUSED.format(module=type(module).__name__, where=where, p=p)
                )


def _export(
    shell: Shell, module: torch.nn.Module, call: Call, leaves: list[Any]
) -> tuple[PostExportProcessedModelInfo, Timings, Traced]:
    """The processed graph, the export's timings, and what the trace depended on."""
    from ortfx.hooks.zero3 import gathered_for_export  # late: the hooks import this module

    log = shell.log
    if call.key.training:
        _refuse_layerdrop(module)
    padding = _embedding_padding(module)
    dynamic = frozenset(shell.options.dynamic_scalars)
    cached = _from_disk_cache(shell, module, call, padding, dynamic)
    if isinstance(cached, PostExportProcessedModelInfo):
        return cached, Timings(), Traced()
    # ZeRO-3 phase 2 partitions the weights between layers: the trace needs them whole.
    # Muted: a forward that reassigns a buffer while traced is not a module change.
    with gathered_for_export(module):
        source = copy.deepcopy(module) if shell.options.deepcopy_before_export else module
        with watch.muted(module):
            exported = export(source, leaves, call.key.schema, call.key.options, call.grad_enabled)
    writes = exported.writes
    if writes:
        logs.traced_writes(log, module_state.described(writes))
    if exported.checkpoint_calls:
        logs.checkpoint_calls(log, exported.checkpoint_calls, shell.options.memory_opt_level)
    hooked = watch.user_forward_hooks(module)
    if hooked:
        logs.traced_hooks(log, hooked)
    # Imported here: ortfx.aten builds on the TorchScript exporter, which may be missing.
    from ortfx import aten

    routed = aten.routed_ops(exported.info.model)  # ops run by torch inside the graph
    if routed:
        logs.ops_in_torch(log, routed)
    if exported.tracer_warnings:
        if call.key.options.strict_tracing:
            raise OrtfxExportError(
                STRICT_TRACING_REFUSED.format(
                    count=len(exported.tracer_warnings),
                    module=type(module).__name__,
                    first=exported.tracer_warnings[0].removeprefix("branch: "),
                )
            )
        logs.tracer_baked(
            log, exported.tracer_warnings, dynamic=bool(shell.options.dynamic_scalars)
        )
    info = passes.for_export(padding, dynamic)(exported.info)
    events.emit("export", info)
    if cached is not None:
        _to_disk_cache(
            log,
            cached,
            exported,
            info,
            dynamic_scalars=bool(shell.options.dynamic_scalars),
            writes=bool(writes),
        )
    prefix = logs.save_prefix(shell.options)
    mode = "training" if call.key.training else "inference"
    logs.save_onnx(prefix, "torch_exported", mode, exported.info.model)
    logs.save_onnx(prefix, "post_processed", mode, info.model)
    timings = Timings(export=exported.seconds)
    traced = Traced(
        exported.numbers_from_tensors,
        exported.reads_grad_mode,
        exported.reads_grad_flags,
        tuple((id(m), name) for m, name in writes),
    )
    return info, timings, traced


def _from_disk_cache(
    shell: Shell,
    module: torch.nn.Module,
    call: Call,
    padding: dict[str, int],
    dynamic: frozenset[str],
) -> PostExportProcessedModelInfo | disk_cache.Slot | None:
    """The graph from ``Options.cache_dir`` if it holds this key's entry; else where to store
    it (None: no cache, or this key cannot be cached)."""
    if not shell.options.cache_dir:
        return None
    log = shell.log
    slot = disk_cache.slot(shell.options.cache_dir, module, call.key, padding, dynamic)
    if slot.path is None:
        log.log(logging.INFO, disk_cache.CACHE_SKIPPED, slot.refused)
        return None
    entry = disk_cache.load(slot.path, log)
    if entry is None:
        log.log(logging.INFO, disk_cache.CACHE_MISS, slot.path)
        events.emit("disk_cache", "miss", slot.path)
        return slot
    log.log(logging.INFO, disk_cache.CACHE_HIT, slot.path)
    events.emit("disk_cache", "hit", slot.path)
    if entry.checkpoint_calls:
        logs.checkpoint_calls(log, entry.checkpoint_calls, shell.options.memory_opt_level)
    # This call's schema: its requires_grad flags and root are not part of the digest.
    return attrs.evolve(entry.info, input_schema=call.key.schema)


def _to_disk_cache(
    log: WrapperLog,
    slot: disk_cache.Slot,
    exported: Exported,
    info: PostExportProcessedModelInfo,
    *,
    dynamic_scalars: bool,
    writes: bool = False,
) -> None:
    # Correctness first: a PythonOp names a Python class whose code the digest does not cover;
    # a branch on tensor values or a Python number taken from a tensor came from this run's
    # tensors, not from the key. Values computed from sizes (transformers' mask code) are as
    # safe here as in the in-memory cache, which reuses the graph for every size.
    branches = [w for w in exported.tracer_warnings if w.startswith(BRANCH)]
    refused = (
        f"the graph runs custom autograd Functions ({', '.join(exported.custom_functions)})"
        if exported.custom_functions
        else "the graph returns Python numbers computed from tensors"
        if exported.numbers_from_tensors
        else "the module reads torch.is_grad_enabled(), so the graph depends on grad mode"
        if exported.reads_grad_mode
        else "the forward reads requires_grad of its inputs or parameters"
        if exported.reads_grad_flags
        else f"the tracer baked in a branch on tensor values ({branches[0]})"
        if branches
        else "the tracer baked in values while scalars are fed as tensors (dynamic_scalars)"
        if exported.tracer_warnings and dynamic_scalars
        # A warm start would skip the forward's Python, and with it the exporting call's
        # writes and the WARNING that names them.
        else "the forward sets attributes of its modules"
        if writes
        else ""
    )
    if refused:
        log.log(logging.INFO, disk_cache.CACHE_SKIPPED, refused)
        return
    assert slot.path is not None
    disk_cache.store(slot.path, disk_cache.Entry(info, exported.checkpoint_calls), log)


def _embedding_padding(module: torch.nn.Module) -> dict[str, int]:
    """Parameter name -> padding_idx of every nn.Embedding that has one."""
    names = {id(p): n for n, p in module.named_parameters()}
    return {
        names[id(m.weight)]: m.padding_idx
        for m in module.modules()
        if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None
    }


# ---- execute: run the graph in ORT -------------------------------------------------------------


def execute(
    shell: Shell,
    module: torch.nn.Module,
    leaves: list[Any],
    tracked: Tracked,
    call: Call,
    compiled: Compiled,
    new_state: ExportState[Compiled],
) -> Outcome:
    """Run ORT for a decided call; the shell to commit carries ``new_state``."""
    repinned = _sizes_changed(shell, compiled, leaves, call)
    if repinned is not None:
        return repinned
    info = compiled.info
    if info.updates:
        _check_updated_inputs(info, leaves, call)
    inputs = info.construct_inputs_flat(leaves, tracked.named_tensors)
    needs_grad = torch.is_grad_enabled() and (any(call.grad.inputs) or any(call.grad.params))
    built = compiled
    try:
        if needs_grad and not built.forward_only:
            sizes = info.user_sizes(leaves)
            if built.training is None or built.sizes != sizes:
                try:
                    built = _training_for_sizes(shell, built, tracked.device, call, leaves, sizes)
                except (OrtfxInitError, OrtfxExportError) as error:
                    if call.key.training:
                        raise
                    # Eval mode (a validation loop without no_grad): the forward is what the
                    # call needs; its outputs carry a backward that says why it cannot run.
                    built = attrs.evolve(built, forward_only=_first_line(error))
        if needs_grad and built.training is not None:
            if built.training.info.fed_params:  # memory-efficient gradients: its own inputs
                inputs = built.training.info.construct_inputs_flat(leaves, tracked.named_tensors)
            outputs = RunORT.apply(built.training, *inputs)  # type: ignore[no-untyped-call]
        else:
            if built.inference is None:
                built = _with_inference_runner(shell, built, tracked.device, call)
            assert built.inference is not None
            outputs = built.inference.run(inputs)
            if needs_grad:
                # Anchored on an input that requires grad, so autograd records the outputs.
                anchor = next(t for t in inputs if t.requires_grad)
                outputs = NoGradientGraph.apply(  # type: ignore[no-untyped-call]
                    built.forward_only, anchor, *outputs
                )
    except OrtfxRuntimeError as error:
        changed = watch.changed_tensor(compiled.fingerprint, watch.track(module).fingerprint())
        if changed is not None:
            # e.g. model.block.double() done on an inner module: ORT rejects the new dtype.
            return Retry(invalidate(shell, changed), changed)
        # A call PyTorch rejects too (a wrong width, a user check) is the input's fault: its
        # own exception, and no fallback or exporter switch for later, different calls.
        raise_if_pytorch_raises(module, leaves, call.key.schema, torch.is_grad_enabled())
        if not (compiled.ran and call.key.options.exporter == "torchscript"):
            raise
        # The graph ran before on other sizes: the tracer baked a size in. The dynamo
        # exporter keeps sizes symbolic; switching re-exports (the log says why).
        logs.exporter_switch(shell.log, error)
        return Retry(attrs.evolve(shell, exporter="dynamo", fast=None), "exporter switched")
    if not built.ran:
        _check_output_dtypes(info, outputs)
    if any(o.numel() == 0 for o in outputs):
        built = _check_empty_outputs(built, module, leaves, call)
    if info.updates:
        _copy_back(info, outputs, leaves, tracked)
    if built is not compiled or not built.ran:
        new_state = replace_payload(new_state, call.key, attrs.evolve(built, ran=True))
    if _new_runner(compiled, built):
        new_state = note_session(new_state)
    if new_state.warned is not shell.state.warned:
        for path in sorted(new_state.warned - shell.state.warned):
            warnings.warn(
                REPEATED_REEXPORT.format(path=path, count=dict(new_state.streaks)[path]),
                OrtfxWarning,
                stacklevel=_user_stacklevel(),
            )
    after = shell.with_state(new_state)
    if built.training is not compiled.training and _said_ignored(shell):
        after = attrs.evolve(after, said=after.said | {"memory config ignored"})
    return info.restore_outputs(outputs, leaves), after


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _check_empty_outputs(
    built: Compiled, module: torch.nn.Module, leaves: list[Any], call: Call
) -> Compiled:
    """ORT returned an empty output from non-empty inputs (user inputs are never empty here).

    ORT computes some sizes PyTorch rejects as empty results (``MaxPool2d(4)`` of a 2x2 input):
    if PyTorch raises for this call, raise its exception. Checked once per input sizes, so a
    model whose outputs are legitimately empty (no detections) pays one eager forward.
    """
    sizes = tuple(tuple(leaves[i].shape) for i in call.key.schema.tensor_indices())
    if sizes in built.empty_checked:
        return built
    raise_if_pytorch_raises(module, leaves, call.key.schema, torch.is_grad_enabled())
    return attrs.evolve(built, empty_checked=built.empty_checked | {sizes})


class NoGradientGraph(torch.autograd.Function):
    """Outputs of an eval-mode call whose gradient graph ORT could not build: a backward
    through them raises a clear error instead of torch's "does not require grad"."""

    @staticmethod
    def forward(
        ctx: Any, why: str, anchor: torch.Tensor, *outputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.why = why
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise OrtfxRuntimeError(NO_GRADIENT_GRAPH.format(why=ctx.why))


def _new_runner(before: Compiled, after: Compiled) -> bool:
    """Whether ``after`` holds a runner built by this call (not one taken from the per-size
    cache of ``before``)."""
    if after.inference is not before.inference:
        return True
    if after.training is None or after.training is before.training:
        return False
    return all(runner is not after.training for _, runner in before.sized)


def _check_updated_inputs(
    info: PostExportProcessedModelInfo, leaves: list[Any], call: Call
) -> None:
    """An input the forward changes in place must not require grad (PyTorch raises for a leaf;
    for a non-leaf, autograd would have to see the in-place op, which runs inside ORT)."""
    for update in info.updates:
        if update.kind == "input" and leaves[update.target].requires_grad:  # type: ignore[index]
            path = call.key.schema.paths[update.target]  # type: ignore[index]
            raise OrtfxIOError(INPUT_CHANGED_IN_PLACE.format(path=path))


def _copy_back(
    info: PostExportProcessedModelInfo,
    outputs: Sequence[torch.Tensor],
    leaves: list[Any],
    tracked: Tracked,
) -> None:
    """Write the forward's in-place changes into the module's tensors and the caller's."""
    new = outputs[info.n_user_outputs :]
    with torch.no_grad():
        for update, value in zip(info.updates, new, strict=True):
            target = (
                tracked.named_tensors[update.target]  # type: ignore[index]
                if update.kind == "state"
                else leaves[update.target]  # type: ignore[index]
            )
            target.copy_(value)


def _check_output_dtypes(
    info: PostExportProcessedModelInfo, outputs: Sequence[torch.Tensor]
) -> None:
    """ORT must return each output in the dtype the module returns (checked once per runner:
    e.g. ORT's CPU training graph hands float16 outputs back as float32)."""
    specs = [s for s in info.output_schema.leaves if isinstance(s, TensorSpec)]
    for k, (spec, out) in enumerate(zip(specs, outputs, strict=False)):
        if out.dtype != spec.dtype:
            raise OrtfxRuntimeError(
                OUTPUT_DTYPE_CHANGED.format(
                    path=info.output_schema.paths[info.output_schema.tensor_indices()[k]],
                    expected=str(spec.dtype).removeprefix("torch."),
                    given=str(out.dtype).removeprefix("torch."),
                )
            )


def _said_ignored(shell: Shell) -> bool:
    options = shell.options
    return bool(options.memory_opt_level and options.memory_opt_config)


def _input_dims(
    info: PostExportProcessedModelInfo, leaves: list[Any]
) -> tuple[tuple[str, int], ...]:
    """Each user input's dim names (as exported: ``{name}_dim{d}``) with their current sizes."""
    return tuple(
        (f"{spec.name}_dim{d}", size)
        for spec in info.inputs
        if spec.kind is InputKind.USER
        for d, size in enumerate(leaves[spec.source].shape)  # type: ignore[index]
    )


def _session_pipeline(
    grad: GradState, *, symbolic: bool, sizes: tuple[tuple[int, ...], ...] = ()
) -> passes.Pass:
    pipeline = passes.for_session(
        frozenset(i for i, rg in enumerate(grad.inputs) if rg),
        frozenset(n for n, rg in zip(grad.param_names, grad.params, strict=True) if rg),
        seed=torch.initial_seed(),
        symbolic=symbolic,
        sizes=sizes,
        feed_params_through=memgrad.FUNCTION_NAME if grad.mem_efficient_grad else None,
    )
    return passes.chain(pipeline, *events.session_passes) if events.session_passes else pipeline


def _training_for_sizes(
    shell: Shell,
    compiled: Compiled,
    device: torch.device,
    call: Call,
    leaves: list[Any],
    sizes: tuple[tuple[int, ...], ...],
) -> Compiled:
    """The entry with a training runner for these input sizes: the dynamic one (``sizes``
    empty), one kept from an earlier call of the same sizes, or a new one (logged)."""
    if not sizes:
        return _with_training_runner(shell, compiled, device, call, leaves, sizes)
    kept = dict(compiled.sized)
    if sizes in kept:
        return attrs.evolve(compiled, training=kept[sizes], sizes=sizes)
    _log_sized_session(shell, compiled, call, sizes)
    built = _with_training_runner(shell, compiled, device, call, leaves, sizes)
    assert built.training is not None
    cache = (*((k, r) for k, r in compiled.sized if k != sizes), (sizes, built.training))
    return attrs.evolve(built, sizes=sizes, sized=cache[-SIZED_RUNNERS:])


def _log_sized_session(
    shell: Shell, compiled: Compiled, call: Call, sizes: tuple[tuple[int, ...], ...]
) -> None:
    """One transition line: which input sizes the new training session is built for, and why."""
    info = compiled.info
    why = STATIC_SIZES_SESSION.format(ops=", ".join(info.static_size_ops))
    paths = [
        info.input_schema.paths[spec.source]  # type: ignore[index]
        for spec in info.inputs
        if spec.kind is InputKind.USER
    ]
    before = compiled.sizes or (None,) * len(sizes)
    reasons = tuple(
        Reason(path, "any size" if was is None else str(list(was)), str(list(now)), why)
        for path, was, now in zip(paths, before, sizes, strict=True)
        if was != now
    )
    line = str(Transition(shell.state.stats.calls, "new session", reasons))
    logs.transition(shell.log, line, "")


def _with_training_runner(
    shell: Shell,
    compiled: Compiled,
    device: torch.device,
    call: Call,
    leaves: list[Any],
    sizes: tuple[tuple[int, ...], ...] = (),
) -> Compiled:
    options = shell.options
    level = options.memory_opt_level
    plans = memory.parse_config(options.memory_opt_config) if level == 0 else ()
    info = _session_pipeline(call.grad, symbolic=bool(level or plans), sizes=sizes)(compiled.info)
    prefix = logs.save_prefix(options)
    dims = _input_dims(compiled.info, leaves)

    def build(plans_on: tuple[str, ...] | None, probe: str) -> TrainingRunner:
        return open_training(
            info,
            device,
            options,
            deterministic=call.session.deterministic,
            save_prefix=prefix,
            memory=None if plans_on is None else (probe, plans_on),
            mode="training" if call.key.training else "inference",
            probe=bool(level or plans),
        )

    runner = build(None, "1:0")
    report = compiled.memory
    if level or plans:
        # Discover the plans of this graph, choose per level (or the user's), rebuild.
        probe = "1:1" if level else "1:0"
        discovered = runner.memory_stat(probe)
        enabled = memory.select(discovered, level, plans)
        if enabled:
            runner = build(enabled, probe)
        report = memory.report(discovered, enabled, dict(dims))
        logs.memory_plans(
            shell.log,
            options,
            memory.render(report, level),
            discovered,
            plans,
            say_ignored=_said_ignored(shell) and "memory config ignored" not in shell.said,
        )
    if runner.compute_optimizer_failure:
        logs.compute_optimizer_failed(shell.log, runner.compute_optimizer_failure)
    built = attrs.evolve(compiled, training=runner, memory=report, dims=dims)
    _log_ready(shell, "training", built, runner, call)
    return built


def _with_inference_runner(
    shell: Shell, compiled: Compiled, device: torch.device, call: Call
) -> Compiled:
    info = passes.seed_dropouts(torch.initial_seed())(compiled.info)
    runner = open_inference(
        info,
        device,
        shell.options,
        deterministic=call.session.deterministic,
        save_prefix=logs.save_prefix(shell.options),
    )
    built = attrs.evolve(compiled, inference=runner)
    _log_ready(shell, "inference", built, runner, call)
    return built


def _log_ready(
    shell: Shell,
    kind: str,
    compiled: Compiled,
    runner: TrainingRunner | InferenceRunner,
    call: Call,
) -> None:
    events.emit("session", kind, runner)
    timings = attrs.evolve(
        compiled.timings,
        gradient_build=runner.gradient_build_seconds,
        session=runner.session_seconds,
    )
    logs.runner_ready(
        shell.log,
        kind,
        timings.render(),
        shell.options,
        call.key.options.exporter,
        call.session.deterministic,
    )


def memory_report(shell: Shell) -> tuple[tuple[MemoryPlan, ...], Shell]:
    """The recompute plans of the most recent training graph, discovered on demand (a probe
    session is built and dropped); the shell keeps the report for next time."""
    for entry in reversed(shell.state.entries):
        compiled = entry.payload
        if compiled.training is None:
            continue
        if compiled.memory is not None:
            return compiled.memory, shell
        info = _session_pipeline(entry.grad, symbolic=True, sizes=compiled.sizes)(compiled.info)
        probe = open_training(
            info,
            torch.device(entry.session.device),
            shell.options,
            deterministic=entry.session.deterministic,
            probe=True,
        )
        report = memory.report(probe.memory_stat("1:0"), (), dict(compiled.dims))
        state = replace_payload(shell.state, entry.key, attrs.evolve(compiled, memory=report))
        return report, attrs.evolve(shell, state=state)
    raise RuntimeError(NO_TRAINING_GRAPH)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside ortfx and torch."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


_INTERNAL_DIRS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    os.path.dirname(os.path.abspath(torch.__file__)),
)
