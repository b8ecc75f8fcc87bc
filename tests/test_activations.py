"""GELU by torch's fused kernels inside the ORT graph: ``F.gelu``/``nn.GELU`` (exact and tanh,
``export.routed.gelu``) and the hand-written tanh GELU of transformers' ``gelu_new``
(``passes.tanh_gelu_in_torch``). Outputs within 1e-6 and gradients within 1e-6 of eager
(relative to 1 + the largest magnitude), across the tails, at 0, and at NaN and infinities
(NaN where eager has NaN); which form ran is read from the exported graph."""

from __future__ import annotations

import copy
import math
from typing import Any

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortfx
from ortfx.runtime import events
from tests.models import max_diff

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)


def _points() -> torch.Tensor:
    x = torch.cat(
        [
            torch.linspace(-30, 30, 241),
            torch.linspace(-1e-3, 1e-3, 21),
            torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan]),
        ]
    )
    return x.reshape(1, -1).repeat(2, 1)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """NaN where eager has NaN, equal infinities, the rest within 1e-6 relative."""
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    rest = ~((a == b) | b.isnan())
    if not rest.any():
        return True
    return max_diff(a[rest], b[rest]) <= 1e-6 * (1.0 + float(b[rest].detach().abs().max()))


def _run(model: nn.Module, x: torch.Tensor) -> set[str]:
    """``model`` and its wrapped copy on ``x`` (output, input and parameter gradients
    compared); the ATen operators and the GELU-related ONNX ops of the export."""
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    weights = torch.linspace(-2, 2, x.numel()).reshape(x.shape)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with events.recording() as seen:
        out = wrapped(xa)
    expected = model(xb)
    assert _close(out, expected)
    (out * weights[..., : out.shape[-1]]).nan_to_num().sum().backward()
    (expected * weights[..., : expected.shape[-1]]).nan_to_num().sum().backward()
    assert xa.grad is not None and xb.grad is not None
    assert _close(xa.grad, xb.grad)
    for (path, p), q in zip(model.named_parameters(), wrapped.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, path
        assert _close(q.grad, p.grad), path
    (info,) = [a[0] for name, a in seen if name == "export"]
    graph = onnx.load_from_string(info.model).graph
    found = {n.op_type for n in graph.node} & {"Erf", "Tanh", "Sigmoid", "Pow"}
    found |= {
        a.s.decode()
        for n in graph.node
        if n.op_type == "ATen"
        for a in n.attribute
        if a.name == "operator"
    }
    return found


class Gelu(nn.Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x * self.scale, approximate=self.approximate)


class HandWritten(nn.Module):
    """transformers' NewGELUActivation, the formula GPT-2 trains with."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale
        return (
            0.5
            * x
            * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        )


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_runs_in_torch(approximate: str) -> None:
    """``F.gelu`` exact and tanh: one ATen node, torch's values and gradients."""
    assert _run(Gelu(approximate), _points()) == {"ortfx_gelu"}


def test_hand_written_tanh_gelu_runs_in_torch() -> None:
    """The hand-written formula becomes the same node: no Pow, no Tanh left."""
    assert _run(HandWritten(), _points()) == {"ortfx_gelu"}


def test_hand_written_formula_used_elsewhere_is_left_alone() -> None:
    """When a part of the formula is also read elsewhere, the ops stay (their tanh through
    Sigmoid), with eager's values."""

    class AlsoReads(HandWritten):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * self.scale
            inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
            return 0.5 * x * (1.0 + torch.tanh(inner)) + 0.1 * inner

    finite = _points()[:, :-3]
    assert _run(AlsoReads(), finite) == {"Pow", "Sigmoid"}


def test_gpt2_gelu_new_trains_like_eager() -> None:
    """GPT-2 (transformers' gelu_new) for two steps: loss, logits and every gradient within
    1e-5 of eager's; the export holds one GELU node per layer and no Tanh."""
    from tests import models

    torch.manual_seed(0)
    model = models.tiny_gpt2()
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    for step in range(2):
        ids = torch.randint(0, 64, (2, 16))
        kwargs: dict[str, Any] = {"input_ids": ids, "labels": ids, "use_cache": False}
        with events.recording() as seen:
            out = wrapped(**kwargs)
        expected = model(**kwargs)
        assert max_diff(out.loss, expected.loss) <= 1e-5
        assert max_diff(out.logits, expected.logits) <= 1e-5
        out.loss.backward()
        expected.loss.backward()
        if step == 0:
            (info,) = [a[0] for name, a in seen if name == "export"]
            nodes = onnx.load_from_string(info.model).graph.node
            gelus = [n for n in nodes if any(a.s == b"ortfx_gelu" for a in n.attribute)]
            assert len(gelus) == model.config.n_layer
            assert not any(n.op_type in ("Tanh", "Pow") for n in nodes)
    for (path, p), q in zip(model.named_parameters(), wrapped.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, path
        assert max_diff(p.grad, q.grad) <= 1e-5, path
