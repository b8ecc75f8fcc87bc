"""Side-by-side demo: a small GPT-style model trained through ortfx and through plain PyTorch.

Run with ``python -m ortfx.demo [--steps N] [--threads N]``.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import ortfx


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~causal, float("-inf")).softmax(-1))
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, d)))
        out: torch.Tensor = x + self.drop(self.fc2(F.gelu(self.fc(self.ln2(x)))))
        return out


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 4, dropout: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(256, d)
        self.blocks = nn.ModuleList(Block(d, 4, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(
        self, ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    # INFO: one line per transition with its cost, and the feature table per session.
    wrapped = ortfx.ORTModule(model, ortfx.DebugOptions(log_level=ortfx.LogLevel.INFO))
    opt_ort = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    opt_eager = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"TinyGPT: {n_params / 1e6:.2f}M parameters, batch {args.batch}, seq {args.seq}, "
        f"{args.threads} thread(s), torch {torch.__version__}\n"
    )
    print(
        f"{'step':>4} {'loss ortfx':>11} {'loss torch':>11} {'|diff|':>9} "
        f"{'ortfx ms':>9} {'torch ms':>9}"
    )
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {"ortfx": [], "torch": []}
    for step in range(args.steps):
        ids = torch.randint(0, 512, (args.batch, args.seq), generator=gen)
        labels = ids.roll(-1, dims=1)
        losses = {}
        for name, m, opt in (("ortfx", wrapped, opt_ort), ("torch", reference, opt_eager)):
            start = time.perf_counter()
            opt.zero_grad()
            loss = m(ids, labels)["loss"]
            loss.backward()
            opt.step()
            times[name].append(time.perf_counter() - start)
            losses[name] = loss.item()
        print(
            f"{step:>4} {losses['ortfx']:>11.5f} {losses['torch']:>11.5f} "
            f"{abs(losses['ortfx'] - losses['torch']):>9.2e} "
            f"{1e3 * times['ortfx'][-1]:>9.1f} {1e3 * times['torch'][-1]:>9.1f}"
        )

    # A validation pass in eval mode: a new graph for the eval mode, exported once.
    wrapped.eval()
    with torch.no_grad():
        wrapped(ids)
    wrapped.train()

    steady = {k: statistics.median(v[2:]) for k, v in times.items()}
    print(
        f"\nfirst step (export + gradient build + session + run): "
        f"ortfx {times['ortfx'][0]:.2f} s, torch {times['torch'][0]:.2f} s"
    )
    print(
        f"median step after warm-up: ortfx {1e3 * steady['ortfx']:.1f} ms, "
        f"torch {1e3 * steady['torch']:.1f} ms, ratio {steady['ortfx'] / steady['torch']:.2f}x"
    )
    print(f"\n{ortfx.stats(wrapped)}")
    print("transitions:")
    for transition in ortfx.explain(wrapped):
        print(f"  call {transition.call}: {transition}")


if __name__ == "__main__":
    main()
