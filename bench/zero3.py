"""DeepSpeed ZeRO-3 on 2 ranks (gloo, CPU): step time and peak gathered parameter elements per
rank for eager DeepSpeed, ortfx phase 1 (gather all) and ortfx phase 2 (layer-wise).

    python -m bench.zero3 [--layers 8] [--width 512] [--batch 32] [--steps 12] [--rounds 3]

Starts one process per rank. Each runs, per round, the three backends in turn on a fresh
8 x Linear(width) + tanh model with the same data (the first step of each run is excluded: it
exports for ortfx). Step time is the median over steps, then the lowest over rounds. Peak
gathered elements are sampled after every gather (``tests/zero3_probe.py``): ``counted`` is
DeepSpeed's status, ``stored`` the gathered storage still alive (held by anyone, ORT included).
DeepSpeed runs without prefetching or reuse (``stage3_prefetch_bucket_size``,
``stage3_max_reuse_distance``, ``stage3_max_live_parameters`` = 0,
``stage3_param_persistence_threshold`` = 0). Results go to ``bench/results/zero3-<date>.md``
and ``.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.common import describe, machine, stamp

BACKENDS = ("eager DeepSpeed", "ortfx phase 1", "ortfx phase 2")
# Phase 2's feeds without the gradient-graph rewrite: what ORT keeps on its own (measurement).
UNREWRITTEN = "ortfx phase 2 without the rewrite"


class Deep(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(x, target)


def _config(batch: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_max_live_parameters": 0,
        },
    }


def _run(backend: str, args: argparse.Namespace, probed: bool) -> dict[str, Any]:
    import deepspeed

    import ortfx
    from ortfx.hooks import zero3
    from tests.zero3_probe import GatherProbe

    torch.manual_seed(0)
    model: nn.Module = Deep(args.layers, args.width)
    if backend != BACKENDS[0]:
        zero3.configure_ort_compatible_zero_stage3(layerwise=backend in (BACKENDS[2], UNREWRITTEN))
        model = ortfx.ORTModule(model)
    engine, *_ = deepspeed.initialize(model=model, config=_config(args.batch))
    if backend == UNREWRITTEN:
        ortfx.configure(engine.module, zero3_layerwise=False)
    # The probe pauses after each gather: runs that measure time go without it.
    probe = GatherProbe(engine.module.parameters())
    if probed:
        probe.install()
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)
    times = []
    for step in range(args.steps):
        if step == 1:
            probe.reset()
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    probe.remove()
    return {
        "backend": backend,
        "probed": probed,
        "step_ms": 1000 * statistics.median(times[1:]),
        "first_step_ms": 1000 * times[0],
        "peak_counted": probe.counted,
        "peak_stored": probe.stored,
        "peak_stored_at_once": probe.stored_at_once,
        "total": sum(p.ds_numel for p in engine.module.parameters()),
        "loss": loss.item(),
    }


def _worker(out: str, args: argparse.Namespace) -> None:
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see tests/zero3_worker.py
    deepspeed.init_distributed("gloo")
    rows = [
        {"round": r, **_run(backend, args, probed=False)}
        for r in range(args.rounds)
        for backend in BACKENDS
    ]
    rows += [
        {"round": -1, **_run(backend, args, probed=True)} for backend in (*BACKENDS, UNREWRITTEN)
    ]
    with open(out, "w") as f:
        json.dump(rows, f)


def _launch(args: argparse.Namespace, world: int) -> list[list[dict[str, Any]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                "DS_ACCELERATOR": "cpu",
                "OMP_NUM_THREADS": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
            }
            cmd = [sys.executable, "-m", "bench.zero3", *sys.argv[1:], "--worker", f"{tmp}/{rank}"]
            procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL))
        codes = [p.wait(timeout=1800) for p in procs]
        if codes != [0] * world:
            raise SystemExit(f"a rank failed: exit codes {codes}")
        return [json.loads(Path(f"{tmp}/{rank}").read_text()) for rank in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args)
        return
    m = machine()
    ranks = _launch(args, world=2)
    lines = [
        f"# ZeRO-3, 2 ranks (gloo, CPU, 1 thread each): {args.layers} x Linear({args.width}), "
        f"batch {args.batch} per rank",
        "",
        describe(m),
        "",
        f"`python -m bench.zero3 {' '.join(sys.argv[1:])}`",
        "",
        "| backend | step ms (best round, median of steps 2+) | first step ms "
        "| peak gathered elements per rank after step 1: counted / stored / stored at once "
        "| stored, share of the model |",
        "|---|---|---|---|---|",
    ]
    for backend in (*BACKENDS, UNREWRITTEN):
        rows = [row for rank in ranks for row in rank if row["backend"] == backend]
        timed = [r for r in rows if not r["probed"]]
        rounds = [[r["step_ms"] for r in timed if r["round"] == k] for k in range(args.rounds)]
        best = f"{min(statistics.mean(t) for t in rounds):.1f}" if timed else "-"
        first = f"{statistics.median(r['first_step_ms'] for r in timed):.0f}" if timed else "-"
        probed = [r for r in rows if r["probed"]]
        counted = max(r["peak_counted"] for r in probed)
        stored = max(r["peak_stored"] for r in probed)
        at_once = max(r["peak_stored_at_once"] for r in probed)
        total = rows[0]["total"]
        lines.append(
            f"| {backend} | {best} | {first} | {counted} / {stored} / {at_once} "
            f"| {100 * stored / total:.1f} % |"
        )
    out = Path(__file__).parent / "results" / f"zero3-{stamp()[:8]}"
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    with out.with_suffix(".jsonl").open("w") as f:
        f.write(json.dumps({"machine": m, "args": vars(args)}) + "\n")
        for rank, rows in enumerate(ranks):
            for row in rows:
                f.write(json.dumps({"rank": rank, **row}) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
