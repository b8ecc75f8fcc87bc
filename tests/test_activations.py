"""The hand-written tanh GELU (transformers' ``gelu_new``, GPT-2's) by torch's fused kernels
inside the ORT graph (``passes.tanh_gelu_in_torch``), also under ORT's recompute. Outputs within 1e-6 and gradients within 1e-6 of eager
(relative to 1 + the largest magnitude), across the tails, at 0 and at the infinities; which
form ran is read from the saved execution graph."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from torch import nn

import ortfx
from tests.models import max_diff

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)


def _points() -> torch.Tensor:
    x = torch.cat(
        [
            torch.linspace(-30, 30, 241),
            torch.linspace(-1e-3, 1e-3, 21),
            torch.tensor([0.0, -0.0, math.inf, -math.inf]),
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


def _run(model: nn.Module, x: torch.Tensor, tmp_path: Path, **options: Any) -> set[str]:
    """``model`` and its wrapped copy on ``x`` (output, input and parameter gradients
    compared); the ATen operators and the GELU-related ONNX ops of the graph ORT ran."""
    debug = ortfx.DebugOptions(save_onnx=True, onnx_prefix="m", save_path=str(tmp_path))
    opts = debug.apply(ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE, **options))
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=opts)
    weights = torch.linspace(-2, 2, x.numel()).reshape(x.shape)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = wrapped(xa), model(xb)
    assert _close(out, expected)
    (out * weights).nan_to_num().sum().backward()
    (expected * weights).nan_to_num().sum().backward()
    assert xa.grad is not None and xb.grad is not None
    assert _close(xa.grad, xb.grad)
    for (path, p), q in zip(model.named_parameters(), wrapped.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, path
        assert _close(q.grad, p.grad), path
    graph = onnx.load(str(tmp_path / "m_execution_model_training.onnx")).graph
    found = {n.op_type for n in graph.node} & {"Tanh", "Sigmoid", "Pow", "FastGelu"}
    found |= {
        a.s.decode()
        for n in graph.node
        if n.op_type == "ATen"
        for a in n.attribute
        if a.name == "operator"
    }
    return found


class HandWritten(nn.Module):
    """transformers' NewGELUActivation, the formula GPT-2 trains with."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


def test_hand_written_tanh_gelu_runs_in_torch(tmp_path: Path) -> None:
    """The formula becomes one ATen node: no Pow, no Tanh left."""
    assert _run(HandWritten(), _points(), tmp_path) == {"ortfx_gelu", "ortfx_gelu_backward"}


def test_with_recompute_torch_gelu_is_kept_and_matches(tmp_path: Path) -> None:
    """With layer-wise recompute (level 1) ORT recomputes around the ATen node, whose output
    it keeps: eager's values and gradients."""
    found = _run(HandWritten(), _points(), tmp_path, memory_opt_level=1)
    assert found == {"ortfx_gelu", "ortfx_gelu_backward"}


def test_hand_written_formula_used_elsewhere_is_left_alone(tmp_path: Path) -> None:
    """When a part of the formula is also read elsewhere, the ops stay (their tanh through
    Sigmoid), with eager's values."""

    class AlsoReads(HandWritten):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * self.scale
            inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
            return 0.5 * x * (1.0 + torch.tanh(inner)) + 0.1 * inner

    finite = _points()[:, :-2]
    assert _run(AlsoReads(), finite, tmp_path) == {"Pow", "Sigmoid"}


def test_gpt2_gelu_new_trains_like_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2 (transformers' gelu_new) for two steps: loss, logits and every gradient within
    1e-5 of eager's, with torch's fused kernel (one GELU node per layer, counted)."""
    from ortfx import aten
    from tests import models

    calls: list[int] = []
    routed = aten.ROUTED[("ortfx_gelu", "")]

    def counted(*args: Any) -> Any:
        calls.append(1)
        return routed.function(*args)

    monkeypatch.setitem(aten.ROUTED, ("ortfx_gelu", ""), aten.Routed(counted, routed.arguments))
    torch.manual_seed(0)
    model = models.tiny_gpt2()
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 16))
        kwargs: dict[str, Any] = {"input_ids": ids, "labels": ids, "use_cache": False}
        out, expected = wrapped(**kwargs), model(**kwargs)
        assert max_diff(out.loss, expected.loss) <= 1e-5
        assert max_diff(out.logits, expected.logits) <= 1e-5
        out.loss.backward()
        expected.loss.backward()
    for (path, p), q in zip(model.named_parameters(), wrapped.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, path
        assert max_diff(p.grad, q.grad) <= 1e-5, path
    assert len(calls) == 2 * model.config.n_layer
