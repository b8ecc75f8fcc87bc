"""The host's own limit for a model's training step: its matrix products at the fastest GEMM
this host runs, measured in the same run as the step times.

    python -m bench.roofline --model gpt2-4x256 [--threads 1] [--rounds 5] [--calls 3]

1. FLOPs per step: one eager training step (forward with the loss, backward) under
   ``torch.utils.flop_counter.FlopCounterMode``.
2. The products: the same step under ``torch.profiler`` with shapes recorded; every ``aten::mm``,
   ``addmm``, ``bmm`` and ``baddbmm`` becomes (batch, M, K, N) with its count.
3. Each distinct shape is timed on this host at the given thread count, in torch (``torch.mm`` /
   ``torch.bmm``: MKL or oneDNN) and in ONNX Runtime (one ``MatMul`` node: MLAS, I/O binding,
   spinning off), the two alternating; minimum over rounds of the mean of ``--calls`` calls.
4. The AdamW step alone on the model's parameters (torch, as bench.compare runs it for every
   backend), reported beside the roofline, not in it: at 100M+ parameters it is a large,
   memory-bound share of the step that no backend of the forward and backward changes.
5. The roofline is the sum over shapes of count x the faster of the two: the time this host needs
   for the step's products alone. Everything else (softmax, LayerNorm, GELU, the loss, the
   optimizer, copies) counts as zero, so no backend reaches it; a step at 1.2x the roofline
   spends 20 % of the products' time on everything else. The all-MLAS and all-torch sums are
   reported too: what a backend that uses only one of the two libraries must spend.

``bench.compare --roofline`` runs this in a worker of its own before the rounds and reports each
backend's step as a multiple of it. Alone, the script writes ``bench/results/roofline-<stamp>.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import common

PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
Shape = tuple[int, int, int, int]  # batch, M, K, N


def _shape(name: str, shapes: list[list[int]]) -> Shape:
    """(batch, M, K, N) of one recorded product from its operands' shapes."""
    a, b = (shapes[1], shapes[2]) if name in ("aten::addmm", "aten::baddbmm") else shapes[:2]
    if len(a) == 2:
        return 1, a[0], a[1], b[1]
    return a[0], a[1], a[2], b[2]


def step_products(model_name: str, seed: int = 0) -> tuple[float, Counter[Shape]]:
    """(FLOPs of one eager forward+backward, count of each product shape in it)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from bench.models import build

    model, make_batch, loss_fn = build(model_name, seed)
    args, kwargs = make_batch(0)
    counter = FlopCounterMode(display=False)
    with counter:
        loss_fn(model(*args, **kwargs)).backward()  # type: ignore[no-untyped-call]
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:  # fmt: skip
        loss_fn(model(*args, **kwargs)).backward()  # type: ignore[no-untyped-call]
    shapes: Counter[Shape] = Counter(
        _shape(e.name, e.input_shapes) for e in prof.events() if e.name in PRODUCTS
    )
    return float(counter.get_total_flops()), shapes


def optimizer_seconds(
    model_name: str, seed: int = 0, rounds: int = 3, *, fused: bool = False
) -> float:
    """One AdamW step over the model's parameters (torch's default implementation, as
    bench.compare steps it for every backend): the minimum over ``rounds`` after the step that
    creates its state. Memory-bound, and the same code whatever runs the forward and backward."""
    import torch

    from bench.models import build

    model, _, _ = build(model_name, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=fused or None)
    optimizer.step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return min(times)


def _ort_matmul(shape: Shape, threads: int) -> Callable[[], object]:
    import numpy as np

    from bench.matmul import one_node_session

    batch, m, k, n = shape
    session = one_node_session("MatMul", threads)
    lead = () if batch == 1 else (batch,)
    rng = np.random.default_rng(0)
    binding = session.io_binding()
    binding.bind_cpu_input("a", rng.standard_normal((*lead, m, k), dtype=np.float32))
    binding.bind_cpu_input("b", rng.standard_normal((*lead, k, n), dtype=np.float32))
    binding.bind_output("c")
    return functools.partial(session.run_with_iobinding, binding)


def _torch_matmul(shape: Shape) -> Callable[[], object]:
    import torch

    batch, m, k, n = shape
    if batch == 1:
        return functools.partial(torch.mm, torch.randn(m, k), torch.randn(k, n))
    return functools.partial(torch.bmm, torch.randn(batch, m, k), torch.randn(batch, k, n))


def _time(run: Callable[[], object], calls: int) -> float:
    run()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def measure(model_name: str, threads: int, rounds: int = 5, calls: int = 3) -> dict[str, Any]:
    """FLOPs, products and the roofline of one model's training step on this host."""
    import torch

    torch.set_num_threads(threads)
    flops, shapes = step_products(model_name)
    rows: list[dict[str, Any]] = []
    for shape, count in sorted(shapes.items(), key=lambda kv: -kv[1] * _flops(kv[0])):
        ort_run, torch_run = _ort_matmul(shape, threads), _torch_matmul(shape)
        ort_s, torch_s = [], []
        for _ in range(rounds):
            ort_s.append(_time(ort_run, calls))
            torch_s.append(_time(torch_run, calls))
        rows.append(
            {"shape": list(shape), "count": count, "ort_s": min(ort_s), "torch_s": min(torch_s)}
        )
    product_flops = sum(r["count"] * _flops(r["shape"]) for r in rows)
    best = sum(r["count"] * min(r["ort_s"], r["torch_s"]) for r in rows)
    return {
        "model": model_name,
        "threads": threads,
        "flops": flops,
        "product_flops": product_flops,
        "roofline_s": best,
        "ort_products_s": sum(r["count"] * r["ort_s"] for r in rows),
        "torch_products_s": sum(r["count"] * r["torch_s"] for r in rows),
        "optimizer_s": optimizer_seconds(model_name),
        "fused_optimizer_s": optimizer_seconds(model_name, fused=True),
        "products": rows,
    }


