"""Parity with PyTorch on everyday paths where a difference would be silent: buffers the forward
updates, in-place changes to inputs, stale parameters, dtypes, the user's own exceptions,
unsupported outputs, ``None`` and returned inputs. All under ``FALLBACK_DISABLE``: a fallback
must not hide a difference. Tolerances: 1e-6 absolute on float32 values unless stated."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
from typing import Any

import pytest
import torch
from torch import nn

import ortfx
from tests.models import max_diff

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)


def _strict(model: nn.Module) -> ortfx.ORTModule:
    return ortfx.ORTModule(model, options=STRICT)


def _assert_state_equal(a: nn.Module, b: nn.Module, tol: float = 1e-6) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert max_diff(sa[k].double(), sb[k].double()) <= tol, k


class ConvBN(nn.Module):
    def __init__(self, momentum: float | None, dims: int = 2) -> None:
        super().__init__()
        conv = nn.Conv2d if dims == 2 else nn.Conv1d
        bn = nn.BatchNorm2d if dims == 2 else nn.BatchNorm1d
        self.conv = conv(3, 4, 3)
        self.bn = bn(4, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)).relu().mean()


class StatefulBuffers(nn.Module):
    """An EMA updated in place and a step counter replaced by a new tensor each call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.ema.mul_(0.9).add_(0.1 * y.detach().mean(0))
        self.steps = self.steps + 1
        return y.square().mean()


@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda: ConvBN(0.1), (4, 3, 8, 8)),
        (lambda: ConvBN(None), (4, 3, 8, 8)),  # cumulative average: factor 1/num_batches
        (lambda: ConvBN(0.3, dims=1), (4, 3, 10)),
        (StatefulBuffers, (5, 4)),
    ],
    ids=["bn2d", "bn2d-momentum-none", "bn1d", "user-buffers"],
)
def test_buffers_updated_in_forward_end_each_step_as_in_pytorch(make: Any, shape: Any) -> None:
    torch.manual_seed(0)
    eager = make()
    wrapped = _strict(copy.deepcopy(eager))
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_w = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(*shape)
        le, lw = eager(x), wrapped(x)
        assert max_diff(le, lw) <= 1e-5, step
        le.backward()
        lw.backward()
        opt_e.step()
        opt_w.step()
        opt_e.zero_grad()
        opt_w.zero_grad()
        _assert_state_equal(
            eager, wrapped.module, tol=1e-5
        )  # after every step, not only at the end
    eager.eval()
    wrapped.eval()
    x = torch.randn(*shape)
    with torch.no_grad():
        assert max_diff(eager(x), wrapped(x)) <= 1e-5
    assert ortfx.stats(wrapped).exports == 2  # train, then eval


def test_the_exporting_call_updates_buffers_exactly_once() -> None:
    torch.manual_seed(0)
    eager = StatefulBuffers()
    wrapped = _strict(copy.deepcopy(eager))
    x = torch.randn(2, 4)
    with torch.no_grad():
        wrapped(x)  # exports (runs the forward once) and runs the graph
        eager(x)
    assert wrapped.module.steps.item() == 1
    _assert_state_equal(eager, wrapped.module)


def test_eval_mode_batchnorm_with_gradients_uses_running_statistics() -> None:
    torch.manual_seed(0)
    eager = ConvBN(0.1)
    eager.bn.running_mean.uniform_(-1, 1)
    eager.bn.running_var.uniform_(0.5, 2)
    eager.eval()
    wrapped = _strict(copy.deepcopy(eager))
    x = torch.randn(2, 3, 8, 8)
    xe, xw = x.clone().requires_grad_(), x.clone().requires_grad_()
    le, lw = eager(xe), wrapped(xw)  # a validation loop without no_grad
    assert max_diff(le, lw) <= 1e-6
    le.backward()
    lw.backward()
    assert max_diff(xe.grad, xw.grad) <= 1e-6
    for (name, p), q in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
        assert max_diff(p.grad, q.grad) <= 1e-5, name


class BNDropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = ConvBN(0.1)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv.bn(self.conv.conv(x)).relu().mean((2, 3))
        return self.head(self.drop(h)).square().mean()


