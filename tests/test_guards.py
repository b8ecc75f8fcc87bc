"""Python values the trace takes from tensors (issue 27, part 1).

A forward that turns a tensor into a Python value (``float(mask.sum())``, ``.item()``, an
``if`` on a tensor, ``int(t)`` as an index, ``tolist()``, ``len(t)``) gets a graph holding
that value as a constant. Each such value is a guard: its tensor is an extra graph output,
checked after every run; another value discards the run and computes the call with the graph
for the new value. Every test here compares with eager PyTorch on calls whose values differ
(outputs and gradients within 1e-5 unless stated), and fails on the code before the guards,
which reused the first call's graph with the first call's value.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortfx
from ortfx.runtime.execute import MAX_GUARD_VALUES
from tests.models import backward_both_and_compare, max_diff

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
INFO = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE, log_level=ortfx.LogLevel.INFO)
TOL = 1e-5


def _same_as_eager(
    model: nn.Module,
    calls: Sequence[tuple[Any, ...]],
    *,
    options: ortfx.Options = STRICT,
    train: bool = True,
) -> ortfx.ORTModule:
    """Runs each call through ortfx and through a copy in PyTorch: outputs, and after a
    backward of their sum, every parameter gradient, must match."""
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model, options=options)
    wrapped.train(train)
    reference.train(train)
    for k, args in enumerate(calls):
        got, expected = wrapped(*args), reference(*args)
        assert max_diff(got, expected) <= TOL, (k, got, expected)
        if train:
            backward_both_and_compare(got, expected, model, reference, tol=TOL, where=k)
    return wrapped


class TokenMeanLoss(nn.Module):
    """The loss normalized by a token count taken as a Python float (a common recipe)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        per_token = self.lin(x).squeeze(-1) * mask
        return per_token.sum() / float(mask.sum())


def _mask(*ones: int) -> torch.Tensor:
    return torch.tensor([[1.0] * n + [0.0] * (6 - n) for n in ones])


def test_a_token_count_taken_as_a_float_is_this_calls_count() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4)
    masks = [_mask(6, 6), _mask(3, 5), _mask(6, 6), _mask(2, 2), _mask(3, 5)]
    wrapped = _same_as_eager(TokenMeanLoss(), [(x, m) for m in masks])
    stats = ortfx.stats(wrapped)
    # one graph per count (12, 8, 4), each reused when its count comes back
    assert (stats.calls, stats.exports) == (5, 3)


def test_the_first_guard_says_where_and_what_once(caplog: pytest.LogCaptureFixture) -> None:
    line = inspect.getsourcelines(TokenMeanLoss.forward)[1] + 2
    x = torch.randn(2, 6, 4)
    wrapped = ortfx.ORTModule(TokenMeanLoss(), options=INFO)
    with caplog.at_level(logging.INFO, logger="ortfx"):
        wrapped(x, _mask(6, 6))
        wrapped(x, _mask(6, 6))
        wrapped(x, _mask(3, 5))
    said = [r.getMessage() for r in caplog.records if r.name == "ortfx"]
    guarded = [m for m in said if m.startswith("the trace took")]
    assert guarded[0] == (
        "the trace took 1 Python value(s) from tensors (a branch on them, a number computed "
        "from them), which the graph holds as constants: float at "
        f"test_guards.py:{line} (tensor values) = 12.0. ortfx checks each after every run, and "
        "a call that gives another value is computed again with a graph for that value (said "
        "once per graph)"
    )
    assert len(guarded) == 2  # once per graph: the second graph holds 8.0
    (reexport,) = [m for m in said if m.startswith("re-export: values baked in")]
    assert reexport.startswith(
        f"re-export: values baked in was test_guards.py:{line} = 12.0, now "
        f"test_guards.py:{line} = 8.0 (a Python value the trace took from a tensor changed)"
    )


