"""Benchmark models with fixed seeds and no downloads.

Every builder returns ``(model, make_batch, loss_fn)``:

* ``model``: an ``nn.Module`` in train mode, parameters initialised from ``seed``;
* ``make_batch(step) -> (args, kwargs)``: the inputs of training step ``step``, deterministic in
  ``(seed, step)`` so that every backend sees exactly the same data;
* ``loss_fn(output) -> scalar tensor``.

The loss is computed inside the model (as Hugging Face models do with ``labels=``) so that the
whole training step graph, loss included, runs in the backend under test.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[tuple[Any, ...], dict[str, Any]]
Built = tuple[nn.Module, Callable[[int], Batch], Callable[[Any], torch.Tensor]]


def _gen(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def _identity(out: Any) -> torch.Tensor:
    return out  # type: ignore[no-any-return]


def _hf_loss(out: Any) -> torch.Tensor:
    return out.loss  # type: ignore[no-any-return]


# ---- MLP ------------------------------------------------------------------------------------


class MLP(nn.Module):
    """784-1024-1024-10 with ReLU; returns the cross-entropy loss."""

    def __init__(self, sizes: tuple[int, ...] = (784, 1024, 1024, 10)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return F.cross_entropy(x, target)


def mlp(seed: int = 0, batch: int = 256, sizes: tuple[int, ...] = (784, 1024, 1024, 10)) -> Built:
    torch.manual_seed(seed)
    model = MLP(sizes)

    def make_batch(step: int) -> Batch:
        g = _gen(seed, step)
        return (
            torch.randn(batch, sizes[0], generator=g),
            torch.randint(0, sizes[-1], (batch,), generator=g),
        ), {}

    return model, make_batch, _identity


# ---- GPT-2 (transformers) -------------------------------------------------------------------


def gpt2(
    seed: int = 0,
    *,
    n_layer: int = 4,
    n_embd: int = 256,
    n_head: int = 4,
    vocab: int = 8192,
    batch: int = 8,
    seq: int = 128,
) -> Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=vocab,
        n_positions=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        # A training step has no use for the KV cache; its DynamicCache output cannot cross ONNX.
        use_cache=False,
        # Silence the "bos/eos outside the vocabulary" warning of the small vocabulary.
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config)
    model.train()

    def make_batch(step: int) -> Batch:
        ids = torch.randint(0, vocab, (batch, seq), generator=_gen(seed, step))
        # transformers 5.x builds the causal mask with aten::diff when no mask is given, which
        # the TorchScript ONNX exporter cannot export; an all-ones mask takes another path.
        return (), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    return model, make_batch, _hf_loss


# ---- tiny BERT (transformers) ---------------------------------------------------------------


def bert(
    seed: int = 0,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 2,
    vocab: int = 8192,
    batch: int = 16,
    seq: int = 128,
) -> Built:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=512,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "eager"
    model = BertForSequenceClassification(config)
    model.train()

    def make_batch(step: int) -> Batch:
        g = _gen(seed, step)
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = torch.randint(0, 2, (batch,), generator=g)
        return (), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    return model, make_batch, _hf_loss


# ---- hand-written GPT block stack -----------------------------------------------------------


class GPTBlock(nn.Module):
    """LayerNorm, causal attention with matmul+softmax, GELU MLP, residuals."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.n_head
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.n_head, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPTStack(nn.Module):
    """Token + position embeddings, ``n_layer`` GPT blocks, final LayerNorm, LM head, LM loss."""

    def __init__(self, vocab: int, d: int, n_head: int, n_layer: int, max_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.Sequential(*(GPTBlock(d, n_head) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.blocks(self.tok(ids) + self.pos(pos))
        logits = self.head(self.ln_f(x))
        # nanoGPT style: the targets arrive shifted. (Slicing ``logits[:, :-1]`` here instead
        # crashes ORT 1.19.2's compute optimizer, see bench/README.md.)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_blocks(
    seed: int = 0,
    *,
    n_layer: int = 4,
    d: int = 256,
    n_head: int = 4,
    vocab: int = 8192,
    batch: int = 8,
    seq: int = 128,
) -> Built:
    torch.manual_seed(seed)
    model = GPTStack(vocab, d, n_head, n_layer, max_len=256)

    def make_batch(step: int) -> Batch:
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=_gen(seed, step))
        return (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), {}

    return model, make_batch, _identity


# ---- tiny model for the overhead benchmark --------------------------------------------------


class Tiny(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).square().mean()


def tiny_linear(seed: int = 0, *, d: int = 16, batch: int = 4) -> Built:
    torch.manual_seed(seed)
    model = Tiny(d)

    def make_batch(step: int) -> Batch:
        return (torch.randn(batch, d, generator=_gen(seed, step)),), {}

    return model, make_batch, _identity


MODELS: dict[str, Callable[..., Built]] = {
    "mlp": mlp,
    "gpt2-4x256": gpt2,
    "bert-tiny": bert,
    "gpt-blocks-4x256": gpt_blocks,
}
"""The models of ``--models all``, in run order."""

EXTRA: dict[str, Callable[..., Built]] = {
    "tiny-linear": tiny_linear,
    # The sizes people train (issue 31): GPT-2 small and medium, vocabulary 50257.
    "gpt2-124m": functools.partial(gpt2, n_layer=12, n_embd=768, n_head=12, vocab=50257, batch=2),
    "gpt2-350m": functools.partial(gpt2, n_layer=24, n_embd=1024, n_head=16, vocab=50257, batch=1),
}
"""Models run only when named: the overhead model and the large GPT-2 sizes."""


def build(name: str, seed: int = 0) -> Built:
    try:
        builder = {**MODELS, **EXTRA}[name]
    except KeyError:
        known = ", ".join([*MODELS, *EXTRA])
        raise SystemExit(f"unknown model {name!r}; choose from {known}") from None
    return builder(seed)