def test_a_submodule_in_the_other_mode_is_traced_in_its_own_mode() -> None:
    """Freezing BatchNorm statistics by ``model.conv.eval()`` (or a dropout by
    ``model.drop.eval()``) leaves the root's flag alone but changes the trace: a new export
    naming the submodules, outputs, gradients and buffers as eager's (1e-5) on every step,
    and the all-train graph reused once ``model.train()`` puts them back."""
    torch.manual_seed(0)
    eager = BNDropNet()
    wrapped = _strict(copy.deepcopy(eager))
    x = torch.randn(4, 3, 8, 8)
    wrapped(x).backward()  # all in train mode: the first export (dropout differs from eager)
    eager(x).backward()
    for model in (eager, wrapped):
        model.zero_grad(set_to_none=True)
        model.conv.eval()  # frozen BatchNorm: running statistics, and no update of them
        model.drop.eval()
    _assert_state_equal(eager, wrapped.module, tol=1e-5)  # before: the first step's updates
    for _ in range(3):
        le, lw = eager(x), wrapped(x)
        assert max_diff(le, lw) <= 1e-5
        le.backward()
        lw.backward()
        for (name, p), q in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
            assert max_diff(p.grad, q.grad) <= 1e-5, name
        _assert_state_equal(eager, wrapped.module, tol=1e-5)
    assert ortfx.stats(wrapped).exports == 2
    assert str(ortfx.explain(wrapped)[-1]) == (
        "re-export: submodule modes was all as the module, now 'conv' eval, 'conv.conv' eval, "
        "'conv.bn' eval, 'drop' eval (a submodule's train/eval mode differs from the module's)"
    )
    wrapped.train()  # every module back in train mode: the first graph again
    wrapped(x)
    assert ortfx.stats(wrapped).exports == 2