class ItemScale(nn.Module):
    """Scales by a Python number read with ``.item()``, clipped with Python's ``max``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        scale = max(1.0, x.abs().max().item())
        return h / scale


def test_item_and_python_max_of_it_follow_each_call() -> None:
    torch.manual_seed(0)
    small = torch.rand(3, 4) * 0.5  # the max clips to 1.0: one graph for all of them
    calls = [(small,), (small * 0.9,), (torch.full((3, 4), 3.0),), (small * 0.5,)]
    wrapped = _same_as_eager(ItemScale(), calls)
    # 1.0 for the small ones: max(1.0, m) compares m first (a guarded boolean), then takes
    # the item (guarded too) only when it is larger
    assert ortfx.stats(wrapped).exports <= 4
    assert ortfx.stats(wrapped).calls == 4


class FirstValid(nn.Module):
    """Keeps the first ``int(count)`` positions: an integer index from a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return self.lin(x[:, : int(count)]).sum(dim=1)


def test_an_int_taken_from_a_tensor_slices_each_call_as_given() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4)
    calls = [(x, torch.tensor(4)), (x, torch.tensor(2)), (x, torch.tensor(4))]
    wrapped = _same_as_eager(FirstValid(), calls)
    assert ortfx.stats(wrapped).exports == 2


