"""State the forward reads that is not an argument, parameter or buffer (issue 27, part 2).

The tracer bakes every such value into the graph. ortfx records the code that ran during the
trace and guards what it loaded (ortfx.outside): a module global, a helper module's function,
a class attribute or ``forward``, a closure cell, a private attribute, an environment variable,
a config object's field, a small container's contents, a plain tensor attribute's version.
Each test changes one of them between two calls and compares the second call with eager
PyTorch (outputs and gradients within 1e-5), counts the exports and reads the log line that
names the change; all fail on the code before the guards, which reused the first graph.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import random
import sys
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ortfx
from ortfx.outside import MAX_ITEMS
from tests.models import max_diff

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
INFO = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE, log_level=ortfx.LogLevel.INFO)
TOL = 1e-5
THIS = sys.modules[__name__]
SCALE = 2.0
TABLE = [1.0, 2.0]
helper = types.ModuleType("helper")
helper.act = torch.tanh  # type: ignore[attr-defined]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


class ReadsGlobal(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * SCALE


class ReadsGlobalList(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * TABLE[1]


class CallsHelper(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return helper.act(self.fc(x))  # type: ignore[no-any-return]


class Private(Net):
    def __init__(self) -> None:
        super().__init__()
        self._scale = 2.0
        self._act: Callable[[torch.Tensor], torch.Tensor] = torch.tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._act(self.fc(x)) * self._scale


class Environ(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * float(os.environ.get("ORTFX_TEST_SCALE", "1"))


class ClassAttribute(Net):
    scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


class Base(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Sub(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


@dataclasses.dataclass
class Config:
    scale: float = dataclasses.field(default=2.0, repr=False)


class ReadsConfig(Net):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = Config()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.cfg.scale


def _scaled(y: torch.Tensor, cfg: Config) -> torch.Tensor:
    return y * cfg.scale  # the config is not this function's first argument


class PassesConfig(ReadsConfig):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled(self.fc(x), self.cfg)


class ReadsConfigInList(Net):
    def __init__(self) -> None:
        super().__init__()
        self.cfgs = [Config()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.cfgs[0].scale


class ReadsArray(Net):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.table = np.ones(size, dtype=np.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * float(self.table[:4].sum())


class PlainTensor(Net):
    def __init__(self) -> None:
        super().__init__()
        self.mask = torch.ones(4)  # not a buffer: the tracer bakes it as a constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.mask


def _factory() -> tuple[type[Net], Callable[[float], None]]:
    """A class made by a factory, whose forward reads a cell of the factory's closure."""
    scale = 2.0

    class Made(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * scale

    def set_scale(value: float) -> None:
        nonlocal scale
        scale = value

    return Made, set_scale


def _swap_forward(monkeypatch: pytest.MonkeyPatch, cls: type, factor: float) -> None:
    def patched(self: Any, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * factor  # type: ignore[no-any-return]

    monkeypatch.setattr(cls, "forward", patched)


def _made() -> tuple[nn.Module, Callable[[nn.Module], None]]:
    cls, set_scale = _factory()
    return cls(), lambda m: set_scale(5.0)


Case = Callable[[pytest.MonkeyPatch], tuple[nn.Module, Callable[[nn.Module], None]]]

CASES: dict[str, tuple[Case, str]] = {
    "module global rebound (a notebook cell run again)": (
        lambda mp: (ReadsGlobal(), lambda m: mp.setattr(THIS, "SCALE", 3.0)),
        "global 'SCALE' of tests.test_outside_state changed outside the wrapper",
    ),
    "global list changed in place": (
        lambda mp: (ReadsGlobalList(), lambda m: TABLE.__setitem__(1, 5.0)),
        "global 'TABLE' of tests.test_outside_state changed in place outside the wrapper",
    ),
    "helper module's function replaced": (
        lambda mp: (CallsHelper(), lambda m: mp.setattr(helper, "act", torch.sigmoid)),
        "'act' of module helper changed outside the wrapper",
    ),
    "private scalar attribute": (
        lambda mp: (Private(), lambda m: setattr(m, "_scale", 3.0)),
        "attribute '_scale' of Private changed outside the wrapper",
    ),
    "private function attribute": (
        lambda mp: (Private(), lambda m: setattr(m, "_act", torch.sigmoid)),
        "attribute '_act' of Private changed outside the wrapper",
    ),
    "environment variable": (
        lambda mp: (Environ(), lambda m: mp.setenv("ORTFX_TEST_SCALE", "3")),
        "environment variable 'ORTFX_TEST_SCALE' changed",
    ),
    "class attribute": (
        lambda mp: (ClassAttribute(), lambda m: mp.setattr(ClassAttribute, "scale", 3.0)),
        "'scale' of class ClassAttribute changed outside the wrapper",
    ),
    "class forward monkeypatched": (
        lambda mp: (Base(), lambda m: _swap_forward(mp, Base, 4.0)),
        "'forward' of class Base changed outside the wrapper",
    ),
    "base class forward reached through super()": (
        lambda mp: (Sub(), lambda m: _swap_forward(mp, Base, 4.0)),
        "'forward' of class Base changed outside the wrapper",
    ),
    "closure of a factory-made class": (
        lambda mp: _made(),
        "'scale' in the closure of 'forward' of class _factory.<locals>.Made changed",
    ),
    "dataclass field with repr=False changed in place": (
        lambda mp: (ReadsConfig(), lambda m: setattr(m.cfg, "scale", 3.0)),
        "attribute 'scale' of Config changed outside the wrapper",
    ),
    "a config handed to a helper as its second argument": (
        lambda mp: (PassesConfig(), lambda m: setattr(m.cfg, "scale", 3.0)),
        "attribute 'scale' of Config (argument 'cfg' of _scaled) changed outside the wrapper",
    ),
    "a config inside a list attribute": (
        lambda mp: (ReadsConfigInList(), lambda m: setattr(m.cfgs[0], "scale", 3.0)),
        "attribute 'cfgs' of ReadsConfigInList changed in place outside the wrapper",
    ),
    "NumPy array attribute changed in place": (
        lambda mp: (ReadsArray(2000), lambda m: m.table.__setitem__(0, 5.0)),
        "attribute 'table' of ReadsArray changed in place outside the wrapper",
    ),
    "plain tensor attribute changed in place": (
        lambda mp: (PlainTensor(), lambda m: m.mask.mul_(3)),
        "attribute 'mask' of PlainTensor changed in place outside the wrapper",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_change_outside_the_arguments_exports_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """Two calls with the same input around one change: the second equals eager's (outputs
    and gradients, 1e-5), with a second export whose log line names the change."""
    make, said = CASES[case]
    monkeypatch.setenv("ORTFX_TEST_SCALE", "2")
    TABLE[1] = 2.0
    torch.manual_seed(0)
    model, change = make(monkeypatch)
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model, options=INFO)
    x = torch.randn(3, 4)
    with caplog.at_level(logging.INFO, logger="ortfx"):
        assert max_diff(wrapped(x), reference(x)) <= TOL
        change(model)
        change(reference)
        got, expected = wrapped(x), reference(x)
    assert max_diff(got, expected) <= TOL, case
    got.sum().backward()
    expected.sum().backward()
    for (name, a), (_, b) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert max_diff(a.grad, b.grad) <= TOL, name
    assert ortfx.stats(wrapped).exports == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "ortfx"]
    assert any("re-export" in line and said in line for line in lines), lines


def test_nothing_changed_reuses_the_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guards see no change where there is none: an equal scalar set again, a global
    rebound to an equal value, the environment variable set to the same string; one export."""
    model = Private()
    wrapped = ortfx.ORTModule(model, options=STRICT)
    x = torch.randn(3, 4)
    wrapped(x)
    model._scale = float("2.0")  # another float object, equal and of the same type
    monkeypatch.setattr(THIS, "SCALE", float("2.0"))
    for _ in range(3):
        wrapped(x)
    assert ortfx.stats(wrapped).exports == 1


def test_an_int_set_where_a_float_was_exports_again() -> None:
    """``2`` and ``2.0`` are equal but trace as different constants (integer arithmetic)."""
    model = Private()
    wrapped = ortfx.ORTModule(model, options=STRICT)
    x = torch.randn(3, 4)
    wrapped(x)
    model._scale = 2  # type: ignore[assignment]
    wrapped(x)
    assert ortfx.stats(wrapped).exports == 2


def test_tying_weights_after_wrapping_exports_again() -> None:
    """Weights tied after the first call: the second call trains the tied model, as eager."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = Two()
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model, options=STRICT)
    x = torch.randn(3, 4)
    wrapped(x)
    model.b.weight = model.a.weight
    reference.b.weight = reference.a.weight
    got, expected = wrapped(x), reference(x)
    assert max_diff(got, expected) <= TOL
    got.sum().backward()
    expected.sum().backward()
    assert max_diff(model.a.weight.grad, reference.a.weight.grad) <= TOL


BIG = (
    "the forward of ReadsArray reads attribute 'table' of ReadsArray (a ndarray of "
    f"{MAX_ITEMS + 1} items: the graph holds its contents as constants, and comparing them on "
    "every call would cost more than the call). Keep such values in a buffer (register_buffer) "
    "or pass them as arguments, or run the module in PyTorch (the default fallback policy does)."
)


def test_a_container_too_large_to_compare_is_refused() -> None:
    """Over MAX_ITEMS items: refused with a typed error (strict), run in PyTorch (default)."""
    x = torch.randn(3, 4)
    with pytest.raises(ortfx.OrtfxExportError) as raised:
        ortfx.ORTModule(ReadsArray(MAX_ITEMS + 1), options=STRICT)(x)
    assert str(raised.value) == BIG
    model = ReadsArray(MAX_ITEMS + 1)
    wrapped = ortfx.ORTModule(model)
    assert max_diff(wrapped(x), model(x)) <= TOL
    model.table[0] = 7.0
    assert max_diff(wrapped(x), model(x)) <= TOL
    assert ortfx.stats(wrapped).fallback_calls == 2


class DrawsInPython(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * random.random()


class DrawsInNumPy(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * float(np.random.rand())


@pytest.mark.parametrize(
    ("make", "stream"),
    [(DrawsInPython, "Python's random module"), (DrawsInNumPy, "NumPy's global random state")],
)
def test_a_draw_from_python_or_numpy_in_the_forward_is_refused(
    make: Callable[[], nn.Module], stream: str
) -> None:
    """The tracer would keep the drawn number for every call: refused (typed, strict), and
    under the default policy each call runs in PyTorch and draws anew, as eager."""
    x = torch.randn(3, 4)
    with pytest.raises(ortfx.OrtfxExportError) as raised:
        ortfx.ORTModule(make(), options=STRICT)(x)
    assert str(raised.value) == (
        f"the forward of {make.__name__} draws from {stream} while traced: the tracer keeps the "
        "number it drew as a constant, so every later call would reuse it (eager draws anew). "
        "Draw with torch (torch.rand, torch.randint, torch.bernoulli: ortfx draws them in the "
        "graph), or run the module in PyTorch (the default fallback policy does)."
    )
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model)
    random.seed(1)
    np.random.seed(1)
    got = [wrapped(x) for _ in range(3)]
    random.seed(1)
    np.random.seed(1)
    expected = [reference(x) for _ in range(3)]
    for a, b in zip(got, expected, strict=True):
        assert max_diff(a, b) <= TOL
    assert max_diff(got[0], got[1]) > 1e-3  # a new draw each call


SHARED_RNG = random.Random(0)


class HoldsGenerator(Net):
    def __init__(self, make: Callable[[], Any]) -> None:
        super().__init__()
        self.rng = make()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        draw = self.rng.random() if hasattr(self.rng, "random") else self.rng.rand()
        return self.fc(x) * float(draw)


class UsesSharedGenerator(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * SHARED_RNG.uniform(0.5, 1.5)


@pytest.mark.parametrize(
    ("make", "where"),
    [
        (lambda: HoldsGenerator(lambda: random.Random(0)), "attribute 'rng' of HoldsGenerator"),
        (
            lambda: HoldsGenerator(lambda: np.random.default_rng(0)),
            "attribute 'rng' of HoldsGenerator",
        ),
        (
            lambda: HoldsGenerator(lambda: np.random.RandomState(0)),
            "attribute 'rng' of HoldsGenerator",
        ),
        (UsesSharedGenerator, "global 'SHARED_RNG' of tests.test_outside_state"),
    ],
)
def test_a_draw_from_a_generator_the_forward_holds_is_refused(
    make: Callable[[], nn.Module], where: str
) -> None:
    """A random.Random / NumPy Generator or RandomState held by the module or a global: the
    graph would hold the first draw for every call (it did, silently). Refused (typed,
    strict); by default each call runs in PyTorch and draws anew. A module's own generator
    is put back after the trace (eager's draws, 1e-6); a global one has given the refused
    trace one draw (the first call's is its second)."""
    x = torch.randn(3, 4)
    # A draw seen as it happens names the generator's type (Python's random.Random); one
    # the profile hook cannot see (NumPy's Cython methods) is found among the reads.
    with pytest.raises(ortfx.OrtfxExportError) as raised:
        ortfx.ORTModule(make(), options=STRICT)(x)
    said = str(raised.value)
    assert "draws from a random.Random" in said or (
        f"{where} (a " in said
        and "a random number generator: the graph would hold the numbers it drew" in said
    ), said
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model)
    state = SHARED_RNG.getstate()
    got = [wrapped(x) for _ in range(3)]
    SHARED_RNG.setstate(state)
    expected = [reference(x) for _ in range(4)]
    expected = expected[1:] if make is UsesSharedGenerator else expected[:3]
    for a, b in zip(got, expected, strict=True):
        assert max_diff(a, b) <= TOL
    assert max_diff(got[0], got[1]) > 1e-3  # a new draw each call


def test_code_reloaded_in_place_exports_again(caplog: pytest.LogCaptureFixture) -> None:
    """A notebook's autoreload replaces a function's ``__code__`` (and defaults) in place, the
    function object staying the same: the next call runs the new code, as eager does."""

    class Reloaded(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * 2

    def new_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 3  # type: ignore[no-any-return]

    torch.manual_seed(0)
    model = Reloaded()
    wrapped = ortfx.ORTModule(model, options=INFO)
    x = torch.randn(3, 4)
    wrapped(x)
    original = Reloaded.forward.__code__
    try:
        with caplog.at_level(logging.INFO, logger="ortfx"):
            Reloaded.forward.__code__ = new_forward.__code__
            assert max_diff(wrapped(x), model(x)) <= TOL
    finally:
        Reloaded.forward.__code__ = original
    assert ortfx.stats(wrapped).exports == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "ortfx"]
    assert any("the code of 'forward' of class " in line and "(reloaded)" in line for line in lines)


def test_a_forward_that_sets_its_own_attribute_is_no_change() -> None:
    """An attribute the forward itself sets (a private call counter) changes when eager runs
    the forward; that is the forward's own state, not a change behind the graph."""

    class Counts(Net):
        def __init__(self) -> None:
            super().__init__()
            self._calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self._calls += 1
            return self.fc(x)

    model = Counts()
    wrapped = ortfx.ORTModule(model, options=STRICT)
    x = torch.randn(3, 4)
    wrapped(x)
    model(x)  # eager: the counter moves
    assert max_diff(wrapped(x), model(x)) <= TOL
    assert ortfx.stats(wrapped).exports == 1


def test_state_switched_back_and_forth_reuses_both_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A global toggled between two values (an adapter on and off, a DPO loop's reference
    pass): two graphs, each served again when its state is back, every call as eager; a third
    value is a new version (never the graphs of another)."""
    torch.manual_seed(0)
    model = ReadsGlobal()
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model, options=STRICT)
    x = torch.randn(3, 4)
    for value in (2.0, 3.0, 2.0, 3.0, 2.0, 5.0, 3.0):
        monkeypatch.setattr(THIS, "SCALE", value)
        got, expected = wrapped(x), reference(x)
        assert max_diff(got, expected) <= TOL, value
        got.sum().backward()
        expected.sum().backward()
        assert max_diff(model.fc.weight.grad, reference.fc.weight.grad) <= TOL, value
    assert ortfx.stats(wrapped).exports == 3  # 2.0, 3.0 and 5.0


def test_a_module_change_forgets_the_versions_to_return_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a change of the module itself (a parameter replaced), an earlier outside state
    is no way back to graphs traced before it: they read the old parameter."""
    torch.manual_seed(0)
    model = ReadsGlobal()
    wrapped = ortfx.ORTModule(model, options=STRICT)
    x = torch.randn(3, 4)
    wrapped(x)
    monkeypatch.setattr(THIS, "SCALE", 3.0)
    wrapped(x)
    model.fc.weight = nn.Parameter(torch.randn(4, 4))
    monkeypatch.setattr(THIS, "SCALE", 2.0)
    assert max_diff(wrapped(x), model(x)) <= TOL
    assert ortfx.stats(wrapped).exports == 3


@pytest.mark.parametrize("order", ["ORTModule(PeftModel)", "get_peft_model(ORTModule)"])
def test_peft_adapters_switched_in_a_loop(order: str) -> None:
    """PEFT switches adapters through attributes of its LoRA layers (private ones among them):
    ``disable_adapter()`` and ``set_adapter`` compute as in eager on every call (logits 1e-5,
    LoRA gradients 1e-5), and a DPO-like loop (policy, then reference with the adapter off)
    exports once per adapter state, not per call."""
    import peft  # test extras: imported, never skipped
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    base = transformers.GPT2LMHeadModel(config)
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False)
    reference = peft.get_peft_model(copy.deepcopy(base), copy.deepcopy(lora))
    reference.add_adapter("second", copy.deepcopy(lora))
    if order == "ORTModule(PeftModel)":
        peft_model = peft.get_peft_model(copy.deepcopy(base), copy.deepcopy(lora))
        peft_model.add_adapter("second", copy.deepcopy(lora))
        peft_model.load_state_dict(reference.state_dict())
        model: Any = ortfx.ORTModule(peft_model, options=STRICT)
        wrapper = model
    else:
        wrapper = ortfx.ORTModule(copy.deepcopy(base), options=STRICT)
        peft_model = model = peft.get_peft_model(wrapper, copy.deepcopy(lora))
        peft_model.add_adapter("second", copy.deepcopy(lora))
        peft_model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))

    def both(disabled: bool) -> None:
        with contextlib.ExitStack() as stack:
            if disabled:  # the reference pass: base weights only, no gradient
                stack.enter_context(peft_model.disable_adapter())
                stack.enter_context(reference.disable_adapter())
                stack.enter_context(torch.no_grad())
            got = model(input_ids=ids, labels=ids)
            expected = reference(input_ids=ids, labels=ids)
        assert max_diff(got.logits, expected.logits) <= TOL, disabled
        if not disabled:
            got.loss.backward()
            expected.loss.backward()

    for _ in range(3):
        both(disabled=False)
        both(disabled=True)
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    mine = dict(peft_model.named_parameters())
    for name, grad in grads.items():
        assert max_diff(mine[name].grad, grad) <= TOL, name
    assert ortfx.stats(wrapper).exports == 2
    peft_model.set_adapter("second")
    reference.set_adapter("second")
    got, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert max_diff(got, expected) <= TOL


