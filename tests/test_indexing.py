"""Indexed reads and writes as PyTorch does them (ortfx.export.indexing).

Bounds: ONNX's Gather/GatherElements/ScatterElements take -1 as the last position, OneHot writes zeros
for a class it does not have, and ORT's loss kernels read a negative target as a class: each
returned a value where PyTorch raises. Every op of the family is checked in training and in
eval mode, under ``FALLBACK_DISABLE``: the wrapped call raises PyTorch's exception type and
text, the graph is not exported again, and the next good call still gives eager's values
(outputs within 1e-6, gradients within 1e-5).

Accumulation: writes that add at repeated indices (scatter_add, scatter_reduce("sum"),
index_put(accumulate=True)) give eager's values and gradients (1e-5), for the written tensor
and for the updates; reducing scatters ORT would differentiate wrongly are refused with a typed
error; below opset 16 an accumulating write is refused at export. A scatter source larger than
its index falls back when it needs a gradient, so PyTorch's backward raises as in eager."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortfx
from tests.models import max_diff

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)

Op = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# name -> (op of (float [4, 5], int64 [4, 2]) -> tensor, the index entry set out of bounds)
OPS: dict[str, Op] = {
    "gather": lambda x, i: torch.gather(x, 1, i),
    "scatter": lambda x, i: torch.zeros_like(x).scatter(1, i, x[:, :2].contiguous()),
    "scatter_value": lambda x, i: x.scatter(1, i, 2.0),
    "scatter_add": lambda x, i: torch.zeros_like(x).scatter_add(1, i, x[:, :2].contiguous()),
    "scatter_reduce": lambda x, i: x.scatter_reduce(1, i, x[:, :2].contiguous(), "sum"),
    "scatter_reduce_amax": lambda x, i: x.scatter_reduce(1, i, x[:, :2].contiguous(), "amax"),
    "index_select": lambda x, i: torch.index_select(x, 1, i[0]),
    "embedding_bag": lambda x, i: F.embedding_bag(i, x.t().contiguous(), mode="sum"),
    "index_copy": lambda x, i: x.index_copy(1, i[0], x[:, :2].contiguous()),
    "one_hot": lambda x, i: x * F.one_hot(i[:, 0], 5).float(),
    "nll_loss": lambda x, i: F.nll_loss(F.log_softmax(x, 1), i[:, 0]),
    "nll_loss_none": lambda x, i: F.nll_loss(F.log_softmax(x, 1), i[:, 0], reduction="none"),
    "nll_loss_2d": lambda x, i: F.nll_loss(F.log_softmax(x, 1)[:, :, None, None], i[:, :1, None]),
    "cross_entropy": lambda x, i: F.cross_entropy(x, i[:, 0]),
    "cross_entropy_sum": lambda x, i: F.cross_entropy(x, i[:, 0], reduction="sum"),
    "cross_entropy_weight": lambda x, i: F.cross_entropy(x, i[:, 0], weight=torch.arange(5.0)),
    "cross_entropy_positions": lambda x, i: F.cross_entropy(x[:, :, None], i[:, :1]),
    "cross_entropy_unbatched": lambda x, i: F.cross_entropy(x[0], i[0, 0]),
}


class Indexed(nn.Module):
    def __init__(self, op: Op) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.op = op

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.op(self.lin(x), index)


# ORT 1.19 has no gradient for a NegativeLogLikelihoodLoss the exporter does not fuse with its
# log_softmax, nor for the Loop of an embedding bag; ortfx refuses ORT's gradient of scatter_reduce("amax") (training falls back to
# PyTorch, loudly): checked in eval mode only.
EVAL_ONLY = {"nll_loss_2d", "scatter_reduce_amax", "embedding_bag"}
CASES = [(name, mode) for name in sorted(OPS) for mode in ("train", "eval")]
CASES = [(name, mode) for name, mode in CASES if not (mode == "train" and name in EVAL_ONLY)]

GOOD = torch.tensor([[0, 1], [2, 3], [4, 0], [1, 1]])


def _with(value: int) -> torch.Tensor:
    index = GOOD.clone()
    index[0, 0] = value
    return index


def _eager_error(model: nn.Module, x: torch.Tensor, index: torch.Tensor) -> BaseException:
    with pytest.raises((IndexError, RuntimeError)) as raised:
        model(x, index)
    return raised.value


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_out_of_bounds_index_raises_like_pytorch(name: str, mode: str) -> None:
    """-1, one past the end and below -size raise PyTorch's error; good calls around them
    match eager and the graph is exported once."""
    torch.manual_seed(0)
    model = Indexed(OPS[name])
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    getattr(model, mode)()
    getattr(wrapped, mode)()
    x = torch.randn(4, 5)

    def good_call() -> None:
        out = wrapped(x, GOOD)
        expected = model(x, GOOD)
        assert max_diff(out, expected) <= 1e-6
        if mode == "train":
            out.sum().backward()
            expected.sum().backward()
            for (path, a), b in zip(wrapped.named_parameters(), model.parameters(), strict=True):
                assert a.grad is not None and b.grad is not None, path
                assert max_diff(a.grad, b.grad) <= 1e-5, path
                a.grad, b.grad = None, None

    good_call()
    for value in (-1, 5, -6):
        error = _eager_error(model, x, _with(value))
        with pytest.raises(type(error), match=re.escape(str(error).splitlines()[0])):
            wrapped(x, _with(value))
        good_call()
    stats = ortfx.stats(wrapped)
    assert stats.exports == 1
    assert stats.fallback_calls == 0


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_one_hot_infers_the_class_count(mode: str) -> None:
    """``F.one_hot(i)`` without ``num_classes`` has ``max(i) + 1`` classes, a count that follows
    each call's indices (ONNX's OneHot takes no -1); a negative index raises PyTorch's error."""
    model = Indexed(lambda x, i: F.one_hot(i[:, 0]).float().sum(0) * x.sum())
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    getattr(model, mode)()
    getattr(wrapped, mode)()
    x = torch.randn(4, 5)
    for index in (GOOD, GOOD.clamp(max=2), _with(7)):
        out, expected = wrapped(x, index), model(x, index)
        assert out.shape == expected.shape
        assert max_diff(out, expected) <= 1e-6
    error = _eager_error(model, x, _with(-1))
    with pytest.raises(type(error), match=re.escape(str(error).splitlines()[0])):
        wrapped(x, _with(-1))
    assert ortfx.stats(wrapped).fallback_calls == 0


