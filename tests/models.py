"""Small models the runtime tests train through ortfx and through plain PyTorch."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ortfx
from ortfx import io


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, d_hidden: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class GPTBlock(nn.Module):
    """LayerNorm, causal attention with matmul+softmax, GELU MLP, residuals."""

    def __init__(self, d: int = 32, n_head: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.n_head
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.n_head, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~causal, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    """Embedding, two GPT blocks and a head; returns the LM loss."""

    def __init__(self, vocab: int = 64, d: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(GPTBlock(d, 4, dropout), GPTBlock(d, 4, dropout))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.blocks(self.emb(ids)))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def transformer_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(
        d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
    )
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=64,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config)


def tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "eager"
    return BertForSequenceClassification(config)


def tiny_mixtral() -> nn.Module:
    """transformers' default experts: torch._grouped_mm, token counts by torch.histc."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=100, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return MixtralForCausalLM(config)


def max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    assert a is not None and b is not None, (a is None, b is None)
    return float((a.detach().double() - b.detach().double()).abs().max())


def backward_both_and_compare(
    got: torch.Tensor,
    expected: torch.Tensor,
    model: nn.Module,
    reference: nn.Module,
    *,
    tol: float = 1e-5,
    rtol: float = 0.0,
    where: object = None,
    zeros_for_none: bool = False,
) -> None:
    """Zero both modules' gradients, backward the sum of each output, and compare every
    parameter gradient (within ``tol`` plus ``rtol`` times eager's largest magnitude). A parameter eager leaves without a gradient (a branch
    not taken) has none through ortfx either; ``zeros_for_none`` also accepts zeros there (an
    output unused by the loss, where ORT gives zeros). ``where`` labels a failure."""
    model.zero_grad()
    reference.zero_grad()
    got.sum().backward()
    expected.sum().backward()
    for (name, a), (_, b) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        if b.grad is None:
            none = a.grad is None or (zeros_for_none and not a.grad.any())
            assert none, (where, name)
        else:
            bound = tol + rtol * float(b.grad.abs().max())
            assert a.grad is not None and max_diff(a.grad, b.grad) <= bound, (where, name)


SHAPE_INFERENCE = "_jit_pass_onnx_graph_shape_type_inference"


@contextlib.contextmanager
def shape_inference_recorded() -> Iterator[list[dict[str, tuple[int, ...]]]]:
    """While the block runs, torch's whole-graph ONNX shape inference is a stand-in that
    records the shapes of the parameter values each call is given, then runs torch's own; the
    block also checks that whatever ortfx installs around an export put the stand-in back."""
    original = getattr(torch._C, SHAPE_INFERENCE)
    received: list[dict[str, tuple[int, ...]]] = []

    def stand_in(graph: Any, params: dict[str, Any], opset: int) -> Any:
        received.append({k: tuple(v.shape) for k, v in params.items()})
        return original(graph, params, opset)

    setattr(torch._C, SHAPE_INFERENCE, stand_in)
    try:
        yield received
        assert getattr(torch._C, SHAPE_INFERENCE) is stand_in
    finally:
        setattr(torch._C, SHAPE_INFERENCE, original)


def clone_inputs(tree: Any) -> Any:
    """Fresh leaf tensors (same values and requires_grad) for an independent run."""
    leaves, spec = io.flatten(tree)
    fresh = [
        x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        for x in leaves
    ]
    return io.unflatten(spec, fresh)


def check_parity(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    loss: Callable[[Any], torch.Tensor],
    tol: float = 1e-5,
    wrapped: ortfx.ORTModule | None = None,
) -> ortfx.ORTModule:
    """Forward + backward through ortfx and through a deep copy in PyTorch; compare all."""
    kwargs = kwargs or {}
    reference = copy.deepcopy(model)
    ort_model = wrapped if wrapped is not None else ortfx.ORTModule(model)
    a_args, a_kwargs = clone_inputs(args), clone_inputs(kwargs)
    b_args, b_kwargs = clone_inputs(args), clone_inputs(kwargs)
    out_a = ort_model(*a_args, **a_kwargs)
    out_b = reference(*b_args, **b_kwargs)
    la, lb = loss(out_a), loss(out_b)
    assert max_diff(la, lb) <= tol, ("loss", max_diff(la, lb))
    la.backward()
    lb.backward()
    for (name, pa), (_, pb) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        if pb.grad is None:
            assert pa.grad is None, name
            continue
        assert max_diff(pa.grad, pb.grad) <= tol, (name, max_diff(pa.grad, pb.grad))
    flat_a = [x for x in io.flatten((a_args, a_kwargs))[0] if isinstance(x, torch.Tensor)]
    flat_b = [x for x in io.flatten((b_args, b_kwargs))[0] if isinstance(x, torch.Tensor)]
    for xa, xb in zip(flat_a, flat_b, strict=True):
        if xb.requires_grad:
            assert max_diff(xa.grad, xb.grad) <= tol, ("input grad", max_diff(xa.grad, xb.grad))
    return ort_model
