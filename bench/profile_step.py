"""Where a training step's time goes: ortfx (ORT's node profiler) versus eager (torch.profiler).

    python -m bench.profile_step --model gpt2-4x256 --steps 8 --warmup 2 --threads 1

Both sides profile forward + backward only (gradients dropped each step, no optimizer: the
optimizer is the same torch code for both). ortfx's side turns on ``SessionOptions.
enable_profiling`` by monkeypatching ``ortfx.runtime.session.session_options`` and sums the
per-node ``kernel_time`` events of the profiled steps by op type; eager's side sums
``torch.profiler`` self CPU time by aten op. Both are then grouped into rough categories.

Results: ``bench/results/profile-<model>-<stamp>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

from bench import common

CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("loss (log-softmax, nll)", ("crossentropy", "log_softmax", "logsoftmax", "nll_loss",
                                 "logsumexp")),
    ("matmul / gemm", ("matmul", "gemm", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                       "aten::linear", "aten::dot")),
    ("softmax (attention)", ("softmaxgrad", "aten::_softmax", "aten::softmax", "softmax")),
    ("layernorm", ("layernorm", "layer_norm")),
    ("gelu / activation", ("gelu", "tanh", "relu", "aten::pow", "powgrad")),
    ("embedding / gather", ("gather", "embedding", "index_select", "scatter")),
    ("reductions", ("reduce", "aten::sum", "aten::mean")),
    ("copies / layout", ("transpose", "copy", "clone", "contiguous", "cast", "aten::to",
                         "reshape", "expand", "concat", "aten::cat", "split", "slice", "identity",
                         "view", "aten::fill_", "zeros", "empty", "aten::ones")),
    ("elementwise", ("add", "sub", "mul", "div", "sqrt", "neg", "masked", "equal", "exp",
                     "less", "greater", "not", "and", "where", "max", "min", "bitwise", "sigmoid")),
]  # fmt: skip


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def step(model: Any, args: Any, kwargs: Any, loss_fn: Any) -> None:
    loss = loss_fn(model(*args, **kwargs))
    loss.backward()
    for p in model.parameters():
        p.grad = None


def profile_ortfx(ns: argparse.Namespace) -> dict[str, Any]:
    import torch

    from bench.models import build
    from ortfx import passes
    from ortfx.runtime import events

    if ns.graph_pass:
        # An extra ortfx pass on the graph every session receives (to measure one).
        events.session_passes.append(getattr(passes, ns.graph_pass))
    torch.set_num_threads(ns.threads)
    prefix = os.path.join(tempfile.mkdtemp(prefix="ortprof-"), "ortfx")

    def profiling(so: Any, training: bool) -> None:
        so.enable_profiling = True
        so.profile_file_prefix = prefix

    events.session_option_edits.append(profiling)
    runners: list[tuple[Any, float]] = []

    def session_opened(name: str, *args: Any) -> None:
        if name == "session" and args[0] == "training":
            # ORT's profiler clock started when this session was created, just before.
            runners.append((args[1], time.perf_counter() - args[1].session_seconds))

    events.listen(session_opened)

    import ortfx

    model, make_batch, loss_fn = build(ns.model)
    wrapped = ortfx.ORTModule(model, options=ortfx.Options(intra_op_threads=ns.threads))
    batches = [make_batch(i) for i in range(ns.warmup + ns.steps)]
    for i in range(ns.warmup):
        step(wrapped, *batches[i], loss_fn)
    runner, created = runners[-1]
    # ORT's profiler clock starts when the session is created (inside open_training)
    cutoff_us = (time.perf_counter() - created) * 1e6
    times = []
    for i in range(ns.warmup, ns.warmup + ns.steps):
        t = time.perf_counter()
        step(wrapped, *batches[i], loss_fn)
        times.append(time.perf_counter() - t)
    path = runner.session.end_profiling()
    with open(path) as f:
        events = json.load(f)
    by_op: dict[str, float] = defaultdict(float)
    fwd_bwd = {"forward": 0.0, "backward": 0.0}
    count: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if e["ts"] < cutoff_us:
            continue
        op = e.get("args", {}).get("op_name", "?")
        by_op[op] += e["dur"]
        count[op] += 1
        is_bwd = "Grad" in op or "_Grad" in e["name"] or "grad" in e["name"].lower()
        fwd_bwd["backward" if is_bwd else "forward"] += e["dur"]
    n = ns.steps
    return {
        "ops": {k: v / n / 1e3 for k, v in by_op.items()},  # ms per step
        "counts": {k: v / n for k, v in count.items()},
        "split": {k: v / n / 1e3 for k, v in fwd_bwd.items()},
        "wall_ms": 1e3 * common.median(times),
        "trace": path,
    }


def profile_eager(ns: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.models import build

    torch.set_num_threads(ns.threads)
    model, make_batch, loss_fn = build(ns.model)
    batches = [make_batch(i) for i in range(ns.warmup + ns.steps)]
    for i in range(ns.warmup):
        step(model, *batches[i], loss_fn)
    times = []
    for i in range(ns.warmup, ns.warmup + ns.steps):
        t = time.perf_counter()
        step(model, *batches[i], loss_fn)
        times.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(ns.warmup, ns.warmup + ns.steps):
            step(model, *batches[i], loss_fn)
    ops = {}
    counts = {}
    for ev in prof.key_averages():
        if ev.self_cpu_time_total > 0:
            ops[ev.key] = ev.self_cpu_time_total / ns.steps / 1e3
            counts[ev.key] = ev.count / ns.steps
    return {"ops": ops, "counts": counts, "wall_ms": 1e3 * common.median(times)}


def report(
    ns: argparse.Namespace, o: dict[str, Any], e: dict[str, Any], mach: dict[str, Any]
) -> str:
    def top(ops: dict[str, float], counts: dict[str, float], k: int) -> list[str]:
        total = sum(ops.values())
        rows = ["| op | ms/step | calls/step | share |", "|---|---:|---:|---:|"]
        for name, v in sorted(ops.items(), key=lambda kv: -kv[1])[:k]:
            rows.append(
                f"| {name} | {v:.2f} | {counts.get(name, 0):.0f} | {100 * v / total:.1f}% |"
            )
        return rows

    def cats(ops: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for name, v in ops.items():
            out[category(name)] += v
        return out

    oc, ec = cats(o["ops"]), cats(e["ops"])
    o_total, e_total = sum(o["ops"].values()), sum(e["ops"].values())
    lines = [
        f"# Step profile: ortfx vs eager on {ns.model} ({mach['date'][:10]})",
        "",
        f"Machine: {common.describe(mach)}",
        "",
        f"Command: `python -m bench.profile_step {' '.join(ns.argv)}`",
        "",
        f"Forward + backward only (no optimizer), {ns.steps} profiled steps after {ns.warmup} "
        f"warm-up, {ns.threads} thread(s). ortfx: ORT node kernel times; eager: torch.profiler "
        "self CPU time (profiler overhead included, so eager op sums are a little high).",
        "",
        "| | wall ms/step (unprofiled) | op time ms/step | ops/step |",
        "|---|---:|---:|---:|",
        f"| eager | {e['wall_ms']:.1f} | {e_total:.1f} | {sum(e['counts'].values()):.0f} |",
        f"| ortfx (ORT kernels; forward {o['split']['forward']:.1f} + backward "
        f"{o['split']['backward']:.1f}) | {o['wall_ms']:.1f} | {o_total:.1f} | "
        f"{sum(o['counts'].values()):.0f} |",
        "",
        "By category (ms/step):",
        "",
        "| category | eager | ortfx (ORT) | ortfx - eager |",
        "|---|---:|---:|---:|",
    ]
    for cat in sorted(set(oc) | set(ec), key=lambda c: -(oc.get(c, 0) + ec.get(c, 0))):
        lines.append(f"| {cat} | {ec.get(cat, 0):.2f} | {oc.get(cat, 0):.2f} | "
                     f"{oc.get(cat, 0) - ec.get(cat, 0):+.2f} |")  # fmt: skip
    lines += ["", f"Top {ns.top} ORT op types (ortfx):", "", *top(o["ops"], o["counts"], ns.top)]
    lines += [
        "",
        f"Top {ns.top} aten ops (eager, self time):",
        "",
        *top(e["ops"], e["counts"], ns.top),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="gpt2-4x256")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=20)
    p.add_argument(
        "--graph-pass",
        default="",
        help="an extra ortfx.passes pass applied to ortfx's graph, e.g. add_dropout_masks",
    )
    p.add_argument("--tag", default="")
    p.add_argument("--_side", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    ns.argv = argv
    common.quiet()
    if ns._side:
        out = profile_ortfx(ns) if ns._side == "ortfx" else profile_eager(ns)
        print(json.dumps(out))
        return
    import subprocess

    results = {}
    for side in ("eager", "ortfx"):
        proc = subprocess.run([sys.executable, "-m", "bench.profile_step", "--_side", side, *argv],
                              env=common.thread_env(ns.threads), cwd=common.ROOT,
                              capture_output=True, text=True, check=False)  # fmt: skip
        if proc.returncode:
            raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
        results[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    mach = common.machine()
    text = report(ns, results["ortfx"], results["eager"], mach)
    path = common.RESULTS / f"profile-{ns.model}-{ns.tag or common.stamp()}.md"
    path.write_text(text)
    print(text)
    print(f"written {path}; ORT trace: {results['ortfx']['trace']}")


if __name__ == "__main__":
    main()
