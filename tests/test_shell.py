"""The shell's shape: one frozen record per wrapper, nothing mutable in the export state, and the
behaviour that comes with it (session settings in the key, configure, counting, lifetime)."""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import attrs
import pytest
import torch
from torch import nn

import ortfx
from ortfx.runtime import events
from ortfx.runtime.inference import InferenceRunner
from ortfx.runtime.shell import Compiled, Shell
from ortfx.runtime.training import TrainingRunner
from tests import models
from tests.models import max_diff

X = torch.randn(3, 8)


def _engine_slots(wrapped: nn.Module) -> list[str]:
    return sorted(k for k in vars(wrapped) if k.startswith("_ortfx"))


def test_one_engine_slot_after_calls_configure_and_invalidate() -> None:
    wrapped = ortfx.ORTModule(models.MLP())
    assert _engine_slots(wrapped) == ["_ortfx"]
    wrapped(X).sum().backward()
    with torch.no_grad():
        wrapped(X)
    ortfx.configure(wrapped, memory_opt_level=0, cache_size=4)
    wrapped.eval()
    wrapped(X)
    ortfx.invalidate(wrapped)
    wrapped.train()
    wrapped(torch.randn(5, 8)).sum().backward()
    wrapped.fc1 = nn.Linear(8, 32)  # through the wrapper: lands on the module
    wrapped(X)
    ortfx.memory_report(wrapped)
    assert _engine_slots(wrapped) == ["_ortfx"]
    assert isinstance(vars(wrapped)["_ortfx"], Shell)
    assert attrs.has(Shell) and Shell.__setattr__ is not object.__setattr__  # frozen


_OPAQUE = (TrainingRunner, InferenceRunner)  # frozen records around ORT's native handles


def _mutable_paths(obj: Any, path: str = "state") -> list[str]:
    """Paths to anything mutable reachable from ``obj`` through records and tuples."""
    if isinstance(obj, (list, dict, set, bytearray)):
        return [f"{path}: {type(obj).__name__}"]
    if isinstance(obj, (tuple, frozenset)):
        return [p for i, x in enumerate(obj) for p in _mutable_paths(x, f"{path}[{i}]")]
    if attrs.has(type(obj)):
        if not isinstance(obj, _OPAQUE) and type(obj).__setattr__ is object.__setattr__:
            return [f"{path}: {type(obj).__name__} is not frozen"]
        if isinstance(obj, _OPAQUE):
            return []  # the session objects inside are ORT's; the record itself is frozen
        return [
            p
            for f in attrs.fields(type(obj))
            for p in _mutable_paths(getattr(obj, f.name), f"{path}.{f.name}")
        ]
    return []


def test_no_mutable_object_is_reachable_from_the_export_state() -> None:
    wrapped = ortfx.ORTModule(models.MLP())
    wrapped(X).sum().backward()
    with torch.no_grad():
        wrapped(X)
    state = vars(wrapped)["_ortfx"].state
    payload = state.entries[-1].payload
    assert isinstance(payload, Compiled)
    assert payload.training is not None and payload.inference is not None
    assert _mutable_paths(state) == []
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        payload.ran = False  # type: ignore[misc]
    # The checker itself finds a mutable payload (so the assertion above can fail).
    assert _mutable_paths((Compiled(payload.info, payload.timings, ()), [1])) == ["state[1]: list"]


def test_session_settings_are_in_the_session_key(caplog: pytest.LogCaptureFixture) -> None:
    wrapped = ortfx.ORTModule(models.MLP(), options=ortfx.Options(intra_op_threads=1))
    wrapped(X).sum().backward()
    with caplog.at_level(logging.INFO, logger="ortfx"), events.recording() as seen:
        ortfx.configure(wrapped, intra_op_threads=2, log_level=ortfx.LogLevel.INFO)
        wrapped(X).sum().backward()
    runners = [args[1] for name, args in seen if name == "session"]
    assert len(runners) == 1
    assert runners[0].session.get_session_options().intra_op_num_threads == 2
    s = ortfx.stats(wrapped)
    assert (s.exports, s.sessions) == (1, 2)
    assert str(ortfx.explain(wrapped)[-1]) == (
        "new session: option intra_op_threads was 1, now 2 (a session setting changed)"
    )
    assert any(
        "new session: option intra_op_threads was 1, now 2" in r.getMessage()
        for r in caplog.records
    )


class BakedSize(nn.Module):
    """nn.MultiheadAttention: its TorchScript trace keeps sizes no guard sees (torch's own
    C++ reads them), so a graph for one sequence length cannot run another."""

    def __init__(self) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.att(x, x, x, need_weights=False)[0]