def test_negative_indices_torch_allows_still_wrap() -> None:
    """Tensor indexing takes -1 as the last row in PyTorch: no check there."""
    model = Indexed(lambda x, i: x[i[0]].sum() + x[:, i[:, 0]])
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    x = torch.randn(4, 5)
    index = _with(-1)
    assert max_diff(wrapped(x, index), model(x, index)) <= 1e-6
    assert ortfx.stats(wrapped).fallback_calls == 0


def test_ignored_targets_are_not_out_of_bounds() -> None:
    """``ignore_index`` (-100 by default, or any value) is no class: it never raises."""
    model = Indexed(
        lambda x, i: F.cross_entropy(x, i[:, 0]) + F.cross_entropy(x, i[:, 1], ignore_index=7)
    )
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    x = torch.randn(4, 5)
    index = torch.tensor([[-100, 7], [2, 3], [4, 7], [-100, 1]])
    out, expected = wrapped(x, index), model(x, index)
    assert max_diff(out, expected) <= 1e-6
    out.backward()
    expected.backward()
    assert wrapped.lin.weight.grad is not None and model.lin.weight.grad is not None
    assert max_diff(wrapped.lin.weight.grad, model.lin.weight.grad) <= 1e-6


REPEATED = torch.tensor([[0, 1], [2, 2], [4, 0], [1, 1]])  # rows 1 and 3 repeat a column