def test_an_equal_tuple_set_again_is_no_change() -> None:
    """A tuple of plain values assigned anew each step (another object, the same constant for
    a trace) reuses the graph, public or private; a different tuple exports again."""

    class Hinted(Net):
        def __init__(self) -> None:
            super().__init__()
            self.hint = (4, 2.0)
            self._shape = (2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * self.hint[1] + self._shape[0]

    model = Hinted()
    wrapped = ortfx.ORTModule(model, options=STRICT)
    x = torch.randn(3, 4)
    for _ in range(3):
        model.hint = tuple([4, 2.0])
        model._shape = tuple([2, 2])
        assert max_diff(wrapped(x), model(x)) <= TOL
    assert ortfx.stats(wrapped).exports == 1
    model.hint = (4, 3.0)
    assert max_diff(wrapped(x), model(x)) <= TOL
    assert ortfx.stats(wrapped).exports == 2


class DrawsFromItsOwnGenerator(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * random.Random().random()  # a fresh generator on every call


def test_a_draw_from_a_generator_the_forward_makes_is_refused() -> None:
    """A generator the forward makes itself is no state to guard, but its draw would be baked
    into the graph all the same (the same number on every call, silently): refused when the
    draw is seen (a typed error, strict; by default PyTorch draws anew on every call)."""
    x = torch.randn(3, 4)
    with pytest.raises(ortfx.OrtfxExportError) as raised:
        ortfx.ORTModule(DrawsFromItsOwnGenerator(), options=STRICT)(x)
    assert str(raised.value).startswith(
        "the forward of DrawsFromItsOwnGenerator draws from a random.Random (random) while "
        "traced: the tracer keeps the number it drew as a constant"
    )
    wrapped = ortfx.ORTModule(DrawsFromItsOwnGenerator())
    assert max_diff(wrapped(x), wrapped(x)) > 1e-3  # a new draw each call
    assert ortfx.stats(wrapped).fallback_calls == 2
