"""The engine's frozen records: the whole state of one wrapper (:class:`Shell`), the artifacts of
one cache entry (:class:`Compiled`), and what a call returns besides its result.

:func:`invalidate` starts a new module version; :func:`rebase` puts a call's result on top of
what was committed while it ran (the façade's compare-and-swap). Nothing here is mutated in place.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import attrs

from ortfx import module_state
from ortfx.export import (
    resolve_exporter,
)
from ortfx.keys import Call, GuardHint, ModuleVersion
from ortfx.memory import MemoryPlan
from ortfx.model_info import PostExportProcessedModelInfo
from ortfx.options import Options
from ortfx.outside import Outside
from ortfx.runtime import logs
from ortfx.runtime.inference import InferenceRunner
from ortfx.runtime.logs import WrapperLog
from ortfx.runtime.session import Timings
from ortfx.runtime.training import TrainingRunner
from ortfx.runtime.watch import Fingerprint, Tracked
from ortfx.transitions import ExportState, Stats, bump_module_version


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
    # Input sizes whose empty outputs PyTorch was found to give too (see check_empty_outputs)
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
    # Per guard location (file:line), the values its runs have given: each needs a graph.
    guard_values: tuple[tuple[str, frozenset[Any]], ...] = ()
    # Module versions left because state read outside the call changed, each with what its
    # graphs read (a PEFT adapter switched off and on again finds its graphs: see call.track).
    worlds: tuple[tuple[Outside, ModuleVersion], ...] = ()

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
            guard_values=self.guard_values,
            worlds=self.worlds,
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
    if current.state.stats is not base.state.stats:
        # Another thread's calls meanwhile: their counts are added, not overwritten.
        counted = _stats_sum(result.state.stats, current.state.stats, base.state.stats)
        result = result.with_state(attrs.evolve(result.state, stats=counted))
    if current.state.fallbacks != base.state.fallbacks:
        fallbacks = tuple(dict.fromkeys((*result.state.fallbacks, *current.state.fallbacks)))
        state = attrs.evolve(result.state, fallbacks=fallbacks)
        result = attrs.evolve(result, state=state, fast=None)
    return result


def _stats_sum(result: Stats, current: Stats, base: Stats) -> Stats:
    """``result`` plus what ``current`` counted beyond ``base`` (integer counters only)."""
    changes = {
        f.name: getattr(result, f.name) + getattr(current, f.name) - getattr(base, f.name)
        for f in attrs.fields(Stats)
        if isinstance(getattr(base, f.name), int)
    }
    return attrs.evolve(result, **changes)


def invalidate(shell: Shell, cause: str) -> Shell:
    """A new module version: every cached graph becomes unreachable; track the module again
    (no earlier version can be returned to: the module itself changed)."""
    return attrs.evolve(
        shell, state=bump_module_version(shell.state, cause), tracked=None, fast=None, worlds=()
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
    # What the forward read outside its arguments, parameters and buffers.
    outside: Outside | None = None
    # The trace ran this call's own inputs (not a graph from the disk cache): the values its
    # guards hold are what PyTorch computed for this call (ORT's may differ by rounding).
    this_call: bool = False
    # Every attribute change the traced forward made, undone after the trace: made again
    # once this call's graph has run in ORT (a failed attempt leaves the module as it was).
    changes: module_state.Changes = attrs.field(default=(), eq=False)


@attrs.frozen
class Retry:
    """An attempt found something to repair; the next attempt starts from ``shell``."""

    shell: Shell
    cause: str
    # A discarded run of a guarded graph: which graph the next attempt tries (or exports).
    hint: GuardHint | None = None
    # The attribute changes of this call's trace, if one ran: the attempt whose graph runs
    # the call makes them (a later attempt may reuse a graph instead of tracing again).
    changes: module_state.Changes = attrs.field(default=(), eq=False)


class CallFailed(Exception):
    """Carries a failed call's exception to the façade with the shell to commit."""

    def __init__(self, error: BaseException, shell: Shell) -> None:
        super().__init__(error)
        self.error = error
        self.shell = shell


Outcome: TypeAlias = "tuple[Any, Shell] | Retry"
