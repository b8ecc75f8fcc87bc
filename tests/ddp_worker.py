"""One rank of the DDP test (tests/test_mem_efficient_grad.py starts one process per rank).

``python -m tests.ddp_worker OUT`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set trains
``DistributedDataParallel(ORTModule(TinyGPT))`` on this rank's shard of each batch, with
memory-efficient gradients on and off, and writes losses, final weights and where DDP's
gradient hooks ran to the JSON file OUT.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

import ortfx
from tests import models

STEPS = 4
BATCH = 4
LR = 0.1


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.TinyGPT()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (BATCH, 8), generator=g), torch.randint(
        0, 64, (BATCH, 8), generator=g
    )


def _in_ort_backward() -> bool:
    return any(f.function == "backward_runner" for f in inspect.stack())


def train(mem_efficient: bool, rank: int, world: int) -> dict[str, Any]:
    options = ortfx.Options(enable_mem_efficient_grad_management=mem_efficient)
    model = torch.nn.parallel.DistributedDataParallel(
        ortfx.ORTModule(make_model(), options=options)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    inside: list[bool] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: inside.append(_in_ort_backward()))
    losses = []
    n = BATCH // world
    for step in range(STEPS):
        ids, labels = batch(step)
        loss = model(ids[rank * n : (rank + 1) * n], labels[rank * n : (rank + 1) * n])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # The global loss: the mean of the ranks' means (equal shard sizes).
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    weights = {name: p.detach().flatten().tolist() for name, p in make_named(model)}
    return {"losses": losses, "weights": weights, "inside": inside}


def make_named(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    inner = model.module.module  # DDP -> ORTModule -> TinyGPT
    return list(inner.named_parameters())


def main(out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict[str, Any] = {}
    try:
        for mem_efficient in (True, False):
            result[f"mem_efficient={mem_efficient}"] = train(mem_efficient, rank, world)
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