def _flops(shape: Shape | list[int]) -> int:
    batch, m, k, n = shape
    return 2 * batch * m * k * n


def summary(r: dict[str, Any]) -> str:
    """One line: FLOPs, the best throughput and the limit."""
    return (
        f"{r['flops'] / 1e9:.1f} GFLOP per step (FlopCounterMode; products "
        f"{r['product_flops'] / 1e9:.1f}); products at the faster kernel per shape "
        f"{r['roofline_s'] * 1e3:.0f} ms "
        f"({r['product_flops'] / r['roofline_s'] / 1e9:.0f} GFLOP/s), "
        f"all in MLAS {r['ort_products_s'] * 1e3:.0f} ms, all in torch "
        f"{r['torch_products_s'] * 1e3:.0f} ms, {r['threads']} thread(s)"
        + (
            f"; AdamW step alone (torch, the same code for every backend) "
            f"{r['optimizer_s'] * 1e3:.0f} ms"
            + (
                f" (fused=True: {r['fused_optimizer_s'] * 1e3:.0f} ms)"
                if "fused_optimizer_s" in r
                else ""
            )
            if "optimizer_s" in r
            else ""
        )
    )


def markdown(r: dict[str, Any], mach: dict[str, Any], argv: list[str]) -> str:
    lines = [
        f"# Roofline of {r['model']} ({mach['date'][:10]})",
        "",
        f"Machine: {common.describe(mach)}",
        "",
        f"Command: `python -m bench.roofline {' '.join(argv)}`",
        "",
        f"**{summary(r)}.**",
        "",
        "| batch | M | K | N | count | GFLOP each | MLAS ms | torch ms | MLAS GFLOP/s "
        "| torch GFLOP/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in r["products"]:
        f = _flops(p["shape"])
        lines.append(
            "| {} | {} | {} | {} | ".format(*p["shape"])
            + f"{p['count']} | {f / 1e9:.3f} | {p['ort_s'] * 1e3:.2f} | {p['torch_s'] * 1e3:.2f} "
            f"| {f / p['ort_s'] / 1e9:.0f} | {f / p['torch_s'] / 1e9:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-4x256")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--out", help="write the measurement as JSON here (bench.compare's worker)")
    ns = p.parse_args(argv)
    common.quiet()
    r = measure(ns.model, ns.threads, ns.rounds, ns.calls)
    if ns.out:
        Path(ns.out).write_text(json.dumps(r))
        return
    text = markdown(r, common.machine(), argv)
    print(text)
    out = common.RESULTS / f"roofline-{ns.model}-{ns.threads}t-{common.stamp()}.md"
    out.write_text(text)
    print(f"results: {out}")


if __name__ == "__main__":
    main()
