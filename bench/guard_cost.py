"""What the guards cost on the fast path (issue 27).

    python -m bench.guard_cost [--steps 2000] [--repeats 5]

Two kinds of guard, each measured in this process, 1 thread:

1. **Values the trace took from tensors** (``float(mask.sum())``): the guard's tensor is an
   extra graph output, converted and compared after every run. Measured as a paired step time:
   a token-normalised loss dividing by ``float(mask.sum())`` (one data guard) against the same
   model dividing by the tensor ``mask.sum()`` (no guard), forward + backward, alternating
   blocks of steps; the difference of the medians is the guard's cost. Eager's step is measured
   beside them.
2. **State read outside the arguments** (``ortfx.outside``): the wrapper's ``Outside`` record,
   compared on every call. Measured directly (``Outside.changed()``, and the fast path's whole
   ``Tracked.unchanged()``) on a tiny GPT-2 (transformers), the GPT-2-like benchmark model and a
   small MLP: the number of guards and the µs per call and per guard.

Results: ``bench/results/guard_cost-<stamp>.md``, with the host.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch
from torch import nn

from bench import common


class TokenLoss(nn.Module):
    def __init__(self, guarded: bool) -> None:
        super().__init__()
        self.guarded = guarded
        self.fc = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        per_token = (self.fc(x).squeeze(-1) ** 2) * mask
        count = float(mask.sum()) if self.guarded else mask.sum()
        return per_token.sum() / count


def _steps(model: Any, inputs: tuple[torch.Tensor, ...], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        model(*inputs).backward()
        model.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps * 1e6


def data_guard(steps: int, repeats: int) -> dict[str, float]:
    import ortfx

    torch.manual_seed(0)
    x, mask = torch.randn(4, 8, 16), (torch.rand(4, 8) > 0.3).float()
    base = TokenLoss(guarded=False)
    eager = copy.deepcopy(base)
    plain = ortfx.ORTModule(copy.deepcopy(base))
    guarded_module = TokenLoss(guarded=True)
    guarded_module.load_state_dict(base.state_dict())
    guarded = ortfx.ORTModule(guarded_module)
    for m in (eager, plain, guarded):
        _steps(m, (x, mask), 50)  # export, session, warm-up
    times: dict[str, list[float]] = {"eager": [], "ortfx, no guard": [], "ortfx, one guard": []}
    for _ in range(repeats):
        times["eager"].append(_steps(eager, (x, mask), steps))
        times["ortfx, no guard"].append(_steps(plain, (x, mask), steps))
        times["ortfx, one guard"].append(_steps(guarded, (x, mask), steps))
    assert ortfx.stats(guarded).exports == 1
    return {k: statistics.median(v) for k, v in times.items()}


def _outside_models() -> dict[str, tuple[nn.Module, Any]]:
    from bench.models import gpt2, gpt_blocks, mlp

    built = {
        "GPT-2-like 4x256 (transformers, bench.models.gpt2)": gpt2(batch=2, seq=32),
        "GPT blocks (plain torch, bench.models.gpt_blocks)": gpt_blocks(),
        "MLP (bench.models.mlp)": mlp(batch=8),
    }
    models: dict[str, tuple[nn.Module, Any]] = {}
    for name, (model, batch, loss) in built.items():
        args, kwargs = batch(0)
        models[name] = (model, lambda w, a=args, k=kwargs, f=loss: f(w(*a, **k)).float().sum())
    return models


def outside_guards(calls: int) -> list[tuple[str, int, float, float]]:
    import ortfx

    rows = []
    for name, (model, step) in _outside_models().items():
        wrapped = ortfx.ORTModule(model)
        step(wrapped).backward()
        tracked = vars(wrapped)["_ortfx"].tracked
        read = tracked.outside
        guards = len(read) if read is not None else 0
        changed = _per_call(read.changed, calls) if read is not None else 0.0
        unchanged = _per_call(tracked.unchanged, calls)
        rows.append((name, guards, changed, unchanged))
    return rows


def _per_call(fn: Any, calls: int) -> float:
    best = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best.append((time.perf_counter() - start) / calls * 1e6)
    return min(best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    common.quiet()
    torch.set_num_threads(1)
    host = common.describe(common.machine())
    data = data_guard(args.steps, args.repeats)
    rows = outside_guards(args.calls)
    lines = [
        f"# Guard cost on the fast path ({time.strftime('%Y-%m-%d')})",
        "",
        f"Host: {host}. 1 thread; `python -m bench.guard_cost --steps {args.steps} "
        f"--repeats {args.repeats}`.",
        "",
        "## A value taken from a tensor (one data guard), per training step",
        "",
        "| run | step µs (median of repeats) |",
        "|---|---|",
        *(f"| {k} | {v:.1f} |" for k, v in data.items()),
        "",
        f"The guard: **{data['ortfx, one guard'] - data['ortfx, no guard']:+.1f} µs** per step "
        "(one extra graph output, its conversion and comparison).",
        "",
        "## State read outside the arguments, per call",
        "",
        "| model | guards | `Outside.changed()` µs | fast path's `Tracked.unchanged()` µs "
        "| µs per guard |",
        "|---|---|---|---|---|",
        *(f"| {n} | {g} | {c:.2f} | {u:.2f} | {c / g if g else 0:.3f} |" for n, g, c, u in rows),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    path = common.RESULTS / f"guard_cost-{common.stamp()}.md"
    path.write_text(text)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