Write = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# name -> write of updates b [4, 2] into a [4, 5], both computed from parameters
WRITES: dict[str, Write] = {
    "scatter_add": lambda a, b: a.scatter_add(1, REPEATED, b),
    "scatter_reduce_sum": lambda a, b: a.scatter_reduce(1, REPEATED, b, "sum"),
    "index_put_rows": lambda a, b: a.index_put(
        (torch.tensor([0, 0, 2]),), b[:3].repeat(1, 3)[:, :5], accumulate=True
    ),
    "index_put_points": lambda a, b: a.index_put(
        (torch.tensor([0, 0, 2]), torch.tensor([1, 1, 3])), b[:3, 0], accumulate=True
    ),
    "index_put_scalar": lambda a, b: a.index_put(
        (torch.tensor([0, 0, 2]),), b[0, 0], accumulate=True
    ),
    "index_put_mask": lambda a, b: a.index_put((a > 0,), a[a > 0] * b[0, 0], accumulate=True),
    "index_put_mask_scalar": lambda a, b: a.index_put((a > 0,), b[0, 0], accumulate=True),
}


class Writes(nn.Module):
    def __init__(self, write: Write) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 2)
        self.write = write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.write(self.a(x), self.b(x))


@pytest.mark.parametrize("name", sorted(WRITES))
def test_accumulating_writes_add_at_repeated_indices(name: str) -> None:
    """Repeated indices add up, in values and in both gradients (the exporter's form kept
    one update; ORT's gradient of a reducing scatter's input ignored the reduction)."""
    torch.manual_seed(0)
    model = Writes(WRITES[name])
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    weights = torch.randn(4, 5)
    for _ in range(2):
        x = torch.randn(4, 5)
        out, expected = wrapped(x), model(x)
        assert max_diff(out, expected) <= 1e-5
        (out * weights).sum().backward()
        (expected * weights).sum().backward()
    for (path, a), b in zip(wrapped.named_parameters(), model.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, path
        assert max_diff(a.grad, b.grad) <= 1e-5, path
    assert ortfx.stats(wrapped).exports == 1


@pytest.mark.parametrize(("reduce", "onnx"), [("amax", "max"), ("amin", "min"), ("prod", "mul")])
def test_reducing_scatter_gradient_is_refused(reduce: str, onnx: str) -> None:
    """ORT differentiates scatter_reduce("amax"/"amin"/"prod") as a plain scatter: training
    raises a typed error naming the node (a fallback under the default policy); the forward
    alone (eval) runs in ORT with eager's values."""
    torch.manual_seed(0)
    model = Writes(lambda a, b: a.scatter_reduce(1, REPEATED, b, reduce))  # type: ignore[arg-type]
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    x = torch.randn(4, 5)
    with pytest.raises(
        ortfx.OrtfxUnsupportedOpError,
        match=re.escape(
            "cannot differentiate operator ScatterElements (node /module/ScatterElements) of the "
            f"exported graph (its gradient of a ScatterElements with reduction '{onnx}' ignores "
            "the reduction"
        ),
    ):
        wrapped(x)
    wrapped.eval()
    model.eval()
    with torch.no_grad():
        assert max_diff(wrapped(x), model(x)) <= 1e-6
    fallback = ortfx.ORTModule(copy.deepcopy(model).train())
    out = fallback(x)
    assert max_diff(out, model.train()(x)) <= 1e-6
    assert ortfx.stats(fallback).fallback_calls == 1


@pytest.mark.parametrize("name", ["scatter_add", "index_put_rows"])
def test_accumulating_write_below_opset_16_is_refused(name: str) -> None:
    """Below opset 16 ONNX has no reducing scatter: the export is refused, saying why."""
    options = ortfx.Options(opset_version=14, fallback_policy=ortfx.FallbackPolicy.DISABLE)
    wrapped = ortfx.ORTModule(Writes(WRITES[name]), options=options)
    with pytest.raises(
        ortfx.OrtfxExportError,
        match=re.escape(
            "adds the updates at repeated indices, which ONNX can express only from opset 16 on"
        ),
    ):
        wrapped(torch.randn(4, 5))


class LargerSource(nn.Module):
    """A scatter whose source (a parameter) is larger than the index."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.x, self.src = nn.Parameter(torch.randn(4, 5)), nn.Parameter(torch.randn(4, 5))
        self.how = how

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        if self.how == "scatter":
            return self.x.scatter(1, index, self.src)
        if self.how == "scatter_add":
            return self.x.scatter_add(1, index, self.src)
        return self.x.scatter_reduce(1, index, self.src, "sum")


@pytest.mark.parametrize("how", ["scatter", "scatter_add", "scatter_reduce"])
def test_source_larger_than_index_raises_in_backward_like_pytorch(how: str) -> None:
    """PyTorch writes the first index.shape elements of a larger source, and its backward then
    raises (an invalid gradient for the source); the exporter's form trained on silently. Such
    a call fails its run in ORT and falls back to PyTorch (a typed error when fallback is off):
    eager's values, then eager's error in the backward, also through a graph a call without
    gradients exported; an index of the source's shape gives eager's values and gradients
    (1e-6 / 1e-5)."""
    torch.manual_seed(0)
    model = LargerSource(how)
    strict = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    small = torch.tensor([[0, 1], [2, 3], [4, 0], [1, 1]])
    with pytest.raises(ortfx.OrtfxRuntimeError, match="ONNX Runtime failed to run the forward"):
        strict(small)
    wrapped = ortfx.ORTModule(copy.deepcopy(model))
    full = torch.tensor([[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [0, 0, 1, 1, 2], [1, 2, 3, 4, 0]])
    if how == "scatter":  # a plain scatter keeps one of repeated writes: unique per row
        full = torch.stack([torch.randperm(5) for _ in range(4)])
    expected = model(small)
    with pytest.raises(RuntimeError) as raised:
        expected.sum().backward()
    out = wrapped(small)
    assert max_diff(out, expected) <= 1e-6
    with pytest.raises(RuntimeError, match=re.escape(str(raised.value))):
        out.sum().backward()
    for index in (full, full.flip(0)):
        out, expected = wrapped(index), model(index)
        assert max_diff(out, expected) <= 1e-6
        out.sum().backward()
        expected.sum().backward()
    for (path, a), b in zip(wrapped.named_parameters(), model.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, path
        assert max_diff(a.grad, b.grad) <= 1e-5, path
    with torch.no_grad():
        assert max_diff(wrapped(small), model(small)) <= 1e-6
    stats = ortfx.stats(wrapped)
    # The fallback holds for the input schema (dynamic sizes: every index above); the call
    # without gradients is a schema of its own, which falls back too.
    assert stats.fallback_calls == 4, stats
    # A graph exported by a call without gradients serves training calls too: it checks.
    first = ortfx.ORTModule(copy.deepcopy(model))
    with torch.no_grad():
        first(full)
    out = first(small)
    with pytest.raises(RuntimeError, match=re.escape(str(raised.value))):
        out.sum().backward()


DYNAMO = ortfx.Options(exporter="dynamo", fallback_policy=ortfx.FallbackPolicy.DISABLE)
DYNAMO_CASES = [
    ("gather", "train"),
    ("scatter_add", "train"),
    ("index_select", "train"),
    ("index_copy", "train"),
    ("one_hot", "train"),
    ("cross_entropy", "train"),
    ("nll_loss", "eval"),  # ORT 1.19 cannot differentiate the unfused form the exporter writes
]


@pytest.mark.parametrize(("name", "mode"), DYNAMO_CASES)
def test_out_of_bounds_index_raises_like_pytorch_with_the_dynamo_exporter(
    name: str, mode: str
) -> None:
    """The dynamo exporter (opt-in, and ortfx's own retry when a TorchScript graph baked a
    size) wrote the same ops without PyTorch's bounds: -1 read the last position, one_hot
    wrote a row of zeros, nll_loss read -1 as a class, silently. Each raises PyTorch's error
    now, and good calls around it match eager (1e-6) with one export."""
    torch.manual_seed(0)
    model = Indexed(OPS[name])
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=DYNAMO)
    getattr(model, mode)()
    getattr(wrapped, mode)()
    x = torch.randn(4, 5)
    assert max_diff(wrapped(x, GOOD), model(x, GOOD)) <= 1e-6
    for value in (-1, 5):
        error = _eager_error(model, x, _with(value))
        with pytest.raises(type(error), match=re.escape(str(error).splitlines()[0])):
            wrapped(x, _with(value))
    assert max_diff(wrapped(x, GOOD), model(x, GOOD)) <= 1e-6
    assert ortfx.stats(wrapped).exports == 1
