"""Pure graph-transition core: export keys, decisions with reasons, and the bounded export cache.

Nothing here imports ONNX Runtime. The shell builds a :class:`Call` for each forward, asks
:func:`decide` what must happen, does the (effectful) work, and swaps in the state returned by
:func:`apply`. A failure in between leaves the old state untouched.

Order of precedence: ``Reexport`` > ``Reprocess`` > ``NewSession`` > ``Reuse``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Any, Generic, TypeAlias, TypeVar

import attrs
import optree
import torch

from ortfx import io
from ortfx.options import ExportOptions
from ortfx.schema import LeafSpec, ModelSchema, StaticSpec, TensorSpec

P = TypeVar("P")


@attrs.frozen
class Reason:
    """One difference between what a cache entry was built for and the current call."""

    path: str
    seen: str
    given: str
    why: str

    def __str__(self) -> str:
        return f"{self.path} was {self.seen}, now {self.given} ({self.why})"


@attrs.frozen
class ModuleVersion:
    """Bumped by every change to the module that can change its graph; ``cause`` says which."""

    number: int = 0
    cause: str = attrs.field(default="", eq=False)


@attrs.frozen
class ExportKey:
    """Everything that can change the exported graph, and nothing that cannot."""

    schema: ModelSchema
    training: bool
    module_version: ModuleVersion
    options: ExportOptions
    versions: tuple[str, str]  # (torch, onnx)
    # None: the graph does not depend on grad mode. Else the grad mode it was traced for: the
    # module asked torch.is_grad_enabled() while traced (see :func:`resolve`).
    grad_mode: bool | None = None
    # None: the graph does not depend on requires_grad flags. Else the (inputs, parameters)
    # flags it was traced for: the forward read requires_grad of an input or a parameter.
    grad_flags: tuple[tuple[bool, ...], tuple[bool, ...]] | None = None
    # Submodules whose train/eval flag differs from the root's ``training`` (a frozen
    # BatchNorm: ``model.bn.eval()``), by name: the trace follows each module's own flag.
    other_mode: tuple[str, ...] = ()
    # The dtype torch.autocast runs the call's device in ("bfloat16"), or None when off: the
    # trace records its casts, so a graph traced without them computes in another dtype.
    autocast: str | None = None
    # torch.get_default_dtype(): the dtype of the tensors the forward creates without one.
    default_dtype: str = "float32"


@attrs.frozen
class GradState:
    """Which inputs and parameters require grad: decides re-processing, not re-export."""

    inputs: tuple[bool, ...]
    params: tuple[bool, ...]
    param_names: tuple[str, ...] = attrs.field(eq=False)
    # (memory_opt_level, memory_opt_config): the gradient graph's recompute plans.
    memory: tuple[int, str] = (0, "")
    # Options.enable_mem_efficient_grad_management: parameters fed through PythonOps.
    mem_efficient_grad: bool = False


@attrs.frozen
class SessionKey:
    """What only needs a new ORT session: the device, torch's determinism flag and the
    session settings (``(option name, value)`` pairs: threads, spinning, CPU arena)."""

    device: str
    deterministic: bool
    settings: tuple[tuple[str, Any], ...] = ()


@attrs.frozen
class Call:
    """Everything :func:`decide` needs to know about one forward call."""

    key: ExportKey
    grad: GradState
    session: SessionKey
    grad_enabled: bool = False  # torch.is_grad_enabled() at the call


@attrs.frozen
class Reuse:
    pass


@attrs.frozen
class NewSession:
    reasons: tuple[Reason, ...]


@attrs.frozen
class Reprocess:
    reasons: tuple[Reason, ...]


@attrs.frozen
class Reexport:
    reasons: tuple[Reason, ...]


Decision: TypeAlias = Reuse | NewSession | Reprocess | Reexport


def decision_name(decision: Decision, *, first: bool = False) -> str:
    if isinstance(decision, Reexport):
        return "export" if first else "re-export"
    if isinstance(decision, Reprocess):
        return "re-process"
    if isinstance(decision, NewSession):
        return "new session"
    return "reuse"


@attrs.frozen
class Transition:
    """A non-trivial decision in the history, with its reasons; renders as one log line."""

    call: int
    kind: str
    reasons: tuple[Reason, ...]

    def __str__(self) -> str:
        return f"{self.kind}: " + "; ".join(map(str, self.reasons))


@attrs.frozen
class Entry(Generic[P]):
    """One cached graph: what it was built for, and the shell's artifacts for it."""

    key: ExportKey
    grad: GradState
    session: SessionKey
    payload: P = attrs.field(eq=False)


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
    module_version: ModuleVersion = ModuleVersion()
    stats: Stats = Stats()
    history: tuple[Transition, ...] = ()
    # Consecutive re-exports forced by a changing static leaf, and the leaves already warned of.
    streaks: tuple[tuple[str, int], ...] = ()
    warned: frozenset[str] = frozenset()
    # (fallback key, reason) of calls that ORT could not run and that now run in PyTorch.
    fallbacks: tuple[tuple[Hashable, str], ...] = ()

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
    return attrs.evolve(state, module_version=ModuleVersion(state.module_version.number + 1, cause))