class Chunks(nn.Module):
    """Splits by lengths given as a tensor (``tolist``), and counts chunks with ``len``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        parts = torch.split(self.lin(x), lengths.tolist())
        return torch.stack([p.mean(dim=0) for p in parts]) * len(lengths)


def test_tolist_lengths_split_each_call_as_given() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    calls = [(x, torch.tensor([2, 4])), (x, torch.tensor([5, 1])), (x, torch.tensor([2, 4]))]
    wrapped = _same_as_eager(Chunks(), calls)
    assert ortfx.stats(wrapped).exports == 2


class IterRows(nn.Module):
    """Iterates over the rows of a tensor of weights (Python iteration over a tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        out = torch.zeros_like(h)
        for w in weights:
            out = out + h * w
        return out


def test_iterating_over_a_tensor_follows_its_length() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    calls = [(x, torch.rand(2)), (x, torch.rand(3)), (x, torch.rand(2))]
    wrapped = _same_as_eager(IterRows(), calls)
    assert ortfx.stats(wrapped).exports == 2


class LastBatch(nn.Module):
    """Averages with the batch size as a float and scales by sqrt of the width (sizes)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) / math.sqrt(x.shape[-1])
        return h.sum(dim=0) / float(x.shape[0])


def test_sizes_taken_as_numbers_follow_the_last_short_batch() -> None:
    torch.manual_seed(0)
    batches = [
        (torch.randn(4, 8),),
        (torch.randn(4, 8),),
        (torch.randn(3, 8),),
        (torch.randn(4, 8),),
    ]
    wrapped = _same_as_eager(LastBatch(), batches)
    assert ortfx.stats(wrapped).exports == 2


def test_values_from_sizes_are_said_at_info_only(caplog: pytest.LogCaptureFixture) -> None:
    """Specializing on sizes is what every tracer does: no WARNING for it."""
    wrapped = ortfx.ORTModule(LastBatch(), options=INFO)
    with caplog.at_level(logging.INFO, logger="ortfx"):
        wrapped(torch.randn(4, 8))
    said = [r for r in caplog.records if r.name == "ortfx" and "the trace took" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO]
    line = inspect.getsourcelines(LastBatch.forward)[1] + 1
    assert (
        f"float at test_guards.py:{line} (sizes) = 8.0; "
        f"float at test_guards.py:{line + 1} (sizes) = 4.0."
    ) in said[0].getMessage()


class Gate(nn.Module):
    """A branch on tensor values: a different layer above a threshold."""

    def __init__(self) -> None:
        super().__init__()
        self.low, self.high = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:
            return self.high(x)
        return self.low(x)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_a_branch_on_values_takes_each_calls_side(train: bool) -> None:
    torch.manual_seed(0)
    up, down = torch.rand(3, 4) + 0.1, -torch.rand(3, 4) - 0.1
    calls = [(up,), (down,), (up * 2,), (down * 2,)]
    if train:
        wrapped = _same_as_eager(Gate(), calls, train=True)
    else:
        with torch.no_grad():
            wrapped = _same_as_eager(Gate(), calls, train=False)
    assert ortfx.stats(wrapped).exports == 2


class NaNCheck(nn.Module):
    """A float that may be NaN (a loss guard): NaN must equal NaN, not export each call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        peak = float(x.max())
        return self.lin(x) * (0.0 if math.isnan(peak) else 1.0)


def test_a_nan_value_is_one_value() -> None:
    nan = torch.full((2, 4), float("nan"))
    wrapped = ortfx.ORTModule(NaNCheck(), options=STRICT).eval()
    with torch.no_grad():
        for _ in range(3):
            out = wrapped(nan)
            assert torch.isnan(out).all()  # NaN * 0.0 stays NaN, as in eager
    assert ortfx.stats(wrapped).exports == 1


class Counter(nn.Module):
    """A value that changes on every call: a graph per value would never end."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * int(n)


def test_a_value_that_keeps_changing_is_refused_with_a_typed_error() -> None:
    wrapped = ortfx.ORTModule(Counter(), options=STRICT)
    x = torch.randn(2, 4)
    limit = MAX_GUARD_VALUES["data"]
    for n in range(1, limit + 1):
        assert max_diff(wrapped(x, torch.tensor(n)), wrapped.module(x, torch.tensor(n))) <= TOL
    line = inspect.getsourcelines(Counter.forward)[1] + 1
    with pytest.raises(ortfx.OrtfxTorchModelError) as raised:
        wrapped(x, torch.tensor(limit + 1))
    assert str(raised.value).startswith(
        f"the forward takes a Python value from a tensor at test_guards.py:{line} (integer), "
        f"which the traced graph holds as a constant, and it has taken {limit + 1} different "
        "values so far ("
    )
    # the state is as it was: known values still run in ORT without exporting
    exports = ortfx.stats(wrapped).exports
    assert max_diff(wrapped(x, torch.tensor(2)), wrapped.module(x, torch.tensor(2))) <= TOL
    assert ortfx.stats(wrapped).exports == exports


def test_the_default_policy_runs_a_changing_value_in_pytorch_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wrapped = ortfx.ORTModule(Counter())
    x = torch.randn(2, 4)
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        for n in range(1, 8):
            assert max_diff(wrapped(x, torch.tensor(n)), wrapped.module(x, torch.tensor(n))) <= TOL
    stats = ortfx.stats(wrapped)
    assert stats.fallback_calls >= 1
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "ortfx")
    assert "different values so far" in said


class FunctionItem(torch.autograd.Function):
    """A custom Function that reads ``.item()`` in its own forward: ORT calls it at run time,
    so its value is never baked (no guard, no re-export)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * x.abs().max().item()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class UsesFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FunctionItem.apply(self.lin(x))


def test_a_custom_functions_own_item_is_not_a_guard() -> None:
    torch.manual_seed(0)
    calls = [(torch.randn(2, 4),), (torch.randn(2, 4) * 5,), (torch.randn(2, 4),)]
    wrapped = _same_as_eager(UsesFunction(), calls)
    assert ortfx.stats(wrapped).exports == 1


def test_threads_with_different_values_each_get_their_own() -> None:
    """Two threads, each with its own mask count, on one wrapper: every result is its own."""
    torch.manual_seed(0)
    model = TokenMeanLoss()
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model, options=STRICT)
    x = torch.randn(2, 6, 4)
    masks = [_mask(6, 6), _mask(1, 2)]
    failures: list[str] = []

    def work(mask: torch.Tensor) -> None:
        expected = reference(x, mask)
        for _ in range(10):
            got = wrapped(x, mask)
            if max_diff(got, expected) > TOL:
                failures.append(f"{float(mask.sum())}: {float(got)} != {float(expected)}")

    threads = [threading.Thread(target=work, args=(m,)) for m in masks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    # two graphs; a graph one thread cached while the other committed is not merged (see
    # records.rebase): it may be built once more
    assert ortfx.stats(wrapped).exports in (2, 3)


class ModuleStateSize(nn.Module):
    """A branch on a size fixed by a parameter's shape (what ORT folds into a constant before
    building the gradient graph): the guard output it folds is put back, not a build error."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.lin.weight
        if w.reshape(2, -1).shape[-1] == w.shape[0] * 2:
            return self.lin(x) * 2
        return self.lin(x)


def test_a_guard_on_a_constant_size_builds_and_matches() -> None:
    torch.manual_seed(0)
    calls = [(torch.randn(2, 4),), (torch.randn(5, 4),)]
    wrapped = _same_as_eager(ModuleStateSize(), calls)
    assert ortfx.stats(wrapped).exports == 1


def test_a_guard_in_a_loss_helper_used_by_many_modules(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A library-style helper that normalizes by ``float(weights.sum())``: the line named is
    the helper's, and each module's graphs follow their own values."""

    def normalized(h: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return (h * weights).sum() / float(weights.sum())

    class A(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return normalized(self.lin(x).squeeze(-1), w)

    torch.manual_seed(0)
    x = torch.randn(5, 3)
    calls = [(x, torch.ones(5)), (x, torch.tensor([1.0, 0, 1, 0, 1])), (x, torch.ones(5))]
    for _ in range(2):
        wrapped = _same_as_eager(A(), calls)
        assert ortfx.stats(wrapped).exports == 2


def test_dropout_with_a_guard_draws_a_new_mask_each_call_and_backpropagates_it() -> None:
    """A discarded run (a guard missed) leaves nothing behind: the call computed again has a
    fresh dropout mask, and its backward is the backward of the output it returned (the
    gradient of a linear layer's bias is the mask, scaled: it must be zero where the output
    was dropped)."""

    class Dropped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.drop = nn.Linear(16, 16), nn.Dropout(0.5)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.drop(self.lin(x)) / float(mask.sum())

    torch.manual_seed(0)
    wrapped = ortfx.ORTModule(Dropped(), options=STRICT)
    x = torch.randn(1, 16)
    outputs = []
    for count in (4, 4, 2, 2, 4):
        wrapped.zero_grad()
        out = wrapped(x, torch.ones(count))
        out.sum().backward()
        bias_grad = wrapped.module.lin.bias.grad
        assert torch.equal(bias_grad == 0, out[0] == 0), count
        assert torch.allclose(bias_grad[out[0] != 0], torch.tensor(2.0 / count))
        outputs.append(out)
    assert not torch.equal(outputs[0], outputs[1])
    assert ortfx.stats(wrapped).exports == 2


def test_cross_entropy_with_ignore_index_counts_each_batch() -> None:
    """F.cross_entropy's own mean never converts; a user's count of valid labels does."""

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 5)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            valid = int((y != -100).sum())
            return F.cross_entropy(self.lin(x), y, reduction="sum") / max(valid, 1)

    torch.manual_seed(0)
    x = torch.randn(6, 4)
    calls = [
        (x, torch.tensor([0, 1, 2, 3, 4, 0])),
        (x, torch.tensor([0, -100, 2, -100, 4, 0])),
        (x, torch.tensor([-100] * 6)),
    ]
    wrapped = _same_as_eager(Loss(), calls)
    assert ortfx.stats(wrapped).calls == 3


class Nested(nn.Module):
    """Branches whose guards differ by path: the second check exists on one side only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if x.mean() > 0:
            if x.max() > 1:
                return h * 3
            return h * 2
        return h


def test_graphs_of_different_paths_are_found_again_without_exporting() -> None:
    """Three paths, three graphs; calls alternating between them afterwards find theirs (a
    discarded run says which value differed first, and the graph following it is tried)."""
    torch.manual_seed(0)
    small, big, down = torch.rand(3, 4) * 0.5 + 0.1, torch.rand(3, 4) + 1.5, -torch.rand(3, 4)
    calls = [(small,), (down,), (big,), (down,), (small,), (big,), (small,), (down,)]
    wrapped = _same_as_eager(Nested(), calls)
    assert ortfx.stats(wrapped).exports == 3
