"""Call conventions: argument kinds, nested inputs, output containers, dtypes, layouts."""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

import ortfx
from ortfx import LogLevel
from tests import models
from tests.models import check_parity, max_diff

Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass
class Result:
    loss: torch.Tensor
    hidden: torch.Tensor | None = None


class Kinds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        *rest: Any,
        scale: float = 1.0,
        **extra: Any,
    ) -> torch.Tensor:
        out = self.lin(x) * scale
        if y is not None:
            out = out + y
        for r in rest:
            out = out * r
        for key in sorted(extra):
            if extra[key] is not None:
                out = out - extra[key]
        return out


def test_positional_keyword_varargs_and_kwargs() -> None:
    torch.manual_seed(0)
    x, y, r = torch.randn(3, 4), torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    check_parity(
        Kinds(),
        (x, y, r),
        {"scale": 2.0, "a": torch.ones(3, 4), "b": None},
        loss=lambda o: o.square().sum(),
    )


def test_many_none_arguments_and_keyword_order() -> None:
    torch.manual_seed(0)
    model = Kinds()
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(2, 4)
    a = wrapped(x, None, scale=3.0, p=None, q=None, r=torch.ones(2, 4))
    b = wrapped(x, None, r=torch.ones(2, 4), q=None, p=None, scale=3.0)
    assert max_diff(a, b) == 0
    assert max_diff(a, model(x, None, scale=3.0, r=torch.ones(2, 4))) <= 1e-6
    assert ortfx.stats(wrapped).exports == 1


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, batch: dict[str, Any]) -> Any:
        h = self.lin(batch["x"]) + batch["pair"][0] * batch["pair"][1]
        return {
            "od": collections.OrderedDict(z=h.sum(), a=h.mean()),
            "nt": Pair(h, None),
            "dc": Result(h.square().mean(), hidden=h),
            "list": [h, {"deep": (h * 2,)}],
            "none": None,
        }


def test_nested_inputs_with_unused_and_none_values_and_typed_outputs() -> None:
    torch.manual_seed(0)
    batch = {
        "x": torch.randn(2, 4, requires_grad=True),
        "pair": [torch.randn(2, 4), torch.randn(2, 4)],
        "unused": torch.randn(5),
        "missing": None,
    }
    wrapped = check_parity(
        Nested(),
        (batch,),
        loss=lambda o: o["od"]["z"] + o["dc"].loss + o["list"][1]["deep"][0].sum(),
    )
    out = wrapped(batch)
    assert type(out["od"]) is collections.OrderedDict and list(out["od"]) == ["z", "a"]
    assert type(out["nt"]) is Pair and out["nt"].right is None
    assert type(out["dc"]) is Result and out["dc"].hidden is not None
    assert type(out["list"][1]["deep"]) is tuple
    assert out["none"] is None


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor) -> Any:
        h = self.lin(x) * mask.unsqueeze(-1) + ids.to(x.dtype).unsqueeze(-1)
        return h, h > 0, (h > 0).to(torch.uint8), 7, "tag"


@pytest.mark.parametrize("train", [True, False])
def test_int_str_bool_uint8_outputs_keep_their_types(train: bool) -> None:
    torch.manual_seed(0)
    model = Mixed().train(train)
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(3, 4, requires_grad=True)
    mask = torch.tensor([True, False, True])
    ids = torch.tensor([1, 2, 3], dtype=torch.uint8)
    h, positive, ids_out, n, tag = wrapped(x, mask, ids)
    assert type(n) is int and n == 7 and type(tag) is str and tag == "tag"
    assert positive.dtype == torch.bool and ids_out.dtype == torch.uint8
    assert not positive.requires_grad and not ids_out.requires_grad
    ref = model(x, mask, ids)
    assert max_diff(h, ref[0]) <= 1e-6
    assert torch.equal(positive, ref[1]) and torch.equal(ids_out, ref[2])
    h.sum().backward()
    assert x.grad is not None and torch.all(x.grad[1] == 0)


