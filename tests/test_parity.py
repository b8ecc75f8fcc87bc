"""Outputs and every gradient through ortfx against plain PyTorch on deep copies.

Tolerance: 1e-5 absolute for fp32 unless stated; the reason is given where it is larger.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortfx
from ortfx.options import MAX_OPSET, MIN_OPSET
from tests import models
from tests.models import check_parity, max_diff


def test_mlp_outputs_and_gradients() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    check_parity(models.MLP(), (x,), loss=lambda y: (y * y).sum())


def test_gpt_block_outputs_and_gradients_with_input_grad() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 12, 32, requires_grad=True)
    check_parity(models.GPTBlock(), (x,), loss=lambda y: (y * y.detach().sin()).sum())


def test_transformer_encoder() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 10, 32, requires_grad=True)
    # 2e-5: two layers of fused attention kernels on both sides sum in different orders.
    check_parity(models.transformer_encoder(), (x,), loss=lambda y: y.square().mean(), tol=2e-5)


def test_tiny_gpt2_lm_loss_from_labels() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    kwargs = {
        "input_ids": ids,
        "labels": ids.clone(),
        "attention_mask": torch.ones_like(ids),
        "use_cache": False,
    }
    wrapped = check_parity(models.tiny_gpt2(), (), kwargs, loss=lambda out: out.loss)
    # The output is the model's own ModelOutput type with the loss restored into it.
    out = wrapped(**kwargs)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.logits.shape == (2, 16, 64)


def test_tiny_bert_sequence_classification() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (3, 12))
    kwargs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.tensor([0, 2, 1]),
    }
    check_parity(models.tiny_bert(), (), kwargs, loss=lambda out: out.loss)


def test_adamw_50_steps_match_eager_losses() -> None:
    torch.manual_seed(0)
    model = models.TinyGPT()
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model)
    opt_a = torch.optim.AdamW(wrapped.parameters(), lr=3e-3)
    opt_b = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    for step in range(50):
        ids = torch.randint(0, 64, (4, 16), generator=gen)
        labels = ids.roll(-1, dims=1)
        for opt, m in ((opt_a, wrapped), (opt_b, reference)):
            opt.zero_grad()
            loss = m(ids, labels)
            loss.backward()
            opt.step()
            if m is wrapped:
                la = loss.item()
            else:
                lb = loss.item()
        assert abs(la - lb) <= 1e-4 * abs(lb), (step, la, lb)
    assert ortfx.stats(wrapped).exports == 1


def test_dynamic_batch_and_sequence_one_export_parity_every_step() -> None:
    torch.manual_seed(0)
    model = models.GPTBlock()
    wrapped = ortfx.ORTModule(model)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        b, t = (int(v) for v in torch.randint(1, 9, (2,), generator=gen))
        x = torch.randn(b, t, 32, generator=gen)
        for m in (wrapped, reference):
            m.zero_grad()
        ya, yb = wrapped(x), reference(x)
        assert max_diff(ya, yb) <= 1e-5
        ya.square().sum().backward()
        yb.square().sum().backward()
        for pa, pb in zip(model.parameters(), reference.parameters(), strict=True):
            assert max_diff(pa.grad, pb.grad) <= 1e-4  # sums over up to 8x8 positions
    assert ortfx.stats(wrapped).exports == 1


class SlicedLogits(nn.Module):
    """Slices the logits of a MatMul head before the loss: ORT 1.19's compute optimizer crashes
    on this graph. (An nn.Linear head no longer reaches the crash: ortfx writes it as a Gemm.)"""

    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(64, d)
        self.blocks = nn.Sequential(models.GPTBlock(d), models.GPTBlock(d))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Parameter(torch.randn(d, vocab) / d**0.5)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        logits = (self.ln_f(self.blocks(x)) @ self.head)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def test_compute_optimizer_failure_rebuilds_without_it(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 12))
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        check_parity(SlicedLogits(), (ids, ids), loss=lambda loss: loss)
    said = [r.getMessage() for r in caplog.records if r.name == "ortfx"]
    assert len(said) == 1
    assert said[0].startswith("ONNX Runtime's compute optimizer failed on this graph (")
    assert "the gradient graph was built without it" in said[0]


class Classifier(nn.Module):
    """A Linear head straight into cross-entropy: ORT's gradient needs the log_prob output."""

    def __init__(self, reduction: str, ignore_index: int, transpose: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 5)
        self.reduction, self.ignore_index, self.transpose = reduction, ignore_index, transpose

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.lin(x)
        if self.transpose:  # (batch, classes, positions)
            out = F.cross_entropy(
                logits.transpose(1, 2), y, reduction=self.reduction, ignore_index=self.ignore_index
            )
        else:
            out = F.cross_entropy(
                logits.reshape(-1, 5),
                y.reshape(-1),
                reduction=self.reduction,
                ignore_index=self.ignore_index,
            )
        return out.sum() if self.reduction == "none" else out


