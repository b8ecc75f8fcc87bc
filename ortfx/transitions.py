"""Pure graph-transition core: export keys, decisions with reasons, and the bounded export cache.

Nothing here imports ONNX Runtime. The shell builds a :class:`Call` for each forward, asks
:func:`decide` what must happen, does the (effectful) work, and swaps in the state returned by
:func:`apply`. A failure in between leaves the old state untouched.

Order of precedence: ``Reexport`` > ``Reprocess`` > ``NewSession`` > ``Reuse``. The records are
in :mod:`ortfx.keys`, the explanations in :mod:`ortfx.reasons`; their names used elsewhere are
re-exported here.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Generic

import attrs
import optree
import torch

from ortfx.keys import (
    Baked,
    Call,
    Decision,
    Entry,
    ExportKey,
    GradState,
    ModuleVersion,
    NewSession,
    P,
    Reason,
    Reexport,
    Reprocess,
    Reuse,
    SessionKey,
    Transition,
    decision_name,
)
from ortfx.options import ExportOptions
from ortfx.reasons import (
    as_seen_by,
    closest_entry,
    explain_grad,
    explain_key,
    explain_session,
    flags,
)
from ortfx.schema import ModelSchema


@attrs.frozen
class Stats:
    """Counters a user can read with ``ortfx.stats(model)``."""

    calls: int = 0
    exports: int = 0
    reprocesses: int = 0
    sessions: int = 0
    cache_hits: int = 0
    # Why the last call ran in PyTorch instead of ORT (None when it ran in ORT).
    fallback: str | None = None
    fallback_calls: int = 0
    # Calls that skipped schema and decide: same kind of call as the previous one.
    fast_hits: int = 0
    # Calls that raised to the user (bad input, user exception, no fallback allowed).
    failed_calls: int = 0


REPEAT_WARN_AFTER = 3
HISTORY_LIMIT = 256


@attrs.frozen
class ExportState(Generic[P]):
    """The whole state of a wrapper: LRU cache (most recent last), counters and history."""

    maxsize: int = 8
    entries: tuple[Entry[P], ...] = ()
    module_version: ModuleVersion = attrs.field(factory=ModuleVersion)
    stats: Stats = Stats()
    history: tuple[Transition, ...] = ()
    # Consecutive re-exports forced by a changing static leaf, and the leaves already warned of.
    streaks: tuple[tuple[str, int], ...] = ()
    warned: frozenset[str] = frozenset()
    # (fallback key, reason) of calls that ORT could not run and that now run in PyTorch.
    fallbacks: tuple[tuple[Hashable, str], ...] = ()
    # The highest module version number given out: a version returned to (see
    # return_to_version) never makes a later bump reuse a number whose graphs are cached.
    versions_made: int = 0

    def fallback_reason(self, key: Hashable) -> str | None:
        return next((reason for k, reason in self.fallbacks if k == key), None)

    def lookup(self, key: ExportKey) -> Entry[P] | None:
        # Most recent first: in a steady training loop the first comparison hits.
        for entry in reversed(self.entries):
            if entry.key == key:
                return entry
        return None


def bump_module_version(state: ExportState[P], cause: str) -> ExportState[P]:
    """A new module version: every cached graph becomes unreachable (and ages out of the LRU)."""
    number = max(state.versions_made, state.module_version.number) + 1
    return attrs.evolve(state, module_version=ModuleVersion(number, cause), versions_made=number)


def return_to_version(state: ExportState[P], version: ModuleVersion) -> ExportState[P]:
    """The module is again as it was at ``version`` (the state its graphs read outside their
    calls is back): that version's cached graphs serve again."""
    return attrs.evolve(
        state,
        module_version=version,
        versions_made=max(state.versions_made, state.module_version.number),
    )


# ---- the decision and its application ------------------------------------------------------


FIRST_CALL = Reason("module", "never exported", "called", "first call")


