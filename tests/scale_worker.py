"""Runs in a fresh process for tests/test_scale_memory.py: one first training step of a model
with a large embedding, eager or through ortfx, and how far it raised the peak RSS."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn


def high_water_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS to the current RSS
        f.write("5")


class Table(nn.Module):
    def __init__(self, rows: int, width: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, width)
        self.out = nn.Linear(width, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids)).pow(2).mean()


def first_step(backend: str, rows: int, width: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = Table(rows, width)
    run: nn.Module = model
    if backend == "ortfx":
        import ortfx

        strict = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
        warm = ortfx.ORTModule(nn.Linear(2, 2), options=strict)  # ORT's libraries loaded
        warm(torch.randn(1, 2)).sum().backward()
        run = ortfx.ORTModule(model, options=strict)
    ids = torch.randint(0, rows, (4, 16), generator=torch.Generator().manual_seed(0))
    reset_high_water()
    base = high_water_mb()
    loss = run(ids)
    loss.backward()
    return {"rise_mb": high_water_mb() - base, "loss": float(loss)}


if __name__ == "__main__":
    print(json.dumps(first_step(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