def test_a_first_call_under_inference_mode_runs_in_ort() -> None:
    """The tracer cannot record inference tensors: the first call made under
    torch.inference_mode() (a validation pass before training) used to fail its export and
    fall back for good. Traced outside inference mode now: outputs as eager's, in ORT, and
    training afterwards matches eager's gradients (1e-5)."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    wrapped = _strict(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    with torch.inference_mode():
        got, expected = wrapped(x), eager(x)
    assert max_diff(got, expected) <= 1e-6 and got.is_inference()
    wrapped(x).sum().backward()
    eager(x).sum().backward()
    for (name, p), q in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
        assert max_diff(p.grad, q.grad) <= 1e-5, name
    assert ortfx.stats(wrapped).fallback_calls == 0


class ScalesInputInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc(x)


def test_in_place_change_of_an_input_matches_pytorch_on_every_call() -> None:
    torch.manual_seed(0)
    eager = ScalesInputInPlace()
    wrapped = _strict(copy.deepcopy(eager))
    for _ in range(3):
        x = torch.randn(3, 4)
        xe, xw = x.clone(), x.clone()
        ye, yw = eager(xe), wrapped(xw)
        assert max_diff(ye, yw) <= 1e-6  # fc(2x), also on the first (exporting) call
        assert torch.equal(xe, xw)  # the caller's tensor is doubled once, as in PyTorch
        assert torch.equal(xw, x * 2)


def test_in_place_change_of_an_input_that_requires_grad_behaves_as_in_pytorch() -> None:
    """A leaf that requires grad: PyTorch's own RuntimeError (the trace runs with autograd as
    called), the caller's tensor untouched, later calls unaffected. A computed tensor: eager
    changes it and differentiates through the change, which ORT's graph cannot: strict raises
    the typed error naming the input, the default policy runs PyTorch (outputs and the
    gradient reaching the caller's leaf equal eager's, 1e-6)."""
    wrapped = _strict(ScalesInputInPlace())
    x = torch.randn(3, 4, requires_grad=True)
    before = x.detach().clone()
    with pytest.raises(RuntimeError) as info:
        wrapped(x)
    with pytest.raises(RuntimeError) as eager:
        ScalesInputInPlace()(x)
    assert str(info.value) == str(eager.value)
    assert torch.equal(x.detach(), before)  # untouched
    assert max_diff(wrapped(torch.ones(1, 4)), wrapped.module.fc(torch.ones(1, 4) * 2)) <= 1e-6

    computed = torch.randn(3, 4, requires_grad=True) * 1
    with pytest.raises(ortfx.OrtfxIOError) as typed:
        wrapped(computed)
    assert str(typed.value).startswith(
        "input args[0] requires grad and the module's forward changes it in place"
    )
    torch.manual_seed(0)
    eager_model = ScalesInputInPlace()
    default = ortfx.ORTModule(copy.deepcopy(eager_model))
    leaf_e = torch.randn(3, 4, requires_grad=True)
    leaf_w = leaf_e.detach().clone().requires_grad_()
    ye, yw = eager_model(leaf_e * 1), default(leaf_w * 1)
    assert max_diff(ye, yw) <= 1e-6
    ye.sum().backward()
    yw.sum().backward()
    assert max_diff(leaf_e.grad, leaf_w.grad) <= 1e-6
    assert ortfx.stats(default).fallback_calls == 1


def test_stale_parameters_raise_like_pytorch() -> None:
    """out = model(x); optimizer.step(); out.backward(): the weights ORT's backward would read
    changed in place; PyTorch raises, so must ortfx."""
    for model in (nn.Linear(4, 4), _strict(nn.Linear(4, 4))):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(2, 4, requires_grad=True)
        out = model(x)
        out.sum().backward(retain_graph=model.__class__ is nn.Linear)
        opt.step()
        out2 = model(x)
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out2.sum().backward()


def test_half_model_outputs_keep_their_dtype_or_raise() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).half()
    x = torch.randn(3, 4).half()
    with torch.no_grad():
        assert _strict(copy.deepcopy(model))(x).dtype == torch.float16
    with pytest.raises(ortfx.OrtfxRuntimeError, match="returned output as float32, but the module"):
        _strict(copy.deepcopy(model))(x)
    # The default policy falls back: the numbers are PyTorch's, in PyTorch's dtype.
    wrapped = ortfx.ORTModule(copy.deepcopy(model))
    with _quiet():
        y = wrapped(x)
    assert y.dtype == torch.float16 and torch.equal(y, model(x))


class _quiet:
    """The fallback's WARNING line is expected here; keep it out of the test output."""

    def __enter__(self) -> None:
        logging.getLogger("ortfx").disabled = True

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("ortfx").disabled = False


