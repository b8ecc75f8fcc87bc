"""The effectful half of a transition: export (or the persistent cache) and the log line.

:func:`realize` exports the module for a re-export decision (refusing what a trace cannot carry,
logging what it baked in) or takes the entry's graph for a re-process or a new session; the
state stays valid if it raises.
"""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any

import torch

from ortfx import module_state, passes
from ortfx.errors import (
    STRICT_TRACING_REFUSED,
    OrtfxExportError,
    OrtfxTorchModelError,
)
from ortfx.export import (
    export,
)
from ortfx.keys import Call, Decision, Reexport, Reuse, Transition, decision_name
from ortfx.model_info import PostExportProcessedModelInfo
from ortfx.runtime import disk_cache, events, logs, partitioned, watch
from ortfx.runtime.execute import tensor_sizes
from ortfx.runtime.logs import WrapperLog
from ortfx.runtime.records import Compiled, Shell, Traced
from ortfx.runtime.session import (
    Timings,
)
from ortfx.runtime.watch import Tracked
from ortfx.transitions import traced_for_baked, traced_for_grad_flags, traced_for_grad_mode

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
) -> tuple[Compiled, Call, Traced | None]:
    """Export (or reuse an entry's graph for a new session); the old state stays valid if this
    raises, and the module is as it was (the trace's attribute changes are undone). The call
    comes back with the key its entry gets (grad mode added when the export found the module
    asking for it), and what the trace found when the graph was traced from this very call
    (its guards then hold this call's values as PyTorch computes them; its attribute changes
    are to be made once the graph has run), else None."""
    assert not isinstance(decision, Reuse)
    timings = Timings()
    this_call: Traced | None = None
    pinned: tuple[tuple[int, ...], ...] | None = None
    writes: tuple[tuple[int, str], ...] = ()
    if isinstance(decision, Reexport):
        # Bind first: a wrong call raises the same TypeError PyTorch would, before export.
        inspect.signature(module.forward).bind(*args, **kwargs)
        info, timings, traced = _export(shell, module, call, leaves)
        writes, this_call = traced.writes, traced if traced.this_call else None
        if traced.numbers_from_tensors and _returns_numbers(info):
            pinned = tensor_sizes(leaves, call)
            logs.sizes_pinned(shell.log, pinned)
        if traced.reads_grad_mode:  # the entry serves calls in this grad mode only
            call = traced_for_grad_mode(call)
            logs.grad_mode_traced(shell.log, call.grad_enabled)
        if traced.reads_grad_flags:  # the entry serves calls with these flags only
            call = traced_for_grad_flags(call)
            logs.grad_flags_traced(shell.log)
        if info.guards:  # the entry serves calls whose runs give the values it baked in
            call = traced_for_baked(call, info.baked)
            logs.guarded(shell.log, info.guards)
        elif call.key.baked is not None:  # exported after a discarded run, and baked none
            call = traced_for_baked(call, None)
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
        Compiled(
            info,
            timings,
            tracked.fingerprint(),
            pinned_sizes=pinned,
            writes=writes,
        ),
        call,
        this_call,
    )