# ---- explanations -------------------------------------------------------------------------


def _leaf_reason(path: str, seen: LeafSpec, given: LeafSpec) -> Reason:
    why = "the leaf changed"
    if isinstance(seen, StaticSpec) and isinstance(given, StaticSpec):
        if type(seen.value) is type(given.value):
            why = f"a static {seen.kind} value changed"
        else:
            why = "a static value changed type"
    elif isinstance(seen, TensorSpec) and isinstance(given, TensorSpec):
        changed = [n for n in ("dtype", "rank") if getattr(seen, n) != getattr(given, n)]
        why = f"a tensor's {' and '.join(changed)} changed"
    elif isinstance(seen, StaticSpec):
        why = "None became a tensor" if seen.value is None else "a static value became a tensor"
    elif isinstance(given, StaticSpec):
        why = "a tensor became None" if given.value is None else "a tensor became a static value"
    return Reason(path, seen.render(), given.render(), why)


def _structure_reasons(seen: ModelSchema, given: ModelSchema) -> Iterator[Reason]:
    old, new = seen.paths, given.paths
    for path in old:
        if path not in new:
            yield Reason(path, "present", "absent", "the input structure changed")
    for path in new:
        if path not in old:
            yield Reason(path, "absent", "present", "the input structure changed")
    if set(old) == set(new):
        old_chains = dict(zip(old, io.containers(seen.treespec, root=seen.root), strict=True))
        for path, chain in zip(new, io.containers(given.treespec, root=given.root), strict=True):
            for (where, was), (_, now) in zip(old_chains[path], chain, strict=False):
                if was != now:
                    yield Reason(where, f"a {was}", f"a {now}", "a container type changed")
                    return
        yield Reason("inputs", str(seen.treespec), str(given.treespec), "the tree changed")