class UserChecks(nn.Module):
    def __init__(self, error: type[Exception]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.error = error

    def forward(self, x: torch.Tensor, check: bool = False) -> torch.Tensor:
        if check:
            raise self.error("the user's check failed: bad batch")
        return self.lin(x)


@pytest.mark.parametrize("error", [ValueError, KeyError, TypeError, AssertionError])
@pytest.mark.parametrize("policy", [ortfx.FallbackPolicy.DISABLE, None])
def test_the_users_own_exception_reaches_the_user(error: type[Exception], policy: Any) -> None:
    options = ortfx.Options(fallback_policy=policy) if policy is not None else ortfx.Options()
    wrapped = ortfx.ORTModule(UserChecks(error), options=options)
    x = torch.randn(2, 4)
    with pytest.raises(error, match="the user's check failed: bad batch") as info:
        wrapped(x, check=True)
    assert type(info.value) is error
    assert not isinstance(info.value, ortfx.OrtfxError)
    s = ortfx.stats(wrapped)
    assert (s.fallback_calls, s.failed_calls) == (0, 1)
    assert "exporter='torchscript'" in repr(wrapped)  # no exporter switch
    assert max_diff(wrapped(x), wrapped.module(x)) <= 1e-6  # the next call runs in ORT
    assert ortfx.stats(wrapped).exports == 1


def test_pytorchs_own_argument_checks_keep_their_type() -> None:
    wrapped = _strict(nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        wrapped(torch.randn(2, 5))
    assert not isinstance(info.value, ortfx.OrtfxError)
    assert max_diff(wrapped(torch.ones(2, 4)), wrapped.module(torch.ones(2, 4))) <= 1e-6
    assert "exporter='torchscript'" in repr(wrapped)


class Box:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class ReturnsBox(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        return {"out": Box(self.lin(x))}


def test_an_unsupported_output_type_is_an_io_error_governed_by_the_data_policy() -> None:
    with pytest.raises(ortfx.OrtfxIOError) as info:
        _strict(ReturnsBox())(torch.randn(2, 4))
    assert "output['out'] has type" in str(info.value) and "Box" in str(info.value)
    data_only = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.UNSUPPORTED_DATA)
    wrapped = ortfx.ORTModule(ReturnsBox(), options=data_only)
    with _quiet():
        out = wrapped(torch.randn(2, 4))
    assert isinstance(out["out"], Box)
    assert ortfx.stats(wrapped).fallback_calls == 1


class ReturnsNone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> None:
        self.seen += x.sum()


def test_a_forward_returning_none_returns_none() -> None:
    eager = ReturnsNone()
    wrapped = _strict(copy.deepcopy(eager))
    for _ in range(2):
        x = torch.randn(2, 4)
        assert wrapped(x) is None and eager(x) is None
    assert max_diff(eager.seen, wrapped.module.seen) <= 1e-5


@dataclasses.dataclass
class Pair:
    kept: torch.Tensor
    made: torch.Tensor


class ReturnsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> Pair:
        return Pair(mask, self.lin(x))


def test_a_returned_input_is_the_callers_tensor_itself() -> None:
    wrapped = _strict(ReturnsInput())
    for grad in (False, True):
        x, mask = torch.randn(2, 4, requires_grad=grad), torch.ones(2, dtype=torch.bool)
        out = wrapped(x, mask)
        assert out.kept is mask
        assert max_diff(out.made, wrapped.module.lin(x)) <= 1e-6


class ChecksValues(nn.Module):
    """A check on tensor values: PyTorch raises for negative inputs on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x < 0).any():
            raise ValueError("negative input")
        return self.lin(x)


def test_a_check_on_tensor_values_runs_on_every_call_as_in_eager(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The check's boolean is a guard: a WARNING names its line once, positive inputs reuse the
    graph, and a negative one raises PyTorch's ValueError (its run gave another value, and
    the forward traced again raises), every time, in ORT."""
    wrapped = _strict(ChecksValues())
    line = inspect.getsourcelines(ChecksValues.forward)[1] + 1
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        wrapped(torch.rand(2, 4))
    (said,) = [r.getMessage() for r in caplog.records if r.name == "ortfx"]
    assert said.startswith(
        "the trace took 1 Python value(s) from tensors (a branch on them, a number computed "
        "from them), which the graph holds as constants: boolean at "
        f"test_parity_paths.py:{line} (tensor values) = False. "
    )
    for _ in range(2):
        with pytest.raises(ValueError, match="negative input"):
            wrapped(-torch.rand(2, 4))
        x = torch.rand(2, 4)
        assert max_diff(wrapped(x), wrapped.module(x)) <= 1e-6
    assert ortfx.stats(wrapped).exports == 1


def test_strict_tracing_refuses_a_graph_that_would_stop_checking() -> None:
    strict = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE, strict_tracing=True)
    with pytest.raises(
        ortfx.OrtfxExportError,
        match="strict_tracing is on and the trace of ChecksValues took 1 Python value",
    ):
        ortfx.ORTModule(ChecksValues(), options=strict)(torch.rand(2, 4))
    # The default policy runs it in PyTorch, where the check runs on every call.
    wrapped = ortfx.ORTModule(ChecksValues(), options=ortfx.Options(strict_tracing=True))
    with _quiet():
        wrapped(torch.rand(2, 4))
        with pytest.raises(ValueError, match="negative input"):
            wrapped(-torch.rand(2, 4))
    # A module the tracer bakes nothing into is unaffected.
    plain = ortfx.ORTModule(nn.Linear(4, 4), options=strict)
    assert max_diff(plain(torch.ones(1, 4)), plain.module(torch.ones(1, 4))) <= 1e-6


class NoHits(nn.Module):
    """Returns the entries above a threshold: legitimately empty for some inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h[h > 100.0]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_an_empty_result_pytorch_rejects_raises_its_error(mode: str) -> None:
    """ORT pools a 2x2 input with a 4x4 kernel into an empty tensor; PyTorch raises. ortfx
    raises PyTorch's error, and the next good call works."""
    pool = nn.Sequential(nn.Conv2d(1, 2, 1), nn.MaxPool2d(4))
    wrapped = _strict(copy.deepcopy(pool))
    getattr(wrapped, mode)()
    getattr(pool, mode)()
    good = torch.randn(1, 1, 8, 8)
    assert max_diff(wrapped(good), pool(good)) <= 1e-6
    with pytest.raises(RuntimeError, match=r"Output size is too small"):
        pool(torch.randn(1, 1, 2, 2))
    with pytest.raises(
        RuntimeError, match=r"Calculated output size: \(2x0x0\)\. Output size is too small"
    ):
        wrapped(torch.randn(1, 1, 2, 2))
    assert max_diff(wrapped(good), pool(good)) <= 1e-6


def test_a_legitimately_empty_result_is_checked_once_per_sizes() -> None:
    """An empty output PyTorch gives too is returned as is (shape and dtype of PyTorch's), and
    the check runs eagerly once per input sizes, not on every call."""
    torch.manual_seed(0)
    model = NoHits()
    wrapped = _strict(copy.deepcopy(model))
    eager_runs: list[int] = []
    wrapped.module.register_forward_hook(lambda *_: eager_runs.append(1))
    x = torch.randn(3, 4)
    for _ in range(4):
        out = wrapped(x)
        assert out.shape == model(x).shape == (0,) and out.dtype == torch.float32
    wrapped(torch.randn(5, 4))
    # One export (a traced forward), then one eager check for each of the two input sizes.
    assert len(eager_runs) == 3
    assert ortfx.stats(wrapped).fallback_calls == 0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_negative_embedding_index_raises_like_pytorch(mode: str, dtype: torch.dtype) -> None:
    """ONNX Gather wraps -1 around to the last row; PyTorch raises IndexError. Good calls
    before and after give PyTorch's rows (padding_idx kept out of the gradient)."""
    embedding = nn.Embedding(10, 3, padding_idx=0)
    wrapped = _strict(copy.deepcopy(embedding))
    getattr(wrapped, mode)()
    good = torch.tensor([[1, 0, 9]], dtype=dtype)
    assert torch.equal(wrapped(good), embedding(good))
    with pytest.raises(IndexError, match="index out of range in self"):
        embedding(torch.tensor([[1, -1]], dtype=dtype))
    with pytest.raises(IndexError, match="index out of range in self"):
        wrapped(torch.tensor([[1, -1]], dtype=dtype))
    out = wrapped(good)
    assert torch.equal(out, embedding(good))
    if mode == "train":
        out.sum().backward()
        assert wrapped.module.weight.grad is not None
        assert torch.equal(wrapped.module.weight.grad[0], torch.zeros(3))
        assert torch.equal(wrapped.module.weight.grad[9], torch.ones(3))


class ReturnsSizes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int, float]:
        return self.lin(x), int(x.shape[0]), len(x), float(x.shape[1]) / 2


