"""Properties of the pure transition core: decide/apply against a plain-dict model."""

from __future__ import annotations

import collections
from typing import Any

import attrs
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ortfx.keys import (
    Call,
    ExportKey,
    GradState,
    ModuleVersion,
    NewSession,
    Reexport,
    Reprocess,
    Reuse,
    SessionKey,
)
from ortfx.options import ExportOptions
from ortfx.schema import ModelSchema
from ortfx.transitions import (
    ExportState,
    apply,
    bump_module_version,
    decide,
    resolve,
    traced_for_grad_flags,
    traced_for_grad_mode,
)

# A handful of structurally different calls; schemas are built from real flattening.
CALL_VARIANTS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((torch.zeros(2, 3),), {}),
    ((torch.zeros(2, 3), True), {}),
    ((torch.zeros(2, 3), False), {}),
    ((torch.zeros(2, 3), 3), {}),
    ((torch.zeros(2, 3), None), {}),
    ((torch.zeros(2, 3, dtype=torch.float64),), {}),
    ((torch.zeros(2),), {"mask": torch.zeros(2, dtype=torch.bool)}),
    (([torch.zeros(1), torch.zeros(1)],), {}),
    (((torch.zeros(1), torch.zeros(1)),), {}),
]
SCHEMAS = [ModelSchema.from_call(*c) for c in CALL_VARIANTS]
PARAMS = ("fc.weight", "fc.bias")
OPTIONS = [ExportOptions("torchscript", 17), ExportOptions("dynamo", 18)]
VERSIONS = ("2.13.0", "1.17")


def make_call(
    schema_i: int,
    training: bool,
    version: int,
    options_i: int,
    params_grad: tuple[bool, bool],
    device: str,
    deterministic: bool,
    other_mode: tuple[str, ...] = (),
    autocast: str | None = None,
    default_dtype: str = "float32",
) -> Call:
    schema = SCHEMAS[schema_i]
    key = ExportKey(
        schema,
        training,
        ModuleVersion(version),
        OPTIONS[options_i],
        VERSIONS,
        other_mode=other_mode,
        autocast=autocast,
        default_dtype=default_dtype,
    )
    grad = GradState(schema.requires_grad, params_grad, PARAMS)
    return Call(key, grad, SessionKey(device, deterministic))


call_args = st.tuples(
    st.integers(0, len(SCHEMAS) - 1),
    st.booleans(),
    st.integers(0, 2),
    st.integers(0, 1),
    st.tuples(st.booleans(), st.booleans()),
    st.sampled_from(["cpu", "cuda:0"]),
    st.booleans(),
    st.sampled_from([(), ("bn",), ("bn", "drop")]),  # submodules in the other mode
    st.sampled_from([None, "bfloat16", "float16"]),  # torch.autocast
    st.sampled_from(["float32", "float64"]),  # torch.get_default_dtype()
)


@given(st.lists(call_args, max_size=12), call_args, st.integers(1, 4))
@settings(max_examples=200, deadline=None)
def test_deciding_again_after_applying_reuses(history: list[Any], last: Any, maxsize: int) -> None:
    """Whatever came before, applying decide's own decision makes the same call a Reuse."""
    state: ExportState[str] = ExportState(maxsize=maxsize)
    for args in [*history, last]:
        call = make_call(*args)
        decision = decide(state, call)
        state = apply(state, call, decision, "payload")
    assert decide(state, make_call(*last)) == Reuse()


@given(call_args, call_args)
@settings(max_examples=200, deadline=None)
def test_every_non_reuse_decision_has_reasons(first: Any, second: Any) -> None:
    """A decision other than Reuse always explains itself with at least one reason."""
    state: ExportState[str] = ExportState()
    call = make_call(*first)
    state = apply(state, call, decide(state, call), "p")
    decision = decide(state, make_call(*second))
    if not isinstance(decision, Reuse):
        assert decision.reasons
        assert all(str(r) for r in decision.reasons)