def explain_key(seen: ExportKey, given: ExportKey) -> tuple[Reason, ...]:
    """Why ``given`` misses an entry built for ``seen``, in a fixed order (JAX-style).

    Module version, mode, options and library versions first, then tree structure, then leaves.
    """
    reasons: list[Reason] = []
    if seen.module_version != given.module_version:
        reasons.append(
            Reason(
                "module",
                f"version {seen.module_version.number}",
                f"version {given.module_version.number}",
                given.module_version.cause or "the module changed",
            )
        )
    if seen.training != given.training:
        mode = {True: "train", False: "eval"}
        reasons.append(
            Reason("mode", mode[seen.training], mode[given.training], "train/eval mode changed")
        )
    if seen.other_mode != given.other_mode:
        reasons.append(
            Reason(
                "submodule modes",
                _other_mode_text(seen),
                _other_mode_text(given),
                "a submodule's train/eval mode differs from the module's",
            )
        )
    if seen.autocast != given.autocast:
        reasons.append(
            Reason(
                "autocast",
                seen.autocast or "off",
                given.autocast or "off",
                "torch.autocast changes the dtypes the forward computes in",
            )
        )
    if seen.default_dtype != given.default_dtype:
        reasons.append(
            Reason(
                "default dtype",
                seen.default_dtype,
                given.default_dtype,
                "torch.set_default_dtype changes the tensors the forward creates",
            )
        )
    if None not in (seen.grad_flags, given.grad_flags) and seen.grad_flags != given.grad_flags:
        reasons.append(
            Reason(
                "requires_grad flags",
                _flag_text(seen.grad_flags),
                _flag_text(given.grad_flags),
                "the forward reads requires_grad of its inputs or parameters",
            )
        )
    if None not in (seen.grad_mode, given.grad_mode) and seen.grad_mode != given.grad_mode:
        grad = {True: "enabled", False: "disabled"}
        reasons.append(
            Reason(
                "grad mode",
                grad[bool(seen.grad_mode)],
                grad[bool(given.grad_mode)],
                "the module reads torch.is_grad_enabled()",
            )
        )
    for field in attrs.fields(ExportOptions):
        a, b = getattr(seen.options, field.name), getattr(given.options, field.name)
        if a != b:
            reasons.append(
                Reason(f"option {field.name}", repr(a), repr(b), "an export option changed")
            )
    for name, a, b in zip(("torch", "onnx"), seen.versions, given.versions, strict=True):
        if a != b:
            reasons.append(Reason(f"{name} version", a, b, "a library version changed"))
    if seen.schema.treespec != given.schema.treespec:
        reasons.extend(_structure_reasons(seen.schema, given.schema))
    else:
        for path, a, b in zip(
            given.schema.paths, seen.schema.leaves, given.schema.leaves, strict=True
        ):
            if a != b:
                reasons.append(_leaf_reason(path, a, b))
    return tuple(reasons)


def _other_mode_text(key: ExportKey) -> str:
    if not key.other_mode:
        return "all as the module"
    mode = "eval" if key.training else "train"
    return ", ".join(f"{name!r} {mode}" for name in key.other_mode)


def _flag(value: bool) -> str:
    return f"requires_grad={value}"


def explain_grad(seen: GradState, given: GradState, paths: tuple[str, ...]) -> tuple[Reason, ...]:
    reasons = [
        Reason(path, _flag(a), _flag(b), "an input's requires_grad changed")
        for path, a, b in zip(paths, seen.inputs, given.inputs, strict=True)
        if a != b
    ]
    if seen.param_names != given.param_names:
        reasons.append(Reason("parameters", "another set", "this set", "the parameters changed"))
    else:
        reasons.extend(
            Reason(f"parameter '{name}'", _flag(a), _flag(b), "a parameter's requires_grad changed")
            for name, a, b in zip(given.param_names, seen.params, given.params, strict=True)
            if a != b
        )
    for name, a, b in zip(
        ("memory_opt_level", "memory_opt_config"), seen.memory, given.memory, strict=True
    ):
        if a != b:
            reasons.append(
                Reason(f"option {name}", repr(a), repr(b), "a memory optimizer option changed")
            )
    if seen.mem_efficient_grad != given.mem_efficient_grad:
        reasons.append(
            Reason(
                "option enable_mem_efficient_grad_management",
                repr(seen.mem_efficient_grad),
                repr(given.mem_efficient_grad),
                "parameters enter the graph another way",
            )
        )
    return tuple(reasons)


def explain_session(seen: SessionKey, given: SessionKey) -> tuple[Reason, ...]:
    reasons = []
    before = dict(seen.settings)
    for name, value in given.settings:
        if name in before and before[name] != value:
            reasons.append(
                Reason(
                    f"option {name}", repr(before[name]), repr(value), "a session setting changed"
                )
            )
    if seen.device != given.device:
        reasons.append(Reason("device", seen.device, given.device, "the module changed device"))
    if seen.deterministic != given.deterministic:
        on = {True: "on", False: "off"}
        reasons.append(
            Reason(
                "deterministic algorithms",
                on[seen.deterministic],
                on[given.deterministic],
                "torch.use_deterministic_algorithms changed",
            )
        )
    return tuple(reasons)


