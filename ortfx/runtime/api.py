"""The public functions over a live ``ORTModule``: its counters, transitions, options and
memory plans, and the changes a user makes to it (``ortfx.configure``, ``ortfx.invalidate``).
Each reads the wrapper's one frozen shell or commits a new one through the wrapper."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ortfx.errors import NOT_A_WRAPPER, UNKNOWN_OPTIONS
from ortfx.keys import Transition
from ortfx.memory import MemoryPlan
from ortfx.options import Options
from ortfx.runtime import shell as engine
from ortfx.runtime.module import ORTModule
from ortfx.transitions import Stats


def stats(model: torch.nn.Module) -> Stats:
    """Counters of ``model`` (an ``ORTModule``): calls, exports, re-processes, sessions, hits."""
    return _wrapper(model)._ortfx.state.stats


def explain(model: torch.nn.Module) -> tuple[Transition, ...]:
    """Every transition so far (exports, re-processes, new sessions) with its reasons."""
    return _wrapper(model)._ortfx.state.history


def options_of(model: torch.nn.Module) -> Options:
    """The options ``model`` (an ``ORTModule``) runs with, environment variables applied."""
    return _wrapper(model)._ortfx.options


def memory_report(model: torch.nn.Module) -> tuple[MemoryPlan, ...]:
    """The memory optimizer's recompute plans for ``model``'s current training graph: cluster,
    ON/OFF, the config string that enables it, frequency and estimated bytes saved per step."""
    wrapper = _wrapper(model)
    base = wrapper._ortfx
    report, shell = engine.memory_report(base)
    wrapper._ortfx_commit(shell, base=base)
    return report


def configure(model: torch.nn.Module, **changes: Any) -> None:
    """Change options of a live wrapper, e.g. ``ortfx.configure(model, memory_opt_level=1)``.

    Options that change the exported graph re-export; memory optimizer options re-process;
    session settings open a new session; invalid values raise and leave the wrapper as it was.
    """
    wrapper = _wrapper(model)
    known = {f.name for f in attrs.fields(Options)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(
            UNKNOWN_OPTIONS.format(
                unknown=", ".join(map(repr, unknown)), known=", ".join(sorted(known))
            )
        )
    attrs.evolve(wrapper._ortfx.options, **changes)  # invalid values raise here, changing nothing
    wrapper._ortfx_update(
        lambda shell: shell.configured(
            attrs.evolve(shell.options, **changes), exporter_changed="exporter" in changes
        )
    )


def invalidate(model: torch.nn.Module, reason: str = "ortfx.invalidate() was called") -> None:
    """Force a re-export on the next call, after changing an inner module's plain attributes
    directly (``model.block.scale = 2``), which ortfx cannot see cheaply."""
    _wrapper(model)._ortfx_invalidate(reason)


def _wrapper(model: torch.nn.Module) -> ORTModule:
    if not isinstance(model, ORTModule):
        raise TypeError(NOT_A_WRAPPER.format(type_name=type(model).__qualname__))
    return model
