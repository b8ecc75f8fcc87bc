"""One process of the persistent export cache tests (tests/test_disk_cache.py).

``python -m tests.cache_worker CACHE_DIR OUT [gpt2|index_add]`` trains a small transformer-like
model (or a tiny Hugging Face GPT-2, whose output is a ``ModelOutput`` and whose mask code makes
the tracer bake in values computed from sizes; or a module whose ``index_add`` runs in torch
inside the graph) for two steps through ortfx with ``Options(cache_dir=CACHE_DIR)`` and writes the outputs, gradients and
the export/cache events to OUT (torch.save), so a cold and a warm process can be compared.
"""

from __future__ import annotations

import sys

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


def _gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def main(cache_dir: str, out: str, which: str = "block") -> None:
    torch.manual_seed(0)
    model = {"gpt2": _gpt2, "index_add": IndexAdd}.get(which, Block)()
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
            "disk": [(args[0], str(args[1])) for name, args in seen if name == "disk_cache"],
            "stats_exports": ortfx.stats(wrapped).exports,
        },
        out,
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