@pytest.mark.parametrize(
    ("reduction", "ignore_index", "transpose"),
    [
        ("mean", -100, False),
        ("mean", -100, True),
        ("mean", 0, False),
        ("sum", -100, False),
        ("none", -100, False),
    ],
)
def test_cross_entropy_variants(reduction: str, ignore_index: int, transpose: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8, requires_grad=True)
    y = torch.randint(0, 5, (3, 4))
    check_parity(Classifier(reduction, ignore_index, transpose), (x, y), loss=lambda loss: loss)


def _exported_ops(wrapped: ortfx.ORTModule, *args: Any, **kwargs: Any) -> set[str]:
    from ortfx.runtime import events

    with events.recording() as seen:
        wrapped(*args, **kwargs)
    (info,) = [a[0] for name, a in seen if name == "export"]
    return {n.op_type for n in onnx.load_from_string(info.model).graph.node}


def test_tanh_gelu_runs_without_tanh_and_matches_eager(tmp_path: Path) -> None:
    """A tanh is exported through Sigmoid (ORT's FastGelu gradient is slow on CPU), GPT-2's
    hand-written tanh GELU runs as torch's fused GELU (passes.tanh_gelu_in_torch, in the
    session); outputs and gradients stay within 1e-5 of eager, including far in the tails."""
    import onnx

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    kwargs = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    model = models.tiny_gpt2()
    debug = ortfx.DebugOptions(save_onnx=True, onnx_prefix="g", save_path=str(tmp_path))
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=debug.apply(ortfx.Options()))
    wrapped(**kwargs, use_cache=False).loss.backward()
    graph = onnx.load(str(tmp_path / "g_execution_model_training.onnx")).graph
    ops = {n.op_type for n in graph.node}
    assert "Tanh" not in ops and "Pow" not in ops and "ATen" in ops
    check_parity(
        model, (), {**kwargs, "use_cache": False}, loss=lambda out: out.loss + out.logits.mean()
    )

    class Act(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.gelu(x, approximate="tanh") * 3 + torch.tanh(x * 0.5)

    x = torch.cat([torch.linspace(-30, 30, 601), torch.linspace(-1e-3, 1e-3, 101)])
    x = x.reshape(1, -1).repeat(2, 1).requires_grad_()
    check_parity(
        Act(),
        (x,),
        loss=lambda out: (out * torch.linspace(-2, 2, out.numel()).reshape(out.shape)).sum(),
    )


def test_cross_entropy_runs_in_torch_without_a_log_softmax_table() -> None:
    """The fused SoftmaxCrossEntropyLoss runs as one ATen node (torch's kernels, no [N, C]
    log-softmax kept for the backward), and its gradient as another; no ORT loss kernel."""
    import onnx

    from ortfx.runtime import events

    wrapped = ortfx.ORTModule(models.TinyGPT())
    ids = torch.randint(0, 64, (2, 8))
    with events.recording() as seen:
        wrapped(ids, ids).backward()
    (info,) = [args[0] for name, args in seen if name == "export"]
    graph = onnx.load_from_string(info.model).graph
    operators = [
        onnx.helper.get_attribute_value(a).decode()
        for n in graph.node
        if n.op_type == "ATen"
        for a in n.attribute
        if a.name == "operator"
    ]
    assert operators.count("ortfx_cross_entropy") == 1
    ops = {n.op_type for n in graph.node}
    assert not ops & {"SoftmaxCrossEntropyLoss", "LogSoftmax", "GatherElements"}


@pytest.mark.parametrize("opset", [MIN_OPSET, MAX_OPSET])
def test_lowest_and_highest_accepted_opset_train_with_parity(opset: int, tmp_path: Path) -> None:
    """Both ends of the accepted opset range export, build a gradient graph and match eager."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.LayerNorm(16), nn.Sigmoid(), nn.BatchNorm1d(16), nn.Linear(16, 4)
    )
    options = ortfx.DebugOptions(save_onnx=True, onnx_prefix="m", save_path=str(tmp_path)).apply(
        ortfx.Options(opset_version=opset, fallback_policy=ortfx.FallbackPolicy.DISABLE)
    )
    wrapped = ortfx.ORTModule(model, options=options)
    x = torch.randn(6, 8, requires_grad=True)
    check_parity(model, (x,), loss=lambda y: (y * y).sum(), wrapped=wrapped)
    exported = onnx.load(str(tmp_path / "m_torch_exported_training.onnx"))
    assert [i.version for i in exported.opset_import if i.domain in ("", "ai.onnx")] == [opset]
    assert ortfx.Options.from_env(environ={"ORTMODULE_ONNX_OPSET_VERSION": str(opset)}) == (
        ortfx.Options(opset_version=opset)
    )


def _weight_transposes(wrapped: ortfx.ORTModule, *args: Any, **kwargs: Any) -> list[str]:
    """The Transpose nodes of the exported graph that read a parameter."""
    from ortfx.runtime import events

    with events.recording() as seen:
        wrapped(*args, **kwargs)
    (info,) = [a[0] for name, a in seen if name == "export"]
    graph = onnx.load_from_string(info.model).graph
    params = {n for n, _ in wrapped.module.named_parameters()}
    return [
        n.name
        for n in graph.node
        if n.op_type == "Transpose" and n.input[0].removeprefix("module.") in params
    ]


@pytest.mark.parametrize("rank", [1, 2, 3, 4])
def test_linear_layers_read_their_weights_untransposed(rank: int) -> None:
    """nn.Linear on inputs of any rank (the exporter writes MatMul(x, Transpose(W)) for rank
    other than 2) and a tied LM head run as a Gemm on W itself: no weight is transposed in the
    graph; outputs, parameter and input gradients as eager's (1e-5)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3, bias=False))
    x = torch.randn(*[2, 3, 2][: rank - 1], 6, requires_grad=True)
    assert _weight_transposes(ortfx.ORTModule(copy.deepcopy(net)), x) == []
    check_parity(
        net, (x,), loss=lambda y: (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum()
    )


def test_a_tied_lm_head_reads_the_embedding_untransposed() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    kwargs = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    model = models.tiny_gpt2()
    assert _weight_transposes(ortfx.ORTModule(copy.deepcopy(model)), **kwargs) == []
    check_parity(model, (), kwargs, loss=lambda out: out.loss + out.logits.square().mean())


def test_a_tied_embeddings_gradients_are_added_without_a_dense_table(tmp_path: Path) -> None:
    """GPT-2's tied embedding: the rows' gradients are scattered into the head's gradient
    (no GatherGrad's dense table of zeros), repeated tokens included; every gradient as
    eager's (1e-5)."""
    torch.manual_seed(0)
    ids = torch.tensor([[3, 3, 7, 1, 3, 60, 7, 2], [0, 1, 1, 1, 63, 63, 5, 3]])
    kwargs = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    model = models.tiny_gpt2()
    options = ortfx.Options(save_onnx=True, onnx_prefix="tied", save_path=str(tmp_path))
    wrapped = ortfx.ORTModule(model, options=options)
    check_parity(model, (), kwargs, loss=lambda out: out.loss, wrapped=wrapped)
    graph = onnx.load(str(tmp_path / "tied_optimized_training.onnx")).graph
    gathers = {n.output[0] for n in graph.node if n.op_type == "GatherGrad"}
    sums = [n for n in graph.node if n.name == "AccumulateGrad_module.transformer.wte.weight_grad"]
    assert sums == [] and len(gathers) == 1  # the position embedding's (not tied) stays
    (scatter,) = [n for n in graph.node if n.op_type == "ScatterND"]
    assert scatter.output[0] == "module.transformer.wte.weight_grad"