class ReturnsConstants(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, str]:
        return self.lin(x), 7, "tag"


def test_python_numbers_computed_from_sizes_follow_each_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``int(x.shape[0])`` returned the export call's value on every later call. Now the graph
    is pinned to its export's sizes, a call with other sizes exports again (WARNING says why),
    and every output equals PyTorch's."""
    torch.manual_seed(0)
    model = ReturnsSizes()
    wrapped = _strict(copy.deepcopy(model))
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        for batch in (3, 5, 5, 2, 3):
            x = torch.randn(batch, 4)
            out, expected = wrapped(x), model(x)
            assert out[1:] == expected[1:] == (batch, batch, 2.0)
            assert max_diff(out[0], expected[0]) <= 1e-6
    assert ortfx.stats(wrapped).exports == 4  # 3, 5, 2, 3: a new export at each change
    assert "serves input sizes [[3, 4]] only" in caplog.text


def test_constant_python_outputs_keep_one_graph_for_all_sizes() -> None:
    """Constants (no tensor turned into a Python number) do not pin the sizes."""
    wrapped = _strict(ReturnsConstants())
    for batch in (3, 5, 2):
        assert wrapped(torch.randn(batch, 4))[1:] == (7, "tag")
    assert ortfx.stats(wrapped).exports == 1


