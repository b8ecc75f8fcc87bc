"""One call: the fallback gate, then a bounded loop of attempts, each the fast path or the slow one.

:func:`call` runs one forward: calls like one that fell back run in PyTorch; otherwise
:func:`run` takes the fast path (the signature the last slow call left, still the most recent
entry, with nothing changed behind the wrapper) or :func:`attempt` s the slow path (track the
module, key the call, decide, realize, execute). A recovery (a dynamic scalar found baked in,
parameters changed behind the wrapper, the exporter switch) is a returned ``Retry``, never a
recursive call, so the bound on them (:data:`MAX_RECOVERIES`) is visible in :func:`run`.
"""

from __future__ import annotations

from typing import Any

import attrs
import onnx
import optree
import torch

from ortfx import io, module_state
from ortfx._torch import in_functorch_transform, user_modes
from ortfx.errors import (
    BUFFER_REQUIRES_GRAD,
    FUNCTORCH_TRANSFORM,
    INPUT_ON_OTHER_DEVICE,
    TOO_MANY_RECOVERIES,
    USER_MODES,
    OrtfxDeviceError,
    OrtfxEmptyTensorError,
    OrtfxError,
    OrtfxIOError,
    OrtfxRuntimeError,
    OrtfxTorchModelError,
)
from ortfx.export import (
    exporting,
)
from ortfx.keys import GuardHint, Reuse
from ortfx.model_info import InputKind, PostExportProcessedModelInfo
from ortfx.runtime import events, logs, partitioned, watch
from ortfx.runtime.execute import execute
from ortfx.runtime.fallback import (
    attributes_seen,
    fall_back,
    fallback_reason,
    in_torch,
)
from ortfx.runtime.guards import context_of, fallback_key, signature_of
from ortfx.runtime.realize import realize
from ortfx.runtime.records import (
    CallFailed,
    FastPath,
    Outcome,
    Retry,
    Shell,
    invalidate,
)
from ortfx.runtime.replay import computed_from
from ortfx.runtime.watch import Tracked
from ortfx.schema import ModelSchema, TensorSpec, tensorize_scalars
from ortfx.transitions import (
    apply,
    count_failure,
    count_reuse,
    decide,
    make_call,
    note_fallback_call,
    resolve,
    return_to_version,
)

# At most this many recoveries (each a different cause) before a call gives up.
MAX_RECOVERIES = 3


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
        return in_torch(shell, module, args, kwargs)
    if shell.state.fallbacks:
        reason = fallback_reason(shell, module, args, kwargs)
        if reason is not None:
            shell = attrs.evolve(shell, state=note_fallback_call(shell.state, reason))
            return in_torch(shell, module, args, kwargs)
    modes = user_modes()
    if modes:
        # A mode of the user's (FlopCounterMode, a tracer, a logger of ops) must see the ops,
        # and ORT's graph runs none it could see: this call runs in PyTorch, as eager.
        reason = USER_MODES.format(modes=", ".join(modes))
        if reason not in shell.said:  # once per set of modes
            logs.user_modes(shell.log, reason)
            shell = attrs.evolve(shell, said=shell.said | {reason})
        shell = shell.with_state(note_fallback_call(shell.state, reason))
        return in_torch(shell, module, args, kwargs)
    try:
        if in_functorch_transform():
            raise OrtfxIOError(FUNCTORCH_TRANSFORM)
        return run(shell, module, args, kwargs)
    except OrtfxEmptyTensorError as error:
        # Only this call: an empty batch says nothing about the next one.
        logs.empty_batch(shell.log, str(error))
        reason = f"{type(error).__name__}: {error}"
        return in_torch(
            shell.with_state(note_fallback_call(shell.state, reason)), module, args, kwargs
        )
    except OrtfxError as error:
        failed = attrs.evolve(shell, state=count_failure(shell.state))
        try:
            fallen = fall_back(shell, error, key=fallback_key(args, kwargs, module))
        except OrtfxError:
            raise CallFailed(error, failed) from None
        return in_torch(fallen, module, args, kwargs)
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
        and tracked.unchanged()
        and fast.signature == signature_of(leaves, spec, module, state, tracked)
    ):
        # Steady state: the same kind of call as the last one, whose entry is still the most
        # recent. The signature the slow path left stands in for schema, Call and decide.
        entry = state.entries[-1]
        outcome = execute(
            shell, module, leaves, tracked, fast.call, entry.payload, count_reuse(state)
        )
        if not isinstance(outcome, Retry):
            return outcome
        shell, hint = outcome.shell, outcome.hint
    else:
        hint = None
    causes: list[str] = []
    hops = 0
    changes: module_state.Changes = ()
    while len(causes) <= MAX_RECOVERIES:
        outcome = attempt(shell, module, args, kwargs, leaves, spec, hint, changes)
        if not isinstance(outcome, Retry):
            return outcome
        shell, hint, changes = outcome.shell, outcome.hint, outcome.changes
        # A discarded run of a guarded graph moves down its key's graphs, each hop at least
        # one value closer to the call's (see GuardHint): bounded by the graphs kept.
        if hint is not None and hops < shell.options.cache_size + MAX_RECOVERIES:
            hops += 1
        else:
            causes.append(outcome.cause)
    raise OrtfxRuntimeError(TOO_MANY_RECOVERIES.format(count=len(causes), causes="; ".join(causes)))


