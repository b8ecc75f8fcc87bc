"""What a StatisticsSubscriber costs per training step in plain PyTorch, outside and inside its
window, on small models where the per-module hook cost is most visible.

    python -m bench.hooks_overhead [--rounds 7] [--steps 200] [--threads 1]

Per model, interleaved rounds of: unsubscribed; subscribed with the window far in the future
(every step outside it); subscribed with every step inside (files written to a temporary
directory). Each figure is the lowest over rounds of the median step time (forward + backward):
on a shared machine the lowest round is the one least disturbed by other processes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ortfx.hooks import StatisticsSubscriber, SubscriberManager
from tests.models import MLP, TinyGPT


def _median_step(
    model: torch.nn.Module, make: Callable[[], tuple[torch.Tensor, ...]], n: int
) -> float:
    times = []
    for _ in range(n):
        args = make()
        start = time.perf_counter()
        out = model(*args)
        (out if out.dim() == 0 else out.sum()).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[n // 10 :])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cases: list[tuple[str, torch.nn.Module, Callable[[], tuple[torch.Tensor, ...]]]] = [
        (
            "50 x Linear(8, 8), batch 4",
            torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(50))),
            lambda: (torch.randn(4, 8),),
        ),
        ("MLP 8-32-4, batch 16", MLP(), lambda: (torch.randn(16, 8),)),
        (
            "TinyGPT (2 blocks, d 32), batch 4 x 32",
            TinyGPT(),
            lambda: (torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32))),
        ),
    ]
    for name, model, make in cases:
        modules = len(list(model.modules()))
        results: dict[str, list[float]] = {"off": [], "outside": [], "inside": []}
        manager = SubscriberManager()
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                results["off"].append(_median_step(model, make, args.steps))
                out = Path(tmp) / f"outside{r}"
                manager.subscribe(model, [StatisticsSubscriber(out, start_step=10**9)])
                results["outside"].append(_median_step(model, make, args.steps))
                manager.subscribe(model, [StatisticsSubscriber(Path(tmp) / f"inside{r}")])
                results["inside"].append(_median_step(model, make, max(args.steps // 10, 5)))
                manager.unsubscribe()
        off, outside, inside = (min(results[k]) * 1e6 for k in results)
        print(
            f"{name} ({modules} modules): unsubscribed {off:.0f} us/step; outside the window "
            f"{outside:.0f} us (+{outside - off:.0f} us, {(outside - off) / modules:.1f} us per "
            f"module); inside {inside / 1000:.1f} ms"
        )


if __name__ == "__main__":
    main()