@given(call_args, st.sampled_from([(), ("bn",), ("bn", "drop")]))
@settings(max_examples=100, deadline=None)
def test_a_submodule_changing_mode_reexports_and_says_so(args: Any, other: Any) -> None:
    """``model.bn.eval()`` changes the trace though the root's flag stays: the same call with
    other submodules in the other mode is a Reexport naming them, never a Reuse."""
    state: ExportState[str] = ExportState(maxsize=4)
    call = make_call(*args)
    state = apply(state, call, decide(state, call), "p")
    changed = make_call(*args[:-3], other, *args[-2:])
    decision = decide(state, changed)
    if other == args[-3]:
        assert decision == Reuse()
    else:
        assert isinstance(decision, Reexport)
        (reason,) = [r for r in decision.reasons if r.path == "submodule modes"]
        mode = "eval" if args[1] else "train"
        assert reason.given == (", ".join(f"{n!r} {mode}" for n in other) or "all as the module")


@given(st.lists(st.tuples(call_args, st.booleans(), st.booleans()), min_size=1, max_size=12))
@settings(max_examples=200, deadline=None)
def test_grad_mode_entries_serve_only_their_mode(history: list[Any]) -> None:
    """Calls in either grad mode, some of whose exports read grad mode: after resolving, an
    entry traced for one mode is reused only by calls in that mode, an entry that did not
    read it by calls in both; resolving, deciding and applying again is always a Reuse."""
    state: ExportState[str] = ExportState(maxsize=16)
    for args, grad_enabled, reads in history:
        call = resolve(state, attrs.evolve(make_call(*args), grad_enabled=grad_enabled))
        decision = decide(state, call)
        if isinstance(decision, Reuse):
            assert call.key.grad_mode in (None, grad_enabled)
        if isinstance(decision, Reexport) and reads:
            call = traced_for_grad_mode(call)
        state = apply(state, call, decision, "payload")
        again = resolve(state, attrs.evolve(make_call(*args), grad_enabled=grad_enabled))
        assert decide(state, again) == Reuse()
        other = resolve(state, attrs.evolve(make_call(*args), grad_enabled=not grad_enabled))
        entry = state.lookup(again.key)
        assert entry is not None
        if entry.key.grad_mode is not None and state.lookup(other.key) is not None:
            assert state.lookup(other.key) is not entry  # the other mode never shares it