def test_configure_keeps_an_automatically_switched_exporter() -> None:
    model = BakedSize()
    wrapped = ortfx.ORTModule(model)
    wrapped(torch.randn(2, 5, 16))
    x = torch.randn(3, 7, 16)
    out = wrapped(x)  # the baked size fails in ORT: switched to dynamo
    assert max_diff(out, model(x)) <= 1e-5
    assert "exporter='dynamo'" in repr(wrapped)
    ortfx.configure(wrapped, cache_size=4)
    assert "exporter='dynamo'" in repr(wrapped)  # kept: the exporter was not among the changes
    ortfx.configure(wrapped, exporter="torchscript")
    assert "exporter='torchscript'" in repr(wrapped)


def test_a_failed_call_keeps_nothing_it_built_and_is_counted() -> None:
    strict = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
    model = nn.Linear(4, 4)
    wrapped = ortfx.ORTModule(model, options=strict)
    with torch.no_grad():
        wrapped(torch.randn(2, 4))  # an inference session
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        wrapped(torch.randn(2, 5))  # builds the training session, then fails: wrong width
    s = ortfx.stats(wrapped)
    assert (s.calls, s.failed_calls, s.exports, s.sessions) == (2, 1, 1, 1)
    assert vars(wrapped)["_ortfx"].state.entries[-1].payload.training is None
    x = torch.randn(2, 4, requires_grad=True)
    assert max_diff(wrapped(x), model(x)) <= 1e-6
    assert ortfx.stats(wrapped).sessions == 2


def test_a_dropped_wrapper_is_freed_without_the_cyclic_collector() -> None:
    gc.collect()
    gc.disable()
    try:
        wrapped = ortfx.ORTModule(models.MLP())
        wrapped(X).sum().backward()
        with torch.no_grad():
            wrapped(X)
        payload = vars(wrapped)["_ortfx"].state.entries[-1].payload
        runners = [weakref.ref(payload.training), weakref.ref(payload.inference)]
        alive = weakref.ref(wrapped)
        del wrapped, payload
        assert alive() is None
        assert [r() for r in runners] == [None, None]
    finally:
        gc.enable()


def test_user_methods_and_signature_live_on_a_per_class_subclass() -> None:
    class WithMethod(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
            return self.lin(x) * scale

        def twice(self, x: torch.Tensor) -> torch.Tensor:
            return self(x) + self(x)

    model = WithMethod()
    a, b = ortfx.ORTModule(model), ortfx.ORTModule(WithMethod())
    assert type(a) is type(b) and isinstance(a, ortfx.ORTModule)
    assert type(a).twice is WithMethod.twice  # class-level lookups find the user's methods
    assert (
        str(__import__("inspect").signature(a.forward))
        == "(x: 'torch.Tensor', *, scale: 'float' = 1.0) -> 'torch.Tensor'"
    )
    x = torch.randn(2, 4)
    assert max_diff(a.twice(x), model.twice(x)) <= 1e-6
    assert ortfx.stats(a).calls == 2


def test_hand_built_records_on_the_fast_path_equal_evolve() -> None:
    """count_reuse and Shell.with_state spell their records out field by field for speed; a
    field added later and forgotten there would silently reset to its default."""
    from ortfx.keys import ModuleVersion
    from ortfx.transitions import ExportState, Stats, count_reuse

    values = {f.name: i + 3 for i, f in enumerate(attrs.fields(Stats))}
    stats = Stats(**{**values, "fallback": "why"})
    state = ExportState(
        maxsize=5,
        entries=(),
        module_version=ModuleVersion(4, "cause"),
        stats=stats,
        history=(),
        streaks=(("p", 2),),
        warned=frozenset({"p"}),
        fallbacks=(("k", "r"),),
        versions_made=7,
    )
    assert count_reuse(state) == attrs.evolve(
        state,
        stats=attrs.evolve(
            stats,
            calls=stats.calls + 1,
            cache_hits=stats.cache_hits + 1,
            fast_hits=stats.fast_hits + 1,
            fallback=None,
        ),
    )
    assert {f.name for f in attrs.fields(ExportState)} == {
        "maxsize",
        "entries",
        "module_version",
        "stats",
        "history",
        "streaks",
        "warned",
        "fallbacks",
        "versions_made",
    }
    wrapped = ortfx.ORTModule(models.MLP())
    wrapped(X)
    shell = vars(wrapped)["_ortfx"]
    shell = attrs.evolve(shell, baked=frozenset({"b"}), said=frozenset({"s"}))
    assert shell.with_state(state) == attrs.evolve(shell, state=state)
    assert shell.with_state(state).fast is shell.fast and shell.with_state(state).said == shell.said