def resolve(state: ExportState[P], call: Call) -> Call:
    """``call`` with the key of the entry that serves it, if one does.

    A key traced for one grad mode (``grad_mode`` set) serves only calls made in that mode;
    any other entry serves calls in either mode. Decide and apply compare keys exactly, so
    the shell resolves a new call first."""
    moded = attrs.evolve(call.key, grad_mode=call.grad_enabled)
    flagged = attrs.evolve(call.key, grad_flags=flags(call))
    both = attrs.evolve(moded, grad_flags=flags(call))
    bases = (call.key, moded, flagged, both)
    hint = call.hint
    if hint is None:
        for key in bases:
            if state.lookup(key) is not None:
                return attrs.evolve(call, key=key)
    # A graph with values baked in serves until a run's guards say otherwise: the most recent
    # one, or after a discarded run, the most recent one that follows the call further.
    for entry in reversed(state.entries):
        baked = entry.key.baked
        if baked is None or attrs.evolve(entry.key, baked=None) not in bases:
            continue
        if hint is None or (baked[: len(hint.prefix)] == hint.prefix and baked not in hint.failed):
            return attrs.evolve(call, key=entry.key)
    if hint is not None and hint.prefix:
        # None does: exported for this call (the reason names the value that differed).
        return attrs.evolve(call, key=attrs.evolve(call.key, baked=hint.prefix))
    return call


def traced_for_grad_mode(call: Call) -> Call:
    """``call`` once its export turned out to depend on grad mode: its entry serves only
    calls made in the same mode."""
    return attrs.evolve(call, key=attrs.evolve(call.key, grad_mode=call.grad_enabled))


def traced_for_baked(call: Call, baked: Baked | None) -> Call:
    """``call`` once its export baked values in (``None``: it baked none): its entry serves
    calls whose runs give the same values (each run checks)."""
    return attrs.evolve(call, key=attrs.evolve(call.key, baked=baked), hint=None)


def traced_for_grad_flags(call: Call) -> Call:
    """``call`` once its export turned out to read requires_grad of inputs or parameters: its
    entry serves only calls with the same flags (others export again)."""
    return attrs.evolve(call, key=attrs.evolve(call.key, grad_flags=flags(call)))


def decide(state: ExportState[P], call: Call) -> Decision:
    """What the shell must do for ``call`` (resolved, see :func:`resolve`). Pure: reads
    ``state``, changes nothing."""
    entry = state.lookup(call.key)
    if entry is None:
        closest = closest_entry(state.entries, call)
        if closest is None:
            return Reexport((FIRST_CALL,))
        return Reexport(explain_key(closest.key, as_seen_by(closest.key, call)))
    if entry.grad != call.grad:
        return Reprocess(
            explain_grad(entry.grad, call.grad, call.key.schema.paths)
            + explain_session(entry.session, call.session)
        )
    if entry.session != call.session:
        return NewSession(explain_session(entry.session, call.session))
    return Reuse()


def _static_paths(reasons: tuple[Reason, ...]) -> set[str]:
    # Only int/float/bool leaves can be fed as tensors instead (Options.dynamic_scalars).
    kinds = {f"a static {t} value changed" for t in ("int", "float", "bool")}
    return {r.path for r in reasons if r.why in kinds}


