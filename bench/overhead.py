"""Wrapper overhead of ortfx on a model where overhead dominates (Linear(16, 16), batch 4).

    python -m bench.overhead [--steps 3000] [--threads 1] [--profile]
    python -m bench.overhead --against DIR [--repeats 6]

Measures, per training step (forward + ``loss.backward()`` + ``zero_grad``; no optimizer):

1. eager PyTorch, for reference;
2. ortfx, uninstrumented;
3. the same step's graph run through its training runner directly (ORT's forward and backward
   plus the DLPack crossing; the runner comes from the ``session`` event of
   :mod:`ortfx.runtime.events`): the difference to (2) is what the shell and torch autograd
   cost on top of running the graph;
4. ``--profile``: cProfile top functions by own time, and a pyinstrument tree if installed
   (where the shell's time goes, function by function).

``--against DIR`` measures another checkout of ortfx (e.g. ``git worktree add /tmp/before
<commit>``, with the compiled bridge copied in) the same way, its processes interleaved with this
tree's (same host, same moment), and reports both and the difference: a change to the call path
is "no slower" only by this paired comparison.

No private name is patched: the runner is reached through the designed event seam.

Results: ``bench/results/overhead-<stamp>.md`` (and ``.txt`` with the raw profiles).
"""

from __future__ import annotations

import argparse
import cProfile
import io as _io
import pstats
import statistics
import sys
import time
from typing import Any

from bench import common


def make(backend: str, threads: int) -> tuple[Any, Any]:

    from bench.models import tiny_linear

    model, make_batch, _ = tiny_linear(0)
    if backend == "ortfx":
        import ortfx

        return ortfx.ORTModule(model, options=ortfx.Options(intra_op_threads=threads)), make_batch
    return model, make_batch


def loop(
    model: Any, batches: list[Any], steps: int, warmup: int
) -> tuple[list[float], list[float]]:
    """Per-step forward and backward times in microseconds (after ``warmup`` steps)."""
    clock = time.perf_counter_ns
    fwd, bwd = [], []
    params = list(model.parameters())
    n = len(batches)
    for step in range(warmup + steps):
        (x,), _ = batches[step % n]
        t0 = clock()
        loss = model(x)
        t1 = clock()
        loss.backward()
        for p in params:
            p.grad = None
        t2 = clock()
        if step >= warmup:
            fwd.append((t1 - t0) / 1e3)
            bwd.append((t2 - t1) / 1e3)
    return fwd, bwd


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def _runner_loop(runner: Any, inputs: tuple[Any, ...], steps: int) -> list[float]:
    """Per-step microseconds of the graph run through ``runner`` directly (no shell/autograd)."""
    import torch

    clock = time.perf_counter_ns
    times = []
    for _ in range(steps):
        t0 = clock()
        outputs, state = runner.forward(inputs)
        runner.backward(state, [torch.ones_like(outputs[0]) / outputs[0].numel()], [])
        times.append((clock() - t0) / 1e3)
    return times


def _ortfx_with_runner(threads: int, batches: list[Any], warmup: int) -> tuple[Any, Any, Any]:
    """The ortfx model after warm-up, its training runner and one step's graph inputs."""
    from ortfx.runtime import events

    model, _ = make("ortfx", threads)
    with events.recording() as seen:
        loop(model, batches, 1, warmup)
    (runner,) = [args[1] for name, args in seen if name == "session" and args[0] == "training"]
    (x,), _ = batches[0]
    named = dict(model.named_parameters())
    inputs = tuple(
        x if spec.kind.name == "USER" else named[spec.source] for spec in runner.info.inputs
    )
    return model, runner, inputs


