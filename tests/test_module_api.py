"""The nn.Module API of the wrapper: delegation, pickling, user methods, errors."""

from __future__ import annotations

import functools
import inspect
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ortfx
from tests import models
from tests.models import max_diff

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)


class WithMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("offset", torch.zeros(3))

    def forward(self, x: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
        return self.lin(x) / temperature + self.offset

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).argmax(-1)


def test_signature_matches_the_user_forward() -> None:
    model = WithMethod()
    assert inspect.signature(ortfx.ORTModule(model).forward) == inspect.signature(model.forward)


def test_parameters_buffers_and_state_dict_are_the_modules_own() -> None:
    model = WithMethod()
    wrapped = ortfx.ORTModule(model)
    assert [id(p) for p in wrapped.parameters()] == [id(p) for p in model.parameters()]
    assert [n for n, _ in wrapped.named_parameters()] == ["lin.weight", "lin.bias"]
    assert [n for n, _ in wrapped.named_buffers()] == ["offset"]
    assert list(wrapped.state_dict()) == ["offset", "lin.weight", "lin.bias"]
    other = ortfx.ORTModule(WithMethod())
    other.load_state_dict(wrapped.state_dict())
    x = torch.randn(2, 4)
    assert max_diff(other(x), model(x)) <= 1e-6


def test_train_eval_propagate_and_attributes_delegate() -> None:
    model = WithMethod()
    wrapped = ortfx.ORTModule(model)
    wrapped.eval()
    assert not model.training and not model.lin.training and not wrapped.training
    wrapped.train()
    assert model.training
    assert wrapped.lin is model.lin
    wrapped.custom = 5
    assert model.custom == 5


def test_to_float64_reexports_and_matches() -> None:
    model = WithMethod()
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        wrapped(x)
        wrapped.to(torch.float64)
        assert model.lin.weight.dtype == torch.float64
        out = wrapped(x.double())
    assert max_diff(out, model(x.double())) <= 1e-12
    assert "changed dtype" in str(ortfx.explain(wrapped)[-1])


def test_register_buffer_and_apply_through_the_wrapper() -> None:
    model = WithMethod()
    wrapped = ortfx.ORTModule(model)
    wrapped.register_buffer("extra", torch.ones(1))
    assert torch.equal(model.extra, torch.ones(1))
    wrapped.apply(lambda m: nn.init.zeros_(m.bias) if isinstance(m, nn.Linear) else None)
    assert torch.all(model.lin.bias == 0)


def test_user_method_calling_self_runs_through_ort() -> None:
    model = WithMethod()
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(5, 4)
    assert torch.equal(wrapped.predict(x), model.predict(x))
    assert ortfx.stats(wrapped).calls == 1


def _deprecating(function: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator like transformers' deprecation decorators (functools.wraps)."""

    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return wrapped


class Base(WithMethod):
    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return self(x) * 2


class Child(Base):
    @_deprecating
    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return super().scores(x) + 1  # zero-argument super() inside a decorated method


def test_decorated_user_method_calling_super_runs_through_ort() -> None:
    """A user method that calls super() behind a functools.wraps decorator (Phi-3's
    prepare_inputs_for_generation in transformers 5.24) runs, and its self(...) goes through
    ORT: equal to eager (1e-6), one export."""
    torch.manual_seed(0)
    model = Child()
    wrapped = ortfx.ORTModule(model, options=STRICT)
    x = torch.randn(2, 4)
    assert max_diff(wrapped.scores(x), model.scores(x)) <= 1e-6
    assert ortfx.stats(wrapped).calls == 1


def test_pickle_round_trip_then_train() -> None:
    torch.manual_seed(0)
    wrapped = ortfx.ORTModule(models.MLP())
    x = torch.randn(3, 8)
    wrapped(x).sum().backward()
    restored = pickle.loads(pickle.dumps(wrapped))
    assert isinstance(restored, ortfx.ORTModule)
    assert ortfx.stats(restored).calls == 0
    restored.zero_grad()
    out = restored(x)
    out.sum().backward()
    assert max_diff(out, wrapped(x)) <= 1e-6
    assert all(p.grad is not None for p in restored.parameters())


def test_data_parallel_is_rejected_with_the_fix() -> None:
    with pytest.raises(ortfx.OrtfxTorchModelError) as info:
        ortfx.ORTModule(nn.DataParallel(models.MLP()), options=STRICT)
    assert str(info.value) == (
        "ortfx.ORTModule was given a DataParallel; wrapping a (Distributed)DataParallel module is "
        "not supported because the wrapper replicates the module outside ONNX Runtime. Wrap the "
        "inner module instead: DataParallel(ORTModule(model)) or "
        "DistributedDataParallel(ORTModule(model))."
    )


def test_not_a_module_is_rejected() -> None:
    with pytest.raises(
        ortfx.OrtfxTorchModelError, match=r"expects a torch\.nn\.Module, got function"
    ):
        ortfx.ORTModule(lambda x: x)  # type: ignore[arg-type]


def test_input_on_another_device_names_both_devices() -> None:
    wrapped = ortfx.ORTModule(models.MLP(), options=STRICT)
    with pytest.raises(ortfx.OrtfxDeviceError) as info:
        wrapped(torch.empty(2, 8, device="meta"))
    assert str(info.value) == (
        "input args[0] is on meta, but the module is on cpu. "
        "Move the input with .to('cpu') or the module with model.to('meta')."
    )


def test_parameters_on_several_devices_are_rejected() -> None:
    model = models.MLP()
    model.fc2.to("meta")
    wrapped = ortfx.ORTModule(model, options=STRICT)
    with pytest.raises(ortfx.OrtfxDeviceError, match=r"on several devices \(cpu, meta\)"):
        wrapped(torch.randn(2, 8))


def test_transformers_model_train_and_eval_through_the_wrapper() -> None:
    model = models.tiny_gpt2()
    wrapped = ortfx.ORTModule(model)
    assert wrapped.eval() is wrapped and not model.training
    assert wrapped.train() is wrapped and model.training


class WithWrapped(nn.Module):
    """A model holding a wrapped submodule, with torch code around it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = ortfx.ORTModule(WithMethod(), options=STRICT)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.inner(x)))
        return out


@pytest.mark.parametrize("outer", [False, True])
def test_torch_compile_treats_the_wrapper_as_opaque(outer: bool) -> None:
    """torch.compile of the wrapper (or of a model holding it) runs the wrapper's call as it
    is (ortfx is opaque to Dynamo): eager's outputs and gradients, the graph run in ORT."""
    torch.manual_seed(0)
    model = WithWrapped() if outer else ortfx.ORTModule(WithMethod(), options=STRICT)
    wrapper = model.inner if isinstance(model, WithWrapped) else model
    eager = WithWrapped() if outer else WithMethod()
    eager.load_state_dict(model.state_dict())
    if isinstance(eager, WithWrapped):
        eager.inner = eager.inner.module
    compiled = torch.compile(model)
    x = torch.randn(5, 4)
    for _ in range(2):
        got, expected = compiled(x), eager(x)
        torch.testing.assert_close(got, expected)
        got.square().sum().backward()
        expected.square().sum().backward()
    for a, b in zip(eager.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad)
    stats = ortfx.stats(wrapper)
    assert (stats.exports, stats.calls, stats.fallback_calls) == (1, 2, 0)
