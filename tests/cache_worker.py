"""One process of the persistent export cache tests (tests/test_disk_cache.py).

``python -m tests.cache_worker CACHE_DIR OUT [MODEL]`` trains a small transformer-like model
(MODEL ``block``, the default; ``gpt2``: a tiny Hugging Face GPT-2, whose output is a
``ModelOutput`` and whose mask code makes the tracer bake in values computed from sizes;
``index_add``: a module whose ``index_add`` runs in torch inside the graph; ``batchnorm``: a
BatchNorm model, whose running statistics the graph updates; ``tied`` / ``untied``: a small
language model with or without its head tied to its embedding) for two steps through ortfx with ``Options(cache_dir=CACHE_DIR)``, then once
in eval mode, and writes the outputs, gradients, buffers and the export/cache events to OUT
(torch.save), so a cold and a warm process can be compared.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

import ortfx
from ortfx.runtime import events


class Block(nn.Module):
    """Embedding, LayerNorm, attention-free MLP with GELU, a buffer and a dropout-free head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16, padding_idx=0)
        self.norm = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 16))
        self.head = nn.Linear(16, 32)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.mlp(self.norm(h)) * self.scale
        return self.head(h)


class IndexAdd(nn.Module):
    """``index_add`` runs in torch inside the graph (an ATen node with a gradient definition)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.lin(ids.float())
        return torch.zeros(4, 32).index_add(0, ids[:, 0] % 4, rows).repeat(1, 8).reshape(4, 8, 32)


class BatchNormNet(nn.Module):
    """BatchNorm between two layers: the graph computes the running statistics' updates."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.embed(ids))))


class LanguageModel(nn.Module):
    """Embedding, LayerNorm and a head that is (``tie``) or is not the embedding's weight."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def _gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def main(cache_dir: str, out: str, which: str = "block") -> None:
    torch.manual_seed(0)
    models: dict[str, Callable[[], nn.Module]] = {
        "block": Block,
        "gpt2": _gpt2,
        "index_add": IndexAdd,
        "batchnorm": BatchNormNet,
        "tied": lambda: LanguageModel(tie=True),
        "untied": lambda: LanguageModel(tie=False),
    }
    model = models[which]()
    wrapped = ortfx.ORTModule(model, options=ortfx.Options(cache_dir=cache_dir))
    ids = torch.randint(0, 32, (4, 8))
    outputs = []
    with events.recording() as seen:
        for _ in range(2):
            model.zero_grad()
            logits = wrapped(ids)
            if which == "gpt2":
                logits = logits.logits
            loss = nn.functional.cross_entropy(logits.reshape(-1, 32), ids.reshape(-1))
            loss.backward()
            outputs.append(logits.detach())
        wrapped.eval()
        with torch.no_grad():
            result = wrapped(ids)
            outputs.append(result.logits if which == "gpt2" else result)
    torch.save(
        {
            "outputs": outputs,
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "exports": sum(name == "export" for name, _ in seen),
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "disk": [(args[0], str(args[1])) for name, args in seen if name == "disk_cache"],
            "gradient": [args[0] for name, args in seen if name == "gradient_cache"],
            "stats_exports": ortfx.stats(wrapped).exports,
        },
        out,
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