def _returns_numbers(info: PostExportProcessedModelInfo) -> bool:
    kinds = {spec.kind for spec in info.output_schema.leaves}
    return bool(kinds & {"int", "float", "bool"})


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
    log = shell.log
    if call.key.training:
        _refuse_layerdrop(module)
    padding = _embedding_padding(module)
    dynamic = frozenset(shell.options.dynamic_scalars)
    # ZeRO-3 phase 2 partitions the weights between layers: the trace needs them whole.
    # Muted: a forward that reassigns a buffer while traced is not a module change.
    with (
        partitioned.gathered_for_export(module),
        module_state.buffers_locked(module.buffers()),
    ):
        source = copy.deepcopy(module) if shell.options.deepcopy_before_export else module
        with watch.muted(module):
            exported = export(source, leaves, call.key.schema, call.key.options, call.grad_enabled)
    writes = exported.writes
    described = (*module_state.described(writes), *exported.outside.writes)
    if described:
        logs.traced_writes(log, tuple(dict.fromkeys(described)))
    filled = module_state.described(exported.filled)
    if exported.arguments_filled:
        filled = (*filled, "its arguments")
    if filled:
        logs.traced_fills(log, filled)
    if exported.tracing_queries:
        logs.tracing_queries(log, exported.tracing_queries)
    if exported.checkpoint_calls:
        logs.checkpoint_calls(log, exported.checkpoint_calls, shell.options.memory_opt_level)
    if exported.checkpoint_updates:
        logs.checkpoint_updates(log, exported.checkpoint_updates)
    hooked = watch.user_forward_hooks(module)
    if hooked:
        logs.traced_hooks(log, hooked)
    # Imported here: ortfx.aten builds on the TorchScript exporter, which may be missing.
    from ortfx import aten

    routed = aten.routed_ops(exported.info.model)  # ops run by torch inside the graph
    if routed:
        logs.ops_in_torch(log, routed)
    if not logs.random_draws_said():
        drawn = passes.random_ops(exported.info.model)
        if drawn:
            logs.random_draws(log, drawn)
    if exported.tracer_warnings and call.key.options.strict_tracing:
        raise OrtfxExportError(
            STRICT_TRACING_REFUSED.format(
                count=len(exported.tracer_warnings),
                module=type(module).__name__,
                first=exported.tracer_warnings[0].removeprefix("branch: "),
            )
        )
    cached = _from_disk_cache(shell, module, call, exported.info, padding, dynamic)
    if isinstance(cached, PostExportProcessedModelInfo):
        info = cached
    else:
        info = passes.for_export(padding, dynamic)(exported.info)
        if cached is not None:
            _to_disk_cache(log, cached, info)
    events.emit("export", info)
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
        outside=exported.outside,
        this_call=True,
        changes=exported.changes,
    )
    return info, timings, traced


def _from_disk_cache(
    shell: Shell,
    module: torch.nn.Module,
    call: Call,
    traced: PostExportProcessedModelInfo,
    padding: dict[str, int],
    dynamic: frozenset[str],
) -> PostExportProcessedModelInfo | disk_cache.Slot | None:
    """The processed form of the ``traced`` graph from ``Options.cache_dir`` if it holds one;
    else where to store it (None: no cache, or this graph cannot be cached)."""
    directory = shell.options.cache_dir
    if not directory:
        return None
    log = shell.log
    if not disk_cache.trusted(directory, log):
        events.emit("disk_cache", "untrusted", directory)
        return None
    try:
        slot = disk_cache.slot(directory, type(module).__name__, traced, call.key, padding, dynamic)
    except disk_cache.Uncacheable as e:
        log.log(logging.INFO, disk_cache.CACHE_SKIPPED, e)
        return None
    info = disk_cache.load(slot, traced, log)
    if info is None:
        log.log(logging.INFO, disk_cache.CACHE_MISS, slot.path)
        events.emit("disk_cache", "miss", slot.path)
        return slot
    log.log(logging.INFO, disk_cache.CACHE_HIT, slot.path)
    events.emit("disk_cache", "hit", slot.path)
    return info


def _to_disk_cache(
    log: WrapperLog, slot: disk_cache.Slot, info: PostExportProcessedModelInfo
) -> None:
    """Store the processed graph; the next process that traces the same graph skips the
    passes. Every traced graph is safe to store: the key is what was traced."""
    try:
        disk_cache.store(slot, info, log)
    except disk_cache.Uncacheable as e:
        log.log(logging.INFO, disk_cache.CACHE_SKIPPED, e)


def _embedding_padding(module: torch.nn.Module) -> dict[str, int]:
    """Parameter name -> padding_idx of every nn.Embedding that has one."""
    names = {id(p): n for n, p in module.named_parameters()}
    return {
        names[id(m.weight)]: m.padding_idx
        for m in module.modules()
        if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None
    }