def track(shell: Shell, module: torch.nn.Module) -> tuple[Shell, Tracked]:
    """The shell with a current view of the module's tensors."""
    tracked = shell.tracked
    replaced = tracked.replaced() if tracked is not None else None
    if replaced is not None:
        shell = invalidate(shell, f"{replaced!r} was replaced outside the wrapper")
        tracked = None
    if tracked is not None and (tracked.clock != watch.hook_clock() or tracked.hooks_removed()):
        cause = tracked.hooks_change()
        if cause is not None:
            shell = invalidate(shell, cause)
            tracked = None
        else:  # a hook elsewhere in the process: this tree's graphs stand
            tracked = tracked.with_fresh_hooks()
            shell = attrs.evolve(shell, tracked=tracked, fast=None)
    # What each call compares without a hook to tell it: (differs, why, the view renewed when
    # nothing real changed: private names, an equal value set again, config metadata).
    compared = (
        (Tracked.attributes_changed, Tracked.attribute_change, Tracked.with_fresh_attributes),
        (Tracked.outside_changed, Tracked.outside_change, Tracked.with_fresh_outside),
        (Tracked.configs_differ, Tracked.config_change, Tracked.with_fresh_configs),
    )
    for differs, why, renewed in compared:
        if tracked is None or not differs(tracked):
            continue
        cause = why(tracked)
        if cause is not None and differs is Tracked.outside_changed:
            shell, tracked = _outside_moved(shell, tracked, cause)
        elif cause is not None:
            shell = invalidate(shell, cause)
            tracked = None
        else:
            tracked = renewed(tracked)
            shell = attrs.evolve(shell, tracked=tracked, fast=None)
    if tracked is not None and tracked.buffer_grad_changed():
        tracked = None  # a buffer's flag moved: take the view again (checked in attempt)
    if tracked is None or tracked.moved():
        # A view taken again with the graphs standing (a buffer's flag, a move) keeps their
        # outside reads; after an invalidation there are none to keep.
        kept = shell.tracked.outside if shell.tracked is not None else None
        tracked = watch.track(module)
        if kept is not None:
            tracked = tracked.with_outside(kept)
        shell = attrs.evolve(shell, tracked=tracked, watched=watch.module_ids(module))
    return shell, tracked


# Module versions kept to return to when the state read outside the calls moves back.
MAX_WORLDS = 4


def _outside_moved(shell: Shell, tracked: Tracked, cause: str) -> tuple[Shell, Tracked | None]:
    """State the graphs read outside their calls changed (``cause``). If it is now as it was
    at a version left for the same kind of change (every read of that version gives its value
    again: a PEFT adapter disabled, then enabled), that version's graphs serve again; else a
    new version, this one kept to return to."""
    assert tracked.outside is not None
    here = (tracked.outside, shell.state.module_version)
    for outside, version in reversed(shell.worlds):
        if not outside.changed():
            worlds = (*(w for w in shell.worlds if w[1] != version), here)
            logs.version_returned(shell.log, shell.state.module_version, version, cause)
            tracked = attrs.evolve(tracked, outside=outside)
            state = return_to_version(shell.state, version)
            return attrs.evolve(
                shell, state=state, tracked=tracked, fast=None, worlds=worlds[-MAX_WORLDS:]
            ), tracked
    worlds = (*shell.worlds, here)[-MAX_WORLDS:]
    return attrs.evolve(invalidate(shell, cause), worlds=worlds), None