def test_non_contiguous_inputs() -> None:
    torch.manual_seed(0)
    base = torch.randn(4, 6)
    x = base.t()[:, :4]  # (6, 4) view, not contiguous
    assert not x.is_contiguous()
    check_parity(nn.Linear(4, 3), (x,), loss=lambda o: o.sum())


class PassThrough(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.lin(x)
        return y, y, x


def test_duplicated_outputs_and_input_returned_as_output() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 4, requires_grad=True)
    wrapped = check_parity(
        PassThrough(), (x,), loss=lambda o: o[0].sum() + 2 * o[1].square().sum() + 3 * o[2].sum()
    )
    a, b, c = wrapped(x)
    assert max_diff(a, b) == 0 and max_diff(c, x) == 0


def test_embedding_padding_row_gets_no_gradient() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, padding_idx=0), nn.Linear(4, 2))
    ids = torch.tensor([[0, 1, 2, 0], [3, 0, 4, 5]])
    wrapped = check_parity(model, (ids,), loss=lambda o: o.square().sum())
    assert torch.all(model[0].weight.grad[0] == 0)
    assert ortfx.stats(wrapped).exports == 1


def test_empty_batch_then_backward_matches_pytorch(caplog: pytest.LogCaptureFixture) -> None:
    """ORT cannot train on an empty batch: that one call runs in PyTorch, under any policy,
    and the next call with data runs in ORT again (nothing is poisoned)."""
    torch.manual_seed(0)
    model = models.MLP()
    reference = copy.deepcopy(model)
    options = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE, log_level=LogLevel.INFO)
    wrapped = ortfx.ORTModule(model, options=options)
    x = torch.zeros(0, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with caplog.at_level(logging.INFO, logger="ortfx"):
        out = wrapped(x)
    assert "input args[0] is empty (shape [0, 8])" in caplog.text
    out.sum().backward()
    reference(x_ref).sum().backward()
    assert out.shape == (0, 4) and x.grad is not None and x.grad.shape == (0, 8)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert q.grad is not None and torch.equal(p.grad, q.grad)
    y = torch.randn(3, 8, requires_grad=True)
    assert max_diff(wrapped(y), reference(y)) <= 1e-6
    s = ortfx.stats(wrapped)
    assert (s.fallback_calls, s.fallback, s.exports) == (1, None, 1)


def test_empty_batch_runs_in_pytorch_and_never_crashes() -> None:
    # Conv's gradient kernel in ORT 1.19 dies of SIGFPE on an empty batch: run in a subprocess.
    code = (
        "import torch, ortfx\n"
        "options = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)\n"
        "w = ortfx.ORTModule(torch.nn.Conv1d(2, 3, 3), options=options)\n"
        "w(torch.randn(2, 2, 8)).sum().backward()\n"
        "x = torch.zeros(0, 2, 8, requires_grad=True)\n"
        "w(x).sum().backward()\n"
        "print(tuple(x.grad.shape))\n"
        "with torch.no_grad():\n"
        "    print(tuple(w(torch.zeros(0, 2, 8)).shape))\n"
        "w(torch.randn(2, 2, 8)).sum().backward()\n"
        "print(ortfx.stats(w).fallback_calls, ortfx.stats(w).exports)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.splitlines()[-3:] == ["(0, 2, 8)", "(0, 3, 6)", "1 1"]


@pytest.mark.parametrize("dense_first", [False, True])
def test_sparse_input_is_a_typed_error_naming_the_path(dense_first: bool) -> None:
    options = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
    wrapped = ortfx.ORTModule(models.MLP(), options=options)
    if dense_first:  # the steady-state fast path does not look at the layout
        wrapped(torch.randn(3, 8))
        wrapped(torch.randn(3, 8))
    with pytest.raises(ortfx.OrtfxIOError) as info:
        wrapped(torch.randn(3, 8).to_sparse())
    assert str(info.value) == (
        "input args[0] is a torch.sparse_coo tensor; ortfx carries only dense (torch.strided) "
        "tensors through an ONNX graph. Convert it with .to_dense() before the call, or call "
        "the module outside ortfx."
    )