class FunctionalPadding(nn.Module):
    """F.embedding(padding_idx=...) on a parameter, and the same row table through nn.Embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 3))
        self.second = nn.Embedding(10, 3, padding_idx=-1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.table, padding_idx=2) * 2 + self.second(ids)


class ComputedWeightPadding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.table * 2, padding_idx=0)


def test_functional_embedding_padding_row_gets_no_gradient() -> None:
    """``F.embedding(..., padding_idx=2)`` called functionally: the padding row's gradient was
    nonzero in ortfx (ONNX Gather forgets padding_idx), 0 in PyTorch. Outputs and every
    gradient equal PyTorch's (exact), in training and eval."""
    torch.manual_seed(0)
    model = FunctionalPadding()
    wrapped = _strict(copy.deepcopy(model))
    ids = torch.tensor([[2, 3, 2, 9], [9, 9, 0, 2]])
    expected, out = model(ids), wrapped(ids)
    assert torch.equal(out, expected)
    expected.sum().backward()
    out.sum().backward()
    for p, q in zip(model.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
    assert torch.equal(wrapped.module.table.grad[2], torch.zeros(3))
    wrapped.eval()
    model.eval()
    assert torch.equal(wrapped(ids), model(ids))


def test_padding_on_a_computed_weight_is_refused_by_name() -> None:
    wrapped = _strict(ComputedWeightPadding())
    with pytest.raises(ortfx.OrtfxExportError, match=r"padding_idx=0 reads a weight computed"):
        wrapped(torch.tensor([[0, 1]]))


class Flips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h.flip(0) * h + torch.lerp(h, h.flip(0, -1), 0.3)


def test_flip_trains() -> None:
    """``flip`` exported as a negative-step Slice failed in ORT's backward ("narrowing_error");
    now a Gather. Outputs and gradients equal PyTorch's (1e-6), at two batch sizes."""
    torch.manual_seed(0)
    model = Flips()
    wrapped = _strict(copy.deepcopy(model))
    for batch in (3, 5):
        x = torch.randn(batch, 4)
        expected, out = model(x), wrapped(x)
        assert max_diff(out, expected) <= 1e-6
        expected.sum().backward()
        out.sum().backward()
        for p, q in zip(model.parameters(), wrapped.parameters(), strict=True):
            assert max_diff(p.grad, q.grad) <= 1e-5


class WhereBroadcast(nn.Module):
    """``torch.where`` with a value operand computed from a parameter and broadcast along
    some axes, on either side, with the mask over the full shape."""

    def __init__(self, shape: tuple[int, ...], side: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(shape))
        self.side = side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = (self.p * 2).tanh()  # an intermediate: torch cannot sum its gradient for ORT
        pair = (small, x) if self.side == 1 else (x, small)
        return torch.where(x > 0, *pair) * 3


@pytest.mark.parametrize("side", [1, 2])
@pytest.mark.parametrize("shape", [(1, 4, 1, 6), (4, 1, 6), (), (1, 1, 5, 1), (2, 4, 5, 6)])
def test_where_with_a_broadcast_operand_sums_its_gradient(
    shape: tuple[int, ...], side: int
) -> None:
    """ORT's Where gradient hands each operand the output's full-shaped gradient, never summed
    over the axes the operand was broadcast along: the next gradient node failed on the shape
    (T5's position bias under an attention mask). ``passes.where_gradients_reduce`` expands such
    operands first. Outputs and input gradients equal PyTorch's (1e-6), the parameter's
    gradient 1e-5, over two batch sizes; the full-shaped operand (no broadcast) too."""
    torch.manual_seed(0)
    model = WhereBroadcast(shape, side)
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    for batch in (2, 3) if shape != (2, 4, 5, 6) else (2,):
        x = torch.randn(batch, 4, 5, 6)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, got = model(xa), wrapped(xb)
        assert max_diff(got, expected) <= 1e-6
        weights = torch.randn(expected.shape)
        (expected * weights).sum().backward()
        (got * weights).sum().backward()
        assert max_diff(xb.grad, xa.grad) <= 1e-6
        # sums of up to 360 products in another order
        torch.testing.assert_close(wrapped.p.grad, model.p.grad, rtol=1e-5, atol=1e-5)
        model.zero_grad()
        wrapped.zero_grad()


@pytest.mark.parametrize(
    ("norm", "shape"),
    [
        (lambda: nn.GroupNorm(2, 4), (4, 6)),
        (lambda: nn.GroupNorm(4, 4), (4, 5, 3)),  # a group per channel, 2-d
        (lambda: nn.GroupNorm(1, 6, affine=False), (6, 7)),
        (lambda: nn.InstanceNorm1d(4, affine=True), (4, 6)),
        (lambda: nn.InstanceNorm2d(3), (3, 5, 4)),
    ],
    ids=["groups2", "per-channel-2d", "one-group-no-affine", "instance1d-affine", "instance2d"],
)
def test_group_and_instance_norm_train_in_ort(norm: Any, shape: tuple[int, ...]) -> None:
    """ORT cannot differentiate ``InstanceNormalization``, the exporter's form of both: ortfx
    exports them as means and elementwise ops (``symbolics.group_norm``). Outputs, input and
    parameter gradients equal PyTorch's (1e-5) over two batch sizes, affine parameters drawn
    away from their 1/0 start."""
    torch.manual_seed(0)
    model = nn.Sequential(norm())
    for p in model.parameters():
        nn.init.normal_(p)
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    for batch in (2, 3):
        x = torch.randn(batch, *shape) * 2 + 1
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, got = model(xa), wrapped(xb)
        assert max_diff(got, expected) <= 1e-5
        weights = torch.randn(expected.shape)
        (expected * weights).sum().backward()
        (got * weights).sum().backward()
        assert max_diff(xb.grad, xa.grad) <= 1e-5
        for p, q in zip(model.parameters(), wrapped.parameters(), strict=True):
            assert max_diff(q.grad, p.grad) <= 1e-5
        model.zero_grad()
        wrapped.zero_grad()
    assert ortfx.stats(wrapped).exports == 1


class ConditionOnly(nn.Module):
    """An input and a parameter that require grad but only feed a comparison."""

    def __init__(self) -> None:
        super().__init__()
        self.threshold = nn.Parameter(torch.randn(4))
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        keep = (x > 0) & (mask > 0.5) & (self.threshold > 0)
        return torch.where(keep, self.linear(x), x * 0.5)


def test_inputs_reaching_the_output_only_through_a_comparison_get_no_gradient() -> None:
    """ORT refused to build the gradient ("Cannot compute the partial derivative for 'mask' as
    it's unreachable"); PyTorch leaves such a tensor's ``.grad`` None. ortfx builds without
    them: None for the mask and the threshold, every other gradient equal (1e-6), two sizes."""
    torch.manual_seed(0)
    model = ConditionOnly()
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    for batch in (2, 3):
        x, mask = torch.randn(batch, 4), torch.rand(batch, 4)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ma, mb = mask.clone().requires_grad_(), mask.clone().requires_grad_()
        (model(xa, ma) ** 2).sum().backward()
        (wrapped(xb, mb) ** 2).sum().backward()
        assert ma.grad is None and mb.grad is None
        assert max_diff(xb.grad, xa.grad) <= 1e-6
        for (name, p), q in zip(model.named_parameters(), wrapped.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert max_diff(q.grad, p.grad) <= 1e-6, name
        assert wrapped.threshold.grad is None
        model.zero_grad()
        wrapped.zero_grad()