def attempt(
    shell: Shell,
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    leaves: list[Any],
    spec: optree.PyTreeSpec,
    hint: GuardHint | None = None,
    changes: module_state.Changes = (),
) -> Outcome:
    """The slow path: key, decide, realize, then execute. ``hint``: what a discarded run of
    a guarded graph said about this call (which graph to try, or to export, next);
    ``changes``: the attribute changes of an earlier attempt's trace of this call."""
    shell, tracked = track(shell, module)
    state = shell.state
    io.check_leaves(leaves, spec, root="call", where="input")
    partitioned.check(module, tracked.named_tensors)  # ZeRO-3 needs ortfx's gathering
    if tracked.buffer_grad and torch.is_grad_enabled():
        name = tracked.buffer_requiring_grad()
        raise OrtfxTorchModelError(BUFFER_REQUIRES_GRAD.format(name=name))
    fed, tensorized = _tensorize(shell, leaves, spec)
    made = make_call(fed, spec, context_of(shell, module, tracked))
    call = resolve(state, made if hint is None else attrs.evolve(made, hint=hint))
    _check_input_devices(fed, call.key.schema, tracked.device)
    decision = decide(state, call)
    events.emit("decide", call, decision)
    traced = None
    if isinstance(decision, Reuse):
        hit = state.lookup(call.key)
        assert hit is not None
        compiled = hit.payload
    else:
        compiled, call, traced = realize(shell, module, decision, call, fed, tracked, args, kwargs)
        if traced is not None:
            changes = traced.changes
        static = _baked_dynamic_scalars(compiled.info, call.key.schema, tensorized)
        if static:
            # The module turned these tensors back into Python values (range(n), if n):
            # the graph holds the export-time value. Correctness first: make them static.
            logs.baked_scalars(shell.log, static)
            return Retry(
                attrs.evolve(shell, baked=shell.baked | set(static), fast=None),
                f"{', '.join(static)} baked in",
                changes=changes,
            )
    if compiled.writes:
        # The forward's own writes (warned): never a change behind its graph.
        tracked = tracked.with_fresh_attributes(compiled.writes)
        shell = attrs.evolve(shell, tracked=tracked)
    if traced is not None and traced.outside is not None:  # what a new trace read outside
        tracked = tracked.with_outside(traced.outside)
        shell = attrs.evolve(shell, tracked=tracked)
    new_state = apply(state, call, decision, compiled)
    result = execute(shell, module, fed, tracked, call, compiled, new_state, traced is not None)
    if isinstance(result, Retry):
        return attrs.evolve(result, changes=changes)
    output, after = result
    # The graph ran this call: the attributes its traced forward set, as eager sets them.
    module_state.apply(changes)
    after = attributes_seen(after)  # the export's own writes (warned) are the new baseline
    if shell.options.dynamic_scalars:
        return output, after
    latest = after.state.entries[-1].key
    if latest is call.key or latest == call.key:
        # A reuse keeps the entry's own key object; the fast path checks that one by identity
        # (else, once the fast path was dropped by a fallback, it never came back).
        now = signature_of(leaves, spec, module, state, tracked)
        after = attrs.evolve(after, fast=FastPath(now, attrs.evolve(call, key=latest)))
    return output, after


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
    """Paths of scalars fed as tensors that the graph does not compute its outputs from (a
    guard output aside): their value was turned back into a Python value while traced, and so
    baked in. Keyed on them, each value gets its graph before any run."""
    if not tensorized:
        return []
    model = onnx.load_model_from_string(info.model)
    guards = len(info.guards)
    # everything the user outputs and the updates are computed from
    outputs = [o.name for o in model.graph.output[: len(model.graph.output) - guards]]
    consumed = computed_from(model.graph, outputs)
    fed = {spec.source: spec.name for spec in info.inputs if spec.kind is InputKind.USER}
    return [schema.paths[i] for i in tensorized if fed.get(i) not in consumed]