def apply(state: ExportState[P], call: Call, decision: Decision, payload: P) -> ExportState[P]:
    """The state after the shell carried out ``decision`` for ``call``, producing ``payload``.

    For ``Reuse`` the payload must be the cached entry's own.
    """
    stats = state.stats
    if isinstance(decision, Reuse):
        entries = state.entries
        if entries[-1].key != call.key:  # move the hit to the most-recent end
            kept = tuple(e for e in entries if e.key != call.key)
            entries = (*kept, Entry(call.key, call.grad, call.session, payload))
        return attrs.evolve(
            state,
            entries=entries,
            stats=attrs.evolve(
                stats, calls=stats.calls + 1, cache_hits=stats.cache_hits + 1, fallback=None
            ),
        )

    first = stats.exports == 0 and isinstance(decision, Reexport)
    transition = Transition(stats.calls, decision_name(decision, first=first), decision.reasons)
    kept = tuple(e for e in state.entries if e.key != call.key)
    entries = (*kept, Entry(call.key, call.grad, call.session, payload))[-state.maxsize :]
    streaks, warned = state.streaks, state.warned
    if isinstance(decision, Reexport):
        stats = attrs.evolve(stats, exports=stats.exports + 1)
        previous = dict(streaks)
        streaks = tuple(
            (path, previous.get(path, 0) + 1) for path in sorted(_static_paths(decision.reasons))
        )
        warned = warned | {p for p, n in streaks if n >= REPEAT_WARN_AFTER}
    else:
        stats = attrs.evolve(stats, cache_hits=stats.cache_hits + 1)
        if isinstance(decision, Reprocess):
            stats = attrs.evolve(stats, reprocesses=stats.reprocesses + 1)
    return attrs.evolve(
        state,
        entries=entries,
        stats=attrs.evolve(stats, calls=stats.calls + 1, fallback=None),
        history=(*state.history, transition)[-HISTORY_LIMIT:],
        streaks=streaks,
        warned=warned,
    )


def count_reuse(state: ExportState[P]) -> ExportState[P]:
    """A call that reused the most recent entry (the shell's fast path): counters only.

    Built field by field rather than with ``attrs.evolve``: this runs on every steady-state call
    and evolve's field introspection costs microseconds there.
    """
    s = state.stats
    stats = Stats(
        calls=s.calls + 1,
        exports=s.exports,
        reprocesses=s.reprocesses,
        sessions=s.sessions,
        cache_hits=s.cache_hits + 1,
        fallback=None,
        fallback_calls=s.fallback_calls,
        fast_hits=s.fast_hits + 1,
        failed_calls=s.failed_calls,
    )
    return ExportState(
        maxsize=state.maxsize,
        entries=state.entries,
        module_version=state.module_version,
        stats=stats,
        history=state.history,
        streaks=state.streaks,
        warned=state.warned,
        fallbacks=state.fallbacks,
        versions_made=state.versions_made,
    )


def count_failure(state: ExportState[P]) -> ExportState[P]:
    """A call that raised to the user; nothing it built is kept."""
    stats = state.stats
    return attrs.evolve(
        state,
        stats=attrs.evolve(stats, calls=stats.calls + 1, failed_calls=stats.failed_calls + 1),
    )


def rekey(state: ExportState[P], key: ExportKey, new: ExportKey) -> ExportState[P]:
    """The state with the entry for ``key`` found under ``new`` (a guarded graph keyed by the
    values ORT's run gives, see ortfx.runtime.execute)."""
    entries = tuple(
        attrs.evolve(e, key=new) if e.key is key or e.key == key else e for e in state.entries
    )
    return attrs.evolve(state, entries=entries)


def replace_payload(state: ExportState[P], key: ExportKey, payload: P) -> ExportState[P]:
    """The state with the entry for ``key`` carrying ``payload`` (e.g. a runner built lazily)."""
    entries = tuple(
        attrs.evolve(e, payload=payload) if e.key is key or e.key == key else e
        for e in state.entries
    )
    return attrs.evolve(state, entries=entries)


# ---- one call: its key, and the cheap signature the shell's fast path compares -----------------


@attrs.frozen
class CallContext:
    """What a call's key depends on besides its arguments: read off the module and the options."""

    training: bool
    module_version: ModuleVersion
    export_options: ExportOptions
    versions: tuple[str, str]
    param_names: tuple[str, ...]
    params_requiring_grad: tuple[bool, ...]
    memory: tuple[int, str]
    device: str
    deterministic: bool
    settings: tuple[tuple[str, Any], ...] = ()
    mem_efficient_grad: bool = False
    grad_enabled: bool = False
    other_mode: tuple[str, ...] = ()
    autocast: str | None = None
    default_dtype: str = "float32"


