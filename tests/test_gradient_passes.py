"""Edits of ORT's gradient model for speed: every one must leave the gradients PyTorch's.

- ``passes.reductions.drop_empty_broadcast_reductions``: the broadcast reductions of a
  gradient that can never reduce anything (the operand has the output's shape) are dropped.

Axis-0 gathers (embeddings, ``x[idx]``) are checked here too: routing their gradient to torch
was measured and not adopted (docs/performance.md), the parity stays.
"""

from __future__ import annotations

import copy
from pathlib import Path

import onnx
import pytest
import torch

import ortfx
from ortfx.passes import reductions

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)


def _grads_match(
    plain: torch.nn.Module, wrapped: torch.nn.Module, *inputs: torch.Tensor, atol: float = 1e-5
) -> None:
    """Loss, parameter gradients and input gradients equal eager's (``atol``, rtol 1e-5)."""
    leaves = [[x.clone().requires_grad_(x.is_floating_point()) for x in inputs] for _ in range(2)]
    losses = []
    for model, xs in zip((plain, wrapped), leaves, strict=True):
        model.zero_grad()
        loss = model(*xs)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=atol)
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=atol, msg=name)
    for a, b in zip(*leaves, strict=True):
        if a.requires_grad:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=atol)


class Broadcasts(torch.nn.Module):
    """Every kind of operand pair a broadcasting op's gradient meets: a scalar constant, a
    same-shaped tensor (proven through elementwise chains), a bias, a [b, 1, d] row, a
    [1, s, 1] column and a rank-lifting [d] vector, also through Where and Pow."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(d, d)
        self.row = torch.nn.Parameter(torch.randn(d))
        self.column = torch.nn.Parameter(torch.randn(1, 5, 1))
        self.scale = torch.nn.Parameter(torch.randn(()))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)  # [b, s, d]
        a = torch.sigmoid(h * 0.5) * h + 1.0  # scalar constants, same-shaped factors
        b = a * y[:, :1, :]  # [b, s, d] * [b, 1, d]: the second operand is reduced
        c = b + self.row  # a bias
        e = c * self.column  # [1, s, 1]: reduced over two axes
        f = torch.where(e > 0, e, y) ** 2 * self.scale  # a 0-dim parameter
        g = torch.tanh(f) / (1.0 + a.abs())
        return (g * y).sum() + (x * x).mean()


def _reduced_operands(model: onnx.ModelProto) -> list[str]:
    """The forward tensors whose gradient is still summed over runtime broadcast axes."""
    producer = {o: n for n in model.graph.node for o in n.output}
    operands = []
    for node in model.graph.node:
        args = (
            producer.get(node.input[1])
            if node.op_type == "ReduceSum" and len(node.input) > 1
            else None
        )
        if args is not None and args.op_type == "BroadcastGradientArgs":
            k = list(args.output).index(node.input[1])
            operands.append(producer[args.input[k]].input[0])
    return operands


@pytest.mark.parametrize("batch", [2, 1, 3])
def test_broadcast_gradients_match_pytorch(batch: int, tmp_path: Path) -> None:
    """Gradients of every operand (parameters and inputs, 1e-5) equal eager's, at batch 1 too,
    where a [b, 1, d] operand has the output's size on every axis but one. In the graph ORT
    ran, reductions were dropped (scalar factors, same-shaped products, the [d] row's partner),
    and every operand that does need a sum kept its own: the row, the column, the 0-dim scale,
    y's [b, 1, d] slice. Applying the pass again finds nothing more to prove."""
    torch.manual_seed(0)
    plain = Broadcasts()
    debug = ortfx.DebugOptions(save_onnx=True, onnx_prefix="b", save_path=str(tmp_path))
    wrapped = ortfx.ORTModule(copy.deepcopy(plain), debug, options=STRICT)
    x, y = torch.randn(batch, 5, 6), torch.randn(batch, 5, 6)
    _grads_match(plain, wrapped, x, y)
    gradient = onnx.load(str(tmp_path / "b_optimized_training.onnx"))  # after ortfx's passes
    assert sum(n.name.endswith("_empty_axes") for n in gradient.graph.node) >= 5
    kept = " ".join(_reduced_operands(gradient))
    for operand in ("module.row", "module.column", "module.scale", "Slice_output_0"):
        assert operand in kept, (operand, kept)
    assert reductions.drop_empty_broadcast_reductions(gradient) == 0


def test_shapes_prove_a_bias_needs_no_sum_on_the_other_side() -> None:
    """The shape rule on its own: [b, s, 6] against a [6] bias or a [1, s, 1] column covers
    it; against [1, 5, 1] (5 is not the symbol s), a longer shape, or an unknown axis, not."""
    covers = reductions._covers  # the rule itself, beside the end-to-end tests
    assert covers(("b", "s", 6), (6,))
    assert covers(("b", "s", 6), (1, "s", 1))
    assert covers(("b", "s", 6), ())
    assert not covers(("b", "s", 6), (1, 5, 1))
    assert not covers(("b", "s", 6), (1, "b", "s", 6))
    assert not covers((None, "s", 6), (7, "s", 6))
    assert not covers(("b", None, 6), ("b", None, 6))  # unknown is equal to nothing


class Embeds(torch.nn.Module):
    """Axis-0 gathers: an embedding (with padding), a 3-D table indexed by ids, and a
    parameter's last row by a negative index."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(11, 4, padding_idx=0)
        self.table = torch.nn.Parameter(torch.randn(7, 2, 4))
        self.rows = torch.nn.Parameter(torch.randn(3, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embedding(ids)  # [b, s, 4]
        t = self.table[ids % 7]  # [b, s, 2, 4]
        return (h.unsqueeze(2) * t).sum() + (h * self.rows[-1]).pow(2).sum()


def test_gather_gradients_match() -> None:
    """Repeated ids, the padding row, a 3-D table and a negative index: gradients equal eager's
    (1e-5) over two batch shapes. The padded embedding times a gathered table also once failed
    ORT's gradient build (contradicting exporter shapes)."""
    torch.manual_seed(0)
    plain = Embeds()
    wrapped = ortfx.ORTModule(copy.deepcopy(plain), options=STRICT)
    for ids in ([[1, 1, 0, 10], [3, 1, 9, 0]], [[5, 5, 5]]):
        _grads_match(plain, wrapped, torch.tensor(ids))
    assert ortfx.stats(wrapped).exports == 1
