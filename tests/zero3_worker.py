"""One rank of the ZeRO-3 tests (tests/test_zero3.py starts one process per rank).

``python -m tests.zero3_worker OUT`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set runs
every scenario in order and writes this rank's results to the JSON file OUT. Scenarios run in
one process to pay DeepSpeed's start-up once; each builds its own model and engine.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import onnx
import torch
from torch import nn

STEPS = 10
BATCH = 8
LR = 1e-2


class Net(nn.Module):
    """Embedding (a (0,)-shaped weight breaks a trace), Linear (DeepSpeed's F.linear), LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc1 = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.nn.functional.gelu(self.fc1(self.emb(ids))))
        return torch.nn.functional.mse_loss(self.fc2(h).mean(dim=1), target)


class Deep(nn.Module):
    """Eight Linear layers: phase 2 gathers one layer at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(x, target)


WIDTH, LAYERS = 32, 8


def make_deep() -> Deep:
    torch.manual_seed(0)
    return Deep()


def deep_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 16, (BATCH, 5), generator=g), torch.randn(BATCH, 4, generator=g)


def shard(
    rank: int, world: int, data: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    ids, target = (data or batch)()
    n = BATCH // world
    return ids[rank * n : (rank + 1) * n], target[rank * n : (rank + 1) * n]


def config(world: int, **zero: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # 0.19 clips at 1.0 by default
        "steps_per_print": 10**9,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True},
        },
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


# Eager DeepSpeed without prefetching or parameter reuse: what it gathers is what a layer needs.
NO_PREFETCH = {
    "stage3_prefetch_bucket_size": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_max_live_parameters": 0,
}


def plain(
    make: Callable[[], nn.Module] = make_net,
    data: Callable[[], tuple[torch.Tensor, torch.Tensor]] = batch,
) -> dict[str, Any]:
    """Plain PyTorch on the full batch: what every ZeRO-3 run must reproduce."""
    net = make()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    ids, target = data()
    losses = []
    for _ in range(STEPS):
        loss = net(ids, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "losses": losses,
        "weights": {n: p.detach().tolist() for n, p in net.named_parameters()},
    }


def gathered_weights(engine: Any) -> dict[str, Any]:
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone().tolist() for n, p in params.items()}


def all_partitioned(engine: Any) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in engine.module.parameters())


def train(
    model: nn.Module,
    rank: int,
    world: int,
    step: Callable[[Any, torch.Tensor], None] | None = None,
    check: Callable[[Any], dict[str, Any]] | None = None,
    data: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
    zero: dict[str, Any] | None = None,
) -> dict[str, Any]:
    import deepspeed

    from tests.zero3_probe import GatherProbe

    engine, *_ = deepspeed.initialize(model=model, config=config(world, **(zero or {})))
    probe = GatherProbe(engine.module.parameters()).install()
    ids, target = shard(rank, world, data)
    losses, checks = [], []
    start = time.perf_counter()
    for k in range(STEPS):
        if k == 1:
            probe.reset()  # ortfx's first step exports, which needs every weight gathered
        loss = engine(ids, target)
        if step is None:
            engine.backward(loss)
            engine.step()
        else:
            step(engine, loss)
        losses.append(loss.item())
        if check is not None:
            checks.append(check(engine))
    seconds = time.perf_counter() - start
    probe.remove()
    return {
        "peak_counted": probe.counted,
        "peak_stored": probe.stored,
        "peak_stored_at_once": probe.stored_at_once,
        "losses": losses,
        "weights": gathered_weights(engine),
        "checks": checks,
        "seconds": seconds,
        "engine": engine,
    }


def protocol_checks(engine: Any) -> dict[str, Any]:
    import ortfx
    from ortfx.hooks import zero3

    s = zero3.stats(engine)
    return {
        "partitioned": all_partitioned(engine),
        "gathers": s.gathers,
        "releases": s.releases,
        "live": s.live,
        "held": s.held_elements,
        "exports": ortfx.stats(engine.module).exports,
    }


def guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A negative control's run: its result, or the error it raised."""
    try:
        result = fn()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    result.pop("engine", None)
    return result


def main(out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    import deepspeed

    import ortfx
    from ortfx.hooks import zero3

    # DeepSpeed JIT-compiles a shared-memory all-reduce for the CPU accelerator (a minute on a
    # fresh machine); it only speeds up all_reduce, which ZeRO-3 training here does not need.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed("gloo")
    results: dict[str, Any] = {"plain": plain()}

    # Before configure: a partitioned wrapper must say what to do, not trace DeepSpeed's hooks.
    engine, *_ = deepspeed.initialize(
        model=ortfx.ORTModule(
            make_net(), options=ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
        ),
        config=config(world),
    )
    try:
        engine(*shard(rank, world))
        results["unconfigured"] = {"error": None}
    except ortfx.OrtfxInitError as e:
        results["unconfigured"] = {"error": str(e)}
    del engine

    eager = train(make_net(), rank, world)
    eager.pop("engine")
    results["eager"] = eager

    with tempfile.TemporaryDirectory() as tmp:
        zero3.configure_ort_compatible_zero_stage3(
            debug=True, stats_output_dir=tmp, layerwise=False
        )
        options = ortfx.Options(save_onnx=True, onnx_prefix="z3", save_path=tmp)
        run = train(
            ortfx.ORTModule(make_net(), options=options), rank, world, check=protocol_checks
        )
        engine = run.pop("engine")
        graph = onnx.load(os.path.join(tmp, "z3_torch_exported_training.onnx")).graph
        shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
        run["graph_shapes"] = {
            n: [shapes.get(f"module.{n}"), list(p.ds_shape)]
            for n, p in engine.module.named_parameters()
        }
        run["hook_state_on_wrapper"] = sorted(k for k in vars(engine.module) if k.startswith("ds_"))
        # An eval forward releases at once; a training forward holds until its backward is done.
        ids, target = shard(rank, world)
        with torch.no_grad():
            engine(ids, target)
        run["after_no_grad"] = protocol_checks(engine)
        loss = engine(ids, target)
        run["between"] = protocol_checks(engine)
        engine.backward(loss)
        run["after_backward"] = protocol_checks(engine)
        engine.optimizer.zero_grad()
        run["transitions"] = [str(t) for t in ortfx.explain(engine.module)]
        with open(os.path.join(tmp, f"zero3_rank{rank}.jsonl")) as f:
            run["events"] = [json.loads(line) for line in f]
    results["ortfx"] = run
    del engine

    results["layerwise"] = layerwise(rank, world)

    # Negative controls: broken protocols the checks above must catch.
    zero3.configure_ort_compatible_zero_stage3(layerwise=False)

    def assign_grads(engine: Any, loss: torch.Tensor) -> None:
        params = list(engine.module.parameters())
        grads = torch.autograd.grad(loss, params)
        with deepspeed.zero.GatheredParameters(params):
            for p, g in zip(params, grads, strict=True):
                p.grad = g
        engine.step()

    def release_early(engine: Any, loss: torch.Tensor) -> None:
        zero3.release_gathered(engine)
        engine.backward(loss)
        engine.step()

    results["grad_assign"] = guarded(
        lambda: train(ortfx.ORTModule(make_net()), rank, world, step=assign_grads)
    )
    results["early_release"] = guarded(
        lambda: train(ortfx.ORTModule(make_net()), rank, world, step=release_early)
    )
    with open(out, "w") as f:
        json.dump(results, f)


def layerwise(rank: int, world: int) -> dict[str, Any]:
    """Phase 2 on Deep: parity, pairing, and what is gathered at once against eager ZeRO-3."""
    import deepspeed

    import ortfx
    from ortfx.hooks import zero3
    from ortfx.runtime import pythonop

    reference = plain(make_deep, deep_batch)
    eager = train(make_deep(), rank, world, data=deep_batch, zero=NO_PREFETCH)
    eager.pop("engine")

    def checks(engine: Any) -> dict[str, Any]:
        return {**protocol_checks(engine), "contexts": pythonop.live_contexts()}

    with tempfile.TemporaryDirectory() as tmp:
        zero3.configure_ort_compatible_zero_stage3(debug=True, stats_output_dir=tmp, layerwise=True)
        options = ortfx.Options(save_onnx=True, onnx_prefix="lw", save_path=tmp)
        run = train(
            ortfx.ORTModule(make_deep(), options=options),
            rank,
            world,
            check=checks,
            data=deep_batch,
            zero=NO_PREFETCH,
        )
        engine = run.pop("engine")
        with torch.no_grad():  # the inference graph reads the weights as inputs: gather all
            engine(*shard(rank, world, deep_batch))
        run["after_no_grad"] = checks(engine)
        run["options"] = [
            ortfx.options_of(engine.module).zero3_layerwise,
            ortfx.options_of(engine.module).enable_mem_efficient_grad_management,
        ]
        graph = onnx.load(os.path.join(tmp, "lw_optimized_training.onnx")).graph
        run["regathers"] = sum(
            n.op_type == "PythonOp" and n.name.startswith("ortfx_layerwise_regather_")
            for n in graph.node
        )
        run["ordered_feeds"] = sum(
            n.op_type == "PassThrough" and n.name.startswith("ortfx_layerwise_feed_")
            for n in graph.node
        )
        with open(os.path.join(tmp, f"zero3_rank{rank}.jsonl")) as f:
            run["events"] = [json.loads(line) for line in f]
    del engine
    zero3.configure_ort_compatible_zero_stage3()  # the default: layer-wise
    # An eval-mode forward first exports the eval graph; the training export that follows
    # happens with partitioned weights and must gather them for its trace.
    engine, *_ = deepspeed.initialize(
        model=ortfx.ORTModule(make_deep()), config=config(world, **NO_PREFETCH)
    )
    x, target = shard(rank, world, deep_batch)
    engine.eval()  # the eval-mode graph is its own export
    with torch.no_grad():
        first = engine(x, target).item()
    engine.train()
    loss = engine(x, target)
    engine.backward(loss)
    engine.step()
    run["eval_first"] = {
        "losses": [first, loss.item()],
        "partitioned": all_partitioned(engine),
        "exports": ortfx.stats(engine.module).exports,
        "default_layerwise": ortfx.options_of(engine.module).zero3_layerwise,
    }
    zero3.configure_ort_compatible_zero_stage3(layerwise=False)
    return {"plain": reference, "eager": eager, "ortfx": run}


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