@given(
    st.lists(
        st.tuples(call_args, st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=12
    )
)
@settings(max_examples=200, deadline=None)
def test_grad_flag_entries_serve_only_their_flags(history: list[Any]) -> None:
    """Calls with changing requires_grad flags (and grad modes), some of whose exports read the
    flags: an entry traced for flags is reused only by calls with those flags (others export:
    the branch the forward took may differ), one that did not read them by every call, where a
    change of flags re-processes; resolving, deciding and applying again is always a Reuse."""
    state: ExportState[str] = ExportState(maxsize=16)
    for args, grad_enabled, reads_flags, reads_mode in history:
        call = resolve(state, attrs.evolve(make_call(*args), grad_enabled=grad_enabled))
        flags = (call.grad.inputs, call.grad.params)
        decision = decide(state, call)
        if not isinstance(decision, Reexport):
            assert call.key.grad_flags in (None, flags)
        if isinstance(decision, Reexport):
            if reads_flags:
                call = traced_for_grad_flags(call)
            if reads_mode:
                call = traced_for_grad_mode(call)
        state = apply(state, call, decision, "payload")
        again = resolve(state, attrs.evolve(make_call(*args), grad_enabled=grad_enabled))
        assert decide(state, again) == Reuse()
        entry = state.lookup(again.key)
        assert entry is not None
        flipped = make_call(*args[:4], (not args[4][0], args[4][1]), *args[5:])
        other = resolve(state, attrs.evolve(flipped, grad_enabled=grad_enabled))
        if entry.key.grad_flags is not None:
            assert state.lookup(other.key) is not entry  # other flags never share it
        else:
            assert isinstance(decide(state, other), Reprocess | Reuse | NewSession)


class TransitionMachine(RuleBasedStateMachine):
    """Random call sequences against a plain OrderedDict model of the LRU export cache."""

    @initialize(maxsize=st.integers(1, 4))
    def setup(self, maxsize: int) -> None:
        self.state: ExportState[int] = ExportState(maxsize=maxsize)
        self.maxsize = maxsize
        self.model: collections.OrderedDict[ExportKey, tuple[GradState, SessionKey]] = (
            collections.OrderedDict()
        )
        self.version = 0
        self.expected = collections.Counter[str]()

    @rule(args=call_args)
    def call(self, args: Any) -> None:
        call = make_call(args[0], args[1], self.version, *args[3:])
        decision = decide(self.state, call)
        seen = self.model.get(call.key)
        if seen is None:
            assert isinstance(decision, Reexport)
            self.expected["exports"] += 1
        elif seen[0] != call.grad:
            assert isinstance(decision, Reprocess)
            self.expected["reprocesses"] += 1
        elif seen[1] != call.session:
            assert isinstance(decision, NewSession)
        else:
            assert isinstance(decision, Reuse)
        if seen is not None:
            self.expected["cache_hits"] += 1
        self.expected["calls"] += 1
        self.state = apply(self.state, call, decision, self.expected["calls"])
        self.model.pop(call.key, None)
        self.model[call.key] = (call.grad, call.session)
        while len(self.model) > self.maxsize:
            self.model.popitem(last=False)

    @rule()
    def bump(self) -> None:
        self.version += 1
        self.state = bump_module_version(self.state, "attribute 'scale' set through the wrapper")

    @invariant()
    def cache_matches_model(self) -> None:
        if not hasattr(self, "state"):
            return
        assert [e.key for e in self.state.entries] == list(self.model)
        stats = self.state.stats
        for name in ("calls", "exports", "reprocesses", "cache_hits"):
            assert getattr(stats, name) == self.expected[name], name


TransitionMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
TestTransitionMachine = TransitionMachine.TestCase


@given(st.integers(0, len(SCHEMAS) - 1), st.integers(0, len(SCHEMAS) - 1))
@settings(deadline=None)
def test_explanations_name_the_changed_path(i: int, j: int) -> None:
    """A re-export between two schemas names a path that exists in one of the two calls."""
    state: ExportState[int] = ExportState()
    first = make_call(i, True, 0, 0, (True, True), "cpu", False)
    state = apply(state, first, decide(state, first), 0)
    decision = decide(state, make_call(j, True, 0, 0, (True, True), "cpu", False))
    if SCHEMAS[i] == SCHEMAS[j]:
        assert decision == Reuse()
    else:
        assert isinstance(decision, Reexport)
        known = set(SCHEMAS[i].paths) | set(SCHEMAS[j].paths) | {"inputs"}
        # A leaf's path, or the path of a container on the way to one.
        assert any(k.startswith(r.path) for r in decision.reasons for k in known)


@given(call_args, st.sampled_from([None, "bfloat16", "float16"]))
@settings(max_examples=100, deadline=None)
def test_autocast_changes_reexport_and_say_so(args: Any, autocast: Any) -> None:
    """A call under another torch.autocast dtype (or in or out of autocast) never reuses a
    graph traced for the old one: the trace records autocast's casts."""
    state: ExportState[str] = ExportState(maxsize=4)
    call = make_call(*args)
    state = apply(state, call, decide(state, call), "p")
    decision = decide(state, make_call(*args[:-2], autocast, args[-1]))
    if autocast == args[-2]:
        assert decision == Reuse()
    else:
        assert isinstance(decision, Reexport)
        (reason,) = [r for r in decision.reasons if r.path == "autocast"]
        assert (reason.seen, reason.given) == (args[-2] or "off", autocast or "off")


@given(st.lists(st.one_of(st.just("bump"), st.integers(0, 8)), max_size=30))
def test_a_bump_never_reuses_a_version_number(steps: list[object]) -> None:
    """Bumps and returns to earlier versions in any order: every bump gives a number never
    given before, so a version returned to never shares its number with another module state's
    graphs."""
    from ortfx.transitions import bump_module_version, return_to_version

    state: ExportState[object] = ExportState()
    given = {0: state.module_version}
    for step in steps:
        if step == "bump":
            state = bump_module_version(state, "changed")
            assert state.module_version.number not in given
            given[state.module_version.number] = state.module_version
        else:
            back = given.get(int(step))  # type: ignore[call-overload]
            if back is not None:
                state = return_to_version(state, back)
                assert state.module_version == back