def make_call(leaves: Sequence[Any], treespec: optree.PyTreeSpec, context: CallContext) -> Call:
    """The :class:`Call` for already flattened (and checked) leaves in ``context``."""
    schema = ModelSchema.from_flat(leaves, treespec)
    return Call(
        ExportKey(
            schema,
            context.training,
            context.module_version,
            context.export_options,
            context.versions,
            other_mode=context.other_mode,
            autocast=context.autocast,
            default_dtype=context.default_dtype,
        ),
        GradState(
            schema.requires_grad,
            context.params_requiring_grad,
            context.param_names,
            context.memory,
            context.mem_efficient_grad,
        ),
        SessionKey(context.device, context.deterministic, context.settings),
        context.grad_enabled,
    )


def _leaf_signature(x: Any) -> Hashable:
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.dim(), x.requires_grad, x.device)
    # StaticSpec compares type and repr: True vs 1, 0.0 vs -0.0 and nan must stay apart/equal.
    return (type(x), repr(x) if type(x) is float else x)


def signature(
    leaves: Sequence[Any],
    treespec: optree.PyTreeSpec,
    training: bool,
    module_version: int,
    params_requiring_grad: tuple[bool, ...],
    device: Hashable,
    modes: tuple[bool, ...] = (),
    global_state: tuple[Hashable, ...] = (),
) -> tuple[Any, ...]:
    """A plain tuple that is equal for two calls only if :func:`make_call` gives equal
    :class:`Call` s in the same context (options, versions, device and parameter names fixed):
    the shell's steady-state fast path compares it instead of building the call. ``modes``:
    every module's train/eval flag (what ``CallContext.other_mode`` is read from);
    ``global_state``: torch's global state as the shell's guard table reads it, every entry
    (the keyed ones fill ``CallContext``'s fields of the same names)."""
    return (
        treespec,
        tuple(map(_leaf_signature, leaves)),
        training,
        module_version,
        params_requiring_grad,
        device,
        modes,
        global_state,
    )


def note_session(state: ExportState[P]) -> ExportState[P]:
    """The shell created an ORT session (a training or an inference runner)."""
    return attrs.evolve(state, stats=attrs.evolve(state.stats, sessions=state.stats.sessions + 1))


def start_fallback(
    state: ExportState[P], key: Hashable, reason: str, *, during_call: bool = True
) -> ExportState[P]:
    """Calls like this one (same fallback key) run in PyTorch from now on.

    ``during_call=False`` for a fallback decided at construction, before any call.
    """
    stats = state.stats
    n = int(during_call)
    transition = Transition(
        stats.calls, "fallback", (Reason("call", "run in ONNX Runtime", "run in PyTorch", reason),)
    )
    return attrs.evolve(
        state,
        fallbacks=(*state.fallbacks, (key, reason)),
        stats=attrs.evolve(
            stats,
            calls=stats.calls + n,
            fallback=reason if during_call else None,
            fallback_calls=stats.fallback_calls + n,
        ),
        history=(*state.history, transition)[-HISTORY_LIMIT:],
    )


def note_fallback_call(state: ExportState[P], reason: str) -> ExportState[P]:
    """One more call run in PyTorch under an active fallback."""
    stats = state.stats
    return attrs.evolve(
        state,
        stats=attrs.evolve(
            stats, calls=stats.calls + 1, fallback=reason, fallback_calls=stats.fallback_calls + 1
        ),
    )


REPEATED_REEXPORT = (
    "{path} forced {count} re-exports in a row because its static value keeps changing; each "
    "new value is baked into a new graph. If it is data rather than a switch, pass "
    "ORTModule(..., options=ortfx.Options(dynamic_scalars=({path!r},))) to feed it to the graph "
    "as a tensor, or pass a torch.tensor yourself."
)
