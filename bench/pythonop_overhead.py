"""Cost of one custom autograd.Function (PythonOp) inside the ORT graph, forward + backward.

    python -m bench.pythonop_overhead [--ops 20] [--steps 300] [--processes 3]

Two graphs on ``Linear(16, 16)``, batch 4, one thread: ``--ops`` chained calls of a Function with
a trivial body (``x * 2``, backward ``g * 2``) run as PythonOp nodes, against the same chain
written inline (``h * 2``, exported as ORT ``Mul`` nodes). Each variant runs in fresh processes,
interleaved; a process reports its median step time (forward + ``backward()`` + ``zero_grad``)
after a warm-up, and the figure is the median over processes:
``(pythonop - inline) / ops`` microseconds per PythonOp.
Results: ``bench/results/pythonop-overhead-<stamp>.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CHILD = """
import json, statistics, sys, time
import torch
import ortfx

variant, ops, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        for _ in range(ops):
            h = Double.apply(h) if variant == "pythonop" else h * 2
        return h.sum()


torch.manual_seed(0)
model = ortfx.ORTModule(
    Chain(),
    options=ortfx.Options(intra_op_threads=1, fallback_policy=ortfx.FallbackPolicy.DISABLE),
)
x = torch.randn(4, 16)
times = []
for step in range(steps + 50):
    start = time.perf_counter()
    model(x).backward()
    model.zero_grad(set_to_none=True)
    if step >= 50:
        times.append(time.perf_counter() - start)
print(json.dumps({"variant": variant, "median_us": statistics.median(times) * 1e6}))
"""


def run_child(variant: str, ops: int, steps: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, variant, str(ops), str(steps)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return float(result["median_us"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--processes", type=int, default=3)
    args = parser.parse_args()
    medians: dict[str, list[float]] = {"inline": [], "pythonop": []}
    for _ in range(args.processes):
        for variant in medians:
            medians[variant].append(run_child(variant, args.ops, args.steps))
    inline = statistics.median(medians["inline"])
    pythonop = statistics.median(medians["pythonop"])
    per_op = (pythonop - inline) / args.ops
    lines = [
        f"# PythonOp overhead ({time.strftime('%Y-%m-%d')})",
        "",
        f"Linear(16, 16), batch 4, 1 thread, {args.ops} chained ops, {args.steps} steps "
        f"per process, median of {args.processes} processes per variant (interleaved).",
        "",
        "| variant | step (us), per process | median step (us) |",
        "|---|---|---|",
        *(
            f"| {v} | {', '.join(f'{t:.0f}' for t in ts)} | {statistics.median(ts):.0f} |"
            for v, ts in medians.items()
        ),
        "",
        f"**Per PythonOp, forward + backward: {per_op:.1f} us** over the inlined op.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    (results / f"pythonop-overhead-{time.strftime('%Y%m%d')}.md").write_text(text)


if __name__ == "__main__":
    main()
