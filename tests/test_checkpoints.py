"""Checkpoints of models that contain an ORTModule: state_dict round trips through any ancestor,
what a load reports, the module walks of a parent, torch.save / deepcopy, Hugging Face."""

from __future__ import annotations

import copy
import gc
import io
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ortfx
from tests import models
from tests.models import max_diff

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
ASSIGNED = "(load_state_dict(assign=True) replaced the parameters)"


class Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 8)
        self.block = nn.Sequential(nn.Tanh(), nn.Linear(8, 4))
        self.register_buffer("scale", torch.rand(4) + 0.5)
        self.register_buffer("scratch", torch.zeros(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.lin(x)) * self.scale


class Parent(nn.Module):
    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.pre = nn.Linear(5, 3)
        self.child = child
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.child(self.pre(x)))


def build(kind: str, seed: int, options: ortfx.Options = STRICT) -> Parent:
    """``Parent(Child())`` with weights from ``seed``; its child wrapped if ``kind == "ortfx"``."""
    torch.manual_seed(seed)
    child = Child()
    return Parent(ortfx.ORTModule(child, options=options) if kind == "ortfx" else child)


def assert_same_state(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One SGD step, then the output and the parameter gradients of the next forward/backward."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    out = model(x)
    out.square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_trains_like(model: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    out, grads = step(model, x)
    want_out, want_grads = step(reference, x)
    assert max_diff(out, want_out) <= 1e-6
    assert list(grads) == list(want_grads)
    for name, grad in want_grads.items():
        assert max_diff(grads[name], grad) <= 1e-6, name


# ---- state_dict / load_state_dict through a parent ----------------------------------------------


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
@pytest.mark.parametrize("target", ["plain", "ortfx"])
@pytest.mark.parametrize("source", ["plain", "ortfx"])
def test_state_dict_round_trips_through_a_parent(
    source: str, target: str, strict: bool, assign: bool
) -> None:
    """Property: a parent's state_dict, saved from a plain or an ortfx model, loads into either
    kind (strict or not, copying or assigning): every key matches, the values are the source's,
    and training afterwards matches eager PyTorch; assigning re-exports and says why."""
    x = torch.randn(6, 5)
    src = build(source, seed=1)
    src(x).square().sum().backward()  # an ortfx source has run in ORT
    saved = io.BytesIO()
    torch.save(src.state_dict(), saved)
    saved.seek(0)
    state = torch.load(saved)  # weights_only: a checkpoint file, as users keep them
    dst = build(target, seed=2)
    dst(x)  # an ortfx target has graphs built over its old parameters

    result = dst.load_state_dict(copy.deepcopy(state), strict=strict, assign=assign)

    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert_same_state(dst.state_dict(), state)
    reference = build("plain", seed=3)
    reference.load_state_dict(copy.deepcopy(state), assign=assign)
    assert_trains_like(dst, reference, x)
    if target == "ortfx":
        assert ortfx.stats(dst.child).exports == (2 if assign else 1)
        if assign:
            last = str(ortfx.explain(dst.child)[-1])
            assert last.startswith("re-export: ") and last.endswith(ASSIGNED)


def _load_outcome(model: nn.Module, state: dict[str, Any], *, strict: bool) -> str:
    try:
        return repr(model.load_state_dict(copy.deepcopy(state), strict=strict))
    except RuntimeError as e:
        return f"RuntimeError: {e}"


def _missing_and_unexpected(state: dict[str, Any]) -> None:
    del state["child.lin.bias"]
    del state["child.scale"]
    state["child.block.1.extra"] = torch.zeros(1)
    state["child.extra"] = torch.zeros(1)


def _wrong_size(state: dict[str, Any]) -> None:
    state["child.block.1.weight"] = torch.zeros(2, 2)


def _not_a_tensor(state: dict[str, Any]) -> None:
    state["child.lin.weight"] = [1.0]


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
@pytest.mark.parametrize("spoil", [_missing_and_unexpected, _wrong_size, _not_a_tensor])
def test_a_bad_checkpoint_is_reported_as_pytorch_reports_it(
    spoil: Callable[[dict[str, Any]], None], strict: bool
) -> None:
    """Property: missing keys, unexpected keys and per-key errors of a load into a parent of a
    wrapper are exactly PyTorch's for the plain model (the same text, keys named as the user's
    state_dict() names them, never with ``_original_module``)."""
    state = build("plain", seed=1).state_dict()
    spoil(state)
    plain = _load_outcome(build("plain", seed=2), state, strict=strict)
    wrapped = _load_outcome(build("ortfx", seed=2), state, strict=strict)
    assert wrapped == plain
    assert "_original_module" not in wrapped and "child." in wrapped


def test_non_strict_load_reaches_the_wrapped_module_buffers_included() -> None:
    """Property: strict=False loads every value under the wrapper, BatchNorm's running stats and
    counter included; eval outputs then equal the plain model's."""
    torch.manual_seed(0)
    plain = Parent(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    with torch.no_grad():
        plain.child[1].running_mean.uniform_(-1, 1)
        plain.child[1].running_var.uniform_(0.5, 2)
        plain.child[1].num_batches_tracked.fill_(7)
    torch.manual_seed(1)
    wrapped = Parent(
        ortfx.ORTModule(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), options=STRICT)
    )
    result = wrapped.load_state_dict(plain.state_dict(), strict=False)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    assert_same_state(wrapped.state_dict(), plain.state_dict())
    plain.eval()
    wrapped.eval()
    x = torch.randn(6, 5)
    with torch.no_grad():
        assert max_diff(wrapped(x), plain(x)) <= 1e-6


def test_a_load_through_the_wrapper_itself_and_through_nested_parents() -> None:
    """Property: the same checkpoint loads through the wrapper itself (its own keys) and through
    two levels of parents (keys under ``outer.child.``), and reports missing keys by those names."""
    source = build("plain", seed=1)
    wrapper = ortfx.ORTModule(Child(), options=STRICT)
    child_state = source.child.state_dict()
    assert repr(wrapper.load_state_dict(child_state)) == "<All keys matched successfully>"
    assert_same_state(wrapper.state_dict(), child_state)

    outer = nn.Sequential()
    outer.add_module("outer", build("ortfx", seed=2))
    state = {f"outer.{k}": v for k, v in source.state_dict().items()}
    del state["outer.child.block.1.weight"]
    result = outer.load_state_dict(state, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["outer.child.block.1.weight"], [])
    assert torch.equal(outer.outer.child.lin.weight, source.child.lin.weight)


def test_a_load_that_raised_midway_leaves_nothing_behind() -> None:
    """Property: after a parent's load raised inside the wrapped module (a user's hook), the
    failed load holds no reference to the wrapper, and the next load reports keys by the user's
    names."""
    model = build("ortfx", seed=1)

    def fail(*args: Any) -> None:
        raise ValueError("the user's hook failed")

    model.child.module.lin.register_load_state_dict_pre_hook(fail)
    with pytest.raises(ValueError, match="the user's hook failed"):
        model.load_state_dict(build("plain", seed=2).state_dict())
    wrapper = weakref.ref(model.child)
    del model
    gc.collect()
    assert wrapper() is None

    state = build("plain", seed=3).state_dict()
    del state["child.lin.bias"]
    result = build("ortfx", seed=4).load_state_dict(state, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["child.lin.bias"], [])


# ---- the module walks of a parent ---------------------------------------------------------------


def test_a_parent_walks_its_wrapped_child_like_the_plain_model() -> None:
    """Property: a parent of a wrapper names its modules, parameters and buffers as the plain
    model does (the wrapper is transparent: it is not one of them); apply, train/eval and to()
    reach the wrapped module, the wrapper's training flag is its module's, and outputs and
    gradients match eager after each."""
    plain, wrapped = build("plain", seed=1), build("ortfx", seed=1)
    for walk in ("named_modules", "named_parameters", "named_buffers"):
        assert [n for n, _ in getattr(wrapped, walk)()] == [n for n, _ in getattr(plain, walk)()]
    modules = list(wrapped.modules())
    assert wrapped.child.module in modules
    assert not any(isinstance(m, ortfx.ORTModule) for m in modules)
    x = torch.randn(6, 5)

    for model in (plain, wrapped):
        model.apply(lambda m: m.train(False))
    assert not wrapped.child.training
    with torch.no_grad():
        assert max_diff(wrapped(x), plain(x)) <= 1e-6
    wrapped.train()
    assert wrapped.child.training and wrapped.child.module.lin.training
    wrapped.child.module.eval()
    assert not wrapped.child.training
    wrapped.child.training = True
    assert wrapped.child.module.training

    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.constant_(m.bias, 0.1)

    for model in (plain, wrapped):
        model.train()
        model.apply(init)
    assert_trains_like(wrapped, plain, x)

    for model in (plain, wrapped):
        model.to(torch.float64)
    out = wrapped(x.double())
    assert out.dtype == torch.float64
    assert max_diff(out, plain(x.double())) <= 1e-6  # the weights differ by the step's rounding
    assert "changed dtype" in str(ortfx.explain(wrapped.child)[-1])


# ---- torch.save / torch.load and copy.deepcopy of the whole model -------------------------------

OPTIONS = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE, cache_size=3)


def _saved_and_loaded(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded: nn.Module = torch.load(buffer, weights_only=False)
    return loaded


@pytest.mark.parametrize("renew", [_saved_and_loaded, copy.deepcopy], ids=["save", "deepcopy"])
@pytest.mark.parametrize("whole", ["parent", "bare"])
def test_a_saved_or_copied_model_trains_through_ort(
    whole: str, renew: Callable[[nn.Module], nn.Module]
) -> None:
    """Property: torch.save/torch.load or deepcopy of a model that contains a wrapper (or of a
    bare wrapper), after it trained, gives an independent working model: same outputs and
    gradients, its own graphs built on first use, the same options, checkpoints still load."""
    parent = build("ortfx", seed=1, options=OPTIONS)
    model: nn.Module = parent if whole == "parent" else parent.child
    x = torch.randn(6, 5) if whole == "parent" else torch.randn(6, 3)
    model(x).square().sum().backward()
    model.zero_grad()

    renewed = renew(model)

    wrapper = renewed.child if whole == "parent" else renewed
    assert isinstance(wrapper, ortfx.ORTModule)
    assert ortfx.options_of(wrapper) == OPTIONS
    assert ortfx.stats(wrapper).exports == 0
    assert_trains_like(renewed, model, x)
    assert ortfx.stats(wrapper).exports == 1
    plain = build("plain", seed=4)
    other = plain if whole == "parent" else plain.child
    result = renewed.load_state_dict(other.state_dict())
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    with torch.no_grad():
        assert max_diff(renewed(x), other(x)) <= 1e-6


# ---- Hugging Face --------------------------------------------------------------------------------


def test_hugging_face_save_pretrained_and_from_pretrained(tmp_path: Path) -> None:
    """Property: after training through ortfx, save_pretrained of the wrapped model (through
    ``.module`` or the wrapper) and from_pretrained give the trained weights; they load back into
    a fresh wrapper, whose outputs equal the reloaded plain model's."""
    torch.manual_seed(0)
    wrapped = ortfx.ORTModule(models.tiny_gpt2(), options=STRICT)
    ids = torch.randint(0, 64, (2, 8))
    call = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    wrapped(**call, labels=ids).loss.backward()
    optimizer.step()
    trained = {k: v.clone() for k, v in wrapped.state_dict().items()}

    for name, save in (
        ("inner", wrapped.module.save_pretrained),
        ("wrapper", wrapped.save_pretrained),
    ):
        save(tmp_path / name)
        loaded = type(wrapped.module).from_pretrained(tmp_path / name, attn_implementation="eager")
        assert_same_state(loaded.state_dict(), trained)

    fresh = ortfx.ORTModule(models.tiny_gpt2(), options=STRICT)
    result = fresh.load_state_dict(loaded.state_dict())
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    with torch.no_grad():
        assert max_diff(fresh(**call).logits, loaded(**call).logits) <= 1e-5
    assert ortfx.stats(fresh).exports == 1