def run_mode(mode: str, steps: int, warmup: int, threads: int) -> dict[str, Any]:
    """One measurement in this process. ``mode``: eager, ortfx, runner."""
    import torch

    torch.set_num_threads(threads)
    if mode == "runner":
        _, make_batch = make("eager", threads)
        batches = [make_batch(i) for i in range(64)]
        _, runner, inputs = _ortfx_with_runner(threads, batches, warmup)
        times = _runner_loop(runner, inputs, steps)
        return {"mode": mode, "step_us": med(times), "fwd_us": 0.0, "bwd_us": 0.0}
    model, make_batch = make("eager" if mode == "eager" else "ortfx", threads)
    batches = [make_batch(i) for i in range(64)]
    loop(model, batches, 1, warmup)  # export and session creation happen here
    fwd, bwd = loop(model, batches, steps, 0)
    return {
        "mode": mode,
        "fwd_us": med(fwd),
        "bwd_us": med(bwd),
        "step_us": med([a + b for a, b in zip(fwd, bwd, strict=False)]),
        "mean_step_us": sum(fwd + bwd) / steps,
    }


def run_paired(steps: int, warmup: int, threads: int, block: int = 50) -> dict[str, Any]:
    """Eager, ortfx and its runner alone in one process, alternating blocks of ``block`` steps,
    so all see the same machine state; per-block medians, then the median over blocks."""
    import torch

    torch.set_num_threads(threads)
    eager, make_batch = make("eager", threads)
    batches = [make_batch(i) for i in range(64)]
    ortfx_model, runner, inputs = _ortfx_with_runner(threads, batches, warmup)
    loop(eager, batches, 1, warmup)
    e_blocks, o_blocks, r_blocks = [], [], []
    for b in range(max(1, steps // block)):
        for which in ("e", "o", "r") if b % 2 else ("r", "o", "e"):
            if which == "e":
                f, w = loop(eager, batches, block, 0)
                e_blocks.append(med([x + y for x, y in zip(f, w, strict=True)]))
            elif which == "o":
                f, w = loop(ortfx_model, batches, block, 0)
                o_blocks.append(med([x + y for x, y in zip(f, w, strict=True)]))
            else:
                r_blocks.append(med(_runner_loop(runner, inputs, block)))
    return {
        "mode": "paired",
        "eager_us": med(e_blocks),
        "ortfx_us": med(o_blocks),
        "ort_us": med(r_blocks),
        "overhead_us": med([o - r for o, r in zip(o_blocks, r_blocks, strict=True)]),
        "minus_eager_us": med([o - e for o, e in zip(o_blocks, e_blocks, strict=True)]),
    }


def in_subprocess(mode: str, ns: argparse.Namespace, tree: Any = None) -> dict[str, Any]:
    """One mode in a fresh process, of this checkout or of ``tree`` (another checkout: its
    ``ortfx`` and ``bench`` are imported, through ``PYTHONPATH`` and the working directory)."""
    import json
    import os
    import subprocess

    root = common.ROOT if tree is None else tree
    cmd = [sys.executable, "-m", "bench.overhead", "--_mode", mode, "--steps", str(ns.steps),
           "--warmup", str(ns.warmup), "--threads", str(ns.threads)]  # fmt: skip
    if ns.pin is not None:
        cmd += ["--pin", str(ns.pin)]
    env = {**common.thread_env(ns.threads), "PYTHONPATH": str(root)}
    env.pop("PYTHONSAFEPATH", None)
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True,
                         check=False)  # fmt: skip
    if out.returncode:
        raise SystemExit(f"{mode} ({root}) failed:\n{out.stderr[-3000:]}")
    found: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    found["ortfx_from"] = os.path.realpath(root)
    return found


def _commit(tree: Any) -> str:
    """The short commit a checkout is at (``+`` when its files differ from it)."""
    import subprocess

    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
        return out.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "?"
    return head + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def against(ns: argparse.Namespace) -> str:
    """This checkout against ``ns.against``, interleaved process by process (paired mode and
    the plain ortfx step, ``ns.repeats`` rounds, the order alternating each round)."""
    from pathlib import Path

    other = Path(ns.against).resolve()
    trees = {"this": None, "against": other}
    modes = ("paired", "ortfx")
    results: dict[tuple[str, str], list[dict[str, Any]]] = {
        (t, m): [] for t in trees for m in modes
    }
    for r in range(ns.repeats):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for m in modes:
            for t in order:
                res = in_subprocess(m, ns, trees[t])
                results[(t, m)].append(res)
                key = "overhead_us" if m == "paired" else "step_us"
                print(f"round {r} {t:8s} {m:7s} {key} {res[key]:.1f}", flush=True)

    def stat(t: str, m: str, key: str) -> float:
        return med([x[key] for x in results[(t, m)]])

    rows = [
        ("paired: ortfx step", "paired", "ortfx_us"),
        ("paired: runner alone (ORT + DLPack)", "paired", "ort_us"),
        ("paired: **ortfx - runner (the shell)**", "paired", "overhead_us"),
        ("paired: eager step", "paired", "eager_us"),
        ("ortfx step, own process", "ortfx", "step_us"),
        ("ortfx forward, own process", "ortfx", "fwd_us"),
        ("ortfx backward, own process", "ortfx", "bwd_us"),
    ]
    lines = [
        "",
        f"This checkout ({common.ROOT}, {_commit(common.ROOT)}) against {other} "
        f"({_commit(other)}), {ns.repeats} rounds, each a fresh "
        "process per tree and mode, interleaved (medians over rounds; us):",
        "",
        "| measurement | this | against | this - against |",
        "|---|---:|---:|---:|",
    ]
    for label, m, key in rows:
        a, b = stat("this", m, key), stat("against", m, key)
        lines.append(f"| {label} | {a:.1f} | {b:.1f} | {a - b:+.1f} |")
    shell = [
        x["overhead_us"] - y["overhead_us"]
        for x, y in zip(results[("this", "paired")], results[("against", "paired")], strict=True)
    ]
    lines += [
        "",
        f"Per round, this - against on the shell's overhead: "
        f"{', '.join(f'{d:+.1f}' for d in shell)} us "
        f"(this faster in {sum(d < 0 for d in shell)} of {len(shell)}).",
    ]
    return "\n".join(lines) + "\n"


def profile(ns: argparse.Namespace) -> str:
    """cProfile (own time) and pyinstrument over the ortfx step loop, in this process."""
    import torch

    torch.set_num_threads(ns.threads)
    model, make_batch = make("ortfx", ns.threads)
    batches = [make_batch(i) for i in range(64)]
    loop(model, batches, 1, ns.warmup)
    out = _io.StringIO()
    prof = cProfile.Profile()
    prof.enable()
    loop(model, batches, ns.steps, 0)
    prof.disable()
    stats = pstats.Stats(prof, stream=out)
    out.write(f"== cProfile, {ns.steps} steps, sorted by own time (tottime) ==\n")
    stats.sort_stats("tottime").print_stats(30)
    out.write("\n== cProfile, sorted by cumulative time ==\n")
    stats.sort_stats("cumulative").print_stats(40)
    try:
        from pyinstrument import Profiler
    except ImportError:
        out.write("\n(pyinstrument not installed: pip install pyinstrument)\n")
        return out.getvalue()
    p = Profiler(interval=0.0001)
    p.start()
    loop(model, batches, ns.steps, 0)
    p.stop()
    out.write("\n== pyinstrument ==\n")
    out.write(p.output_text(unicode=False, color=False, show_all=False))
    return out.getvalue()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pin", type=int, nargs="?", const=0, default=None)
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per mode")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--tag", default="")
    p.add_argument("--against", help="another checkout of ortfx to compare with, interleaved")
    p.add_argument("--_mode", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    common.pin(ns.pin)
    common.quiet()
    if ns._mode:
        import json

        if ns._mode == "paired":
            print(json.dumps(run_paired(ns.steps, ns.warmup, ns.threads)))
        else:
            print(json.dumps(run_mode(ns._mode, ns.steps, ns.warmup, ns.threads)))
        return
    mach = common.machine()
    command = " ".join(sys.argv[1:] if argv is None else argv)
    if ns.against:
        text = (
            f"# ortfx wrapper overhead against another checkout ({mach['date'][:10]})\n\n"
            f"Machine: {common.describe(mach)}\n\n"
            f"Command: `python -m bench.overhead {command}`\n\n"
            f"Model: Linear(16, 16), batch 4, loss = mean(square(y)); step = forward + backward "
            f"+ zero_grad; {ns.steps} steps after {ns.warmup} warm-up; {ns.threads} thread(s).\n"
            + against(ns)
        )
        stem = common.RESULTS / f"overhead-against-{ns.tag or common.stamp()}"
        common.RESULTS.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".md").write_text(text)
        print(text)
        return
    modes = ["eager", "ortfx", "runner", "paired"]
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(ns.repeats):
        for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
            res = in_subprocess(m, ns)
            results[m].append(res)
            if m == "paired":
                print(f"repeat {r} paired        eager {res['eager_us']:.1f} us, ortfx "
                      f"{res['ortfx_us']:.1f} us, runner alone {res['ort_us']:.1f} us",
                      flush=True)  # fmt: skip
                continue
            print(f"repeat {r} {m:13s} step {res['step_us']:8.1f} us", flush=True)

    def stat(m: str, key: str) -> float:
        return med([x[key] for x in results[m]])

    clean = stat("ortfx", "step_us")
    eager = stat("eager", "step_us")
    runner = stat("runner", "step_us")
    lines = [
        f"# ortfx wrapper overhead ({mach['date'][:10]})",
        "",
        f"Machine: {common.describe(mach)}",
        "",
        f"Command: `python -m bench.overhead {' '.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        f"Model: Linear(16, 16), batch 4, loss = mean(square(y)); step = forward + backward + "
        f"zero_grad (no optimizer); {ns.steps} steps after {ns.warmup} warm-up, median per step, "
        f"median over {ns.repeats} fresh processes; {ns.threads} thread(s).",
        "",
        "| measurement | forward us | backward us | step us |",
        "|---|---:|---:|---:|",
        f"| eager PyTorch | {stat('eager', 'fwd_us'):.1f} | {stat('eager', 'bwd_us'):.1f} "
        f"| {eager:.1f} |",
        f"| ortfx | {stat('ortfx', 'fwd_us'):.1f} | {stat('ortfx', 'bwd_us'):.1f} | {clean:.1f} |",
        f"| the graph through its runner alone (ORT + DLPack) | | | {runner:.1f} |",
        f"| **shell + autograd overhead = ortfx - runner** | | | **{clean - runner:.1f}** |",
        f"| ortfx - eager | | | {clean - eager:.1f} |",
        "",
        "Paired (eager, ortfx and the runner alone in one process, alternating blocks of 50 "
        "steps; robust to a noisy machine; median over blocks, then over processes):",
        "",
        "| eager us | ortfx us | runner us | ortfx - runner us | ortfx - eager us |",
        "|---:|---:|---:|---:|---:|",
        f"| {stat('paired', 'eager_us'):.1f} | {stat('paired', 'ortfx_us'):.1f} "
        f"| {stat('paired', 'ort_us'):.1f} | {stat('paired', 'overhead_us'):.1f} "
        f"| {stat('paired', 'minus_eager_us'):.1f} |",
    ]
    text = "\n".join(lines) + "\n"
    stem = common.RESULTS / f"overhead-{ns.tag or common.stamp()}"
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    if ns.profile:
        prof = profile(ns)
        stem.with_suffix(".txt").write_text(prof)
        text += f"\nProfiles: `{stem.with_suffix('.txt').name}`\n"
    stem.with_suffix(".md").write_text(text)
    print()
    print(text)


if __name__ == "__main__":
    main()
