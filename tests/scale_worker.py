"""Runs in a fresh process for tests/test_scale_memory.py: one first training step of a model
with a large embedding, eager or through ortfx, and how far it raised the peak RSS."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from torch import nn

from bench.memory import _hwm_mb, _reset_hwm  # VmHWM, and its reset by clear_refs

MEASURES_PEAK = os.path.exists("/proc/self/clear_refs")  # Linux: a peak RSS that can be reset


def high_water_mb() -> float:
    """The process's peak RSS since the last reset (0 where it cannot be read)."""
    return _hwm_mb() if MEASURES_PEAK else 0.0


def reset_high_water() -> None:
    if MEASURES_PEAK:
        _reset_hwm()


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


def _train(run: nn.Module, model: Table, steps: int, rows: int) -> dict[str, Any]:
    """``steps`` SGD steps; the losses, the rows the batches touched and the peak rise."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = [
        torch.randint(0, rows, (4, 16), generator=torch.Generator().manual_seed(s))
        for s in range(steps)
    ]
    reset_high_water()
    base = high_water_mb()
    losses = []
    for ids in batches:
        loss = run(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    touched = torch.cat([b.flatten() for b in batches]).unique()
    return {
        "losses": losses,
        "rows": model.emb.weight.detach()[touched].clone(),
        "out": model.out.weight.detach().clone(),
        "rise_mb": high_water_mb() - base,
    }


def over_2gib(directory: str) -> dict[str, Any]:
    """A 2.3 GB model (Embedding(560000, 1024)) trained 2 SGD steps eagerly and through ortfx
    with save_onnx and the persistent cache, then once more from the warm cache."""
    import gc
    import logging

    import ortfx

    rows, width, steps = 560_000, 1024, 2
    torch.manual_seed(0)
    eager = _train(model := Table(rows, width), model, steps, rows)
    del model
    gc.collect()
    os.makedirs(os.path.join(directory, "onnx"))
    options = ortfx.Options(
        fallback_policy=ortfx.FallbackPolicy.DISABLE,
        cache_dir=os.path.join(directory, "cache"),
        save_onnx=True,
        onnx_prefix="big",
        log_level=ortfx.LogLevel.INFO,
        save_path=os.path.join(directory, "onnx"),
    )
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("ortfx").addHandler(Keep())
    torch.manual_seed(0)
    model = Table(rows, width)
    ours = _train(ortfx.ORTModule(model, options=options), model, steps, rows)
    del model
    gc.collect()
    torch.manual_seed(0)
    model = Table(rows, width)
    warm = _train(ortfx.ORTModule(model, options=options), model, 1, rows)
    files = {
        name: os.path.getsize(os.path.join(directory, "onnx", name))
        for name in os.listdir(os.path.join(directory, "onnx"))
    }
    return {
        "losses": [eager["losses"], ours["losses"], warm["losses"]],
        "rows_diff": float((eager["rows"] - ours["rows"]).abs().max()),
        "out_diff": float((eager["out"] - ours["out"]).abs().max()),
        "rise_mb": [eager["rise_mb"], ours["rise_mb"]],
        "table_mb": rows * width * 4 / 2**20,
        "files": files,
        "cache_hits": sum("cache hit" in r.lower() for r in records),
        "cache_misses": sum("cache miss" in r.lower() for r in records),
    }


if __name__ == "__main__":
    if sys.argv[1] == "over_2gib":
        print(json.dumps(over_2gib(sys.argv[2])))
    else:
        print(json.dumps(first_step(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