def _flag_text(flags: tuple[tuple[bool, ...], tuple[bool, ...]] | None) -> str:
    """Which inputs and parameters require grad, in order (1 = requires grad); counts when long."""
    inputs, params = flags or ((), ())

    def bits(values: tuple[bool, ...]) -> str:
        if len(values) > 32:
            return f"{sum(values)} of {len(values)}"
        return "".join("1" if v else "0" for v in values) or "none"

    return f"inputs {bits(inputs)}, parameters {bits(params)}"


def _as_seen_by(entry: ExportKey, call: Call) -> ExportKey:
    """The call's key as an entry traced for one grad mode, or for given requires_grad flags,
    compares it."""
    key = call.key
    if entry.grad_mode is not None:
        key = attrs.evolve(key, grad_mode=call.grad_enabled)
    if entry.grad_flags is not None:
        key = attrs.evolve(key, grad_flags=_flags(call))
    return key


def _flags(call: Call) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    return (call.grad.inputs, call.grad.params)


def _closest(entries: tuple[Entry[P], ...], call: Call) -> Entry[P] | None:
    # The entry with the fewest differences; ties go to the most recently used one.
    best: Entry[P] | None = None
    best_count = -1
    for entry in reversed(entries):
        count = len(explain_key(entry.key, _as_seen_by(entry.key, call)))
        if best is None or count < best_count:
            best, best_count = entry, count
    return best


# ---- the decision and its application ------------------------------------------------------


FIRST_CALL = Reason("module", "never exported", "called", "first call")


def resolve(state: ExportState[P], call: Call) -> Call:
    """``call`` with the key of the entry that serves it, if one does.

    A key traced for one grad mode (``grad_mode`` set) serves only calls made in that mode;
    any other entry serves calls in either mode. Decide and apply compare keys exactly, so
    the shell resolves a new call first."""
    if state.lookup(call.key) is not None:
        return call
    moded = attrs.evolve(call.key, grad_mode=call.grad_enabled)
    flagged = attrs.evolve(call.key, grad_flags=_flags(call))
    both = attrs.evolve(moded, grad_flags=_flags(call))
    for key in (moded, flagged, both):
        if state.lookup(key) is not None:
            return attrs.evolve(call, key=key)
    return call


def traced_for_grad_mode(call: Call) -> Call:
    """``call`` once its export turned out to depend on grad mode: its entry serves only
    calls made in the same mode."""
    return attrs.evolve(call, key=attrs.evolve(call.key, grad_mode=call.grad_enabled))


def traced_for_grad_flags(call: Call) -> Call:
    """``call`` once its export turned out to read requires_grad of inputs or parameters: its
    entry serves only calls with the same flags (others export again)."""
    return attrs.evolve(call, key=attrs.evolve(call.key, grad_flags=_flags(call)))


def decide(state: ExportState[P], call: Call) -> Decision:
    """What the shell must do for ``call`` (resolved, see :func:`resolve`). Pure: reads
    ``state``, changes nothing."""
    entry = state.lookup(call.key)
    if entry is None:
        closest = _closest(state.entries, call)
        if closest is None:
            return Reexport((FIRST_CALL,))
        return Reexport(explain_key(closest.key, _as_seen_by(closest.key, call)))
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
    )


def count_failure(state: ExportState[P]) -> ExportState[P]:
    """A call that raised to the user; nothing it built is kept."""
    stats = state.stats
    return attrs.evolve(
        state,
        stats=attrs.evolve(stats, calls=stats.calls + 1, failed_calls=stats.failed_calls + 1),
    )


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
    deterministic: bool,
    device: Hashable,
    grad_enabled: bool = False,
    modes: tuple[bool, ...] = (),
    autocast: str | None = None,
    default_dtype: Hashable = "float32",
) -> tuple[Any, ...]:
    """A plain tuple that is equal for two calls only if :func:`make_call` gives equal
    :class:`Call` s in the same context (options, versions, device and parameter names fixed):
    the shell's steady-state fast path compares it instead of building the call. ``modes``:
    every module's train/eval flag (what ``CallContext.other_mode`` is read from)."""
    return (
        treespec,
        tuple(map(_leaf_signature, leaves)),
        training,
        module_version,
        params_requiring_grad,
        deterministic,
        device,
        grad_enabled,
        modes,
        autocast,
        default_dtype,
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
