"""Wrapper overhead of ortfx on a model where overhead dominates (Linear(16, 16), batch 4).

    python -m bench.overhead [--steps 3000] [--threads 1] [--profile]

Measures, per training step (forward + ``loss.backward()`` + ``zero_grad``; no optimizer):

1. eager PyTorch, for reference;
2. ortfx, uninstrumented;
3. ortfx with only ORT's own run timed (``TrainingAgent.run_forward`` / ``run_backward``
   through a proxy on the runner's ``agent``): the difference to (2) is ortfx's Python
   overhead, i.e. what the wrapper costs on top of ONNX Runtime itself;
4. ortfx with every stage wrapped in a timer (flatten, check_leaves, schema, track, decide,
   lookup, apply, construct_inputs, RunORT.apply / forward / backward, DLPack in/out, ORT run,
   restore), reported inclusive and as an exclusive breakdown; each timer adds ~0.3 us;
5. ``--profile``: cProfile top functions by own time, and a pyinstrument tree if installed.

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
import types
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from bench import common

TIMES: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # label -> [ns, calls]


def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    clock = time.perf_counter_ns
    slot = TIMES[label]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            slot[0] += clock() - t
            slot[1] += 1

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


class TimedAgent:
    """Stands in for the runner's ``TrainingAgent``: times ORT's own forward and backward."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.run_forward = timed("ort.run_forward", agent.run_forward)
        self.run_backward = timed("ort.run_backward", agent.run_backward)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


def patch_agent() -> None:
    from ortfx.runtime import session

    original = session.TrainingRunner.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.agent = TimedAgent(self.agent)

    session.TrainingRunner.__init__ = __init__  # type: ignore[method-assign]


def patch_stages() -> list[str]:
    """Wrap each stage of ortfx's call path in a timer; returns the names it could not find."""
    from ortfx import io, model_info, transitions
    from ortfx.runtime import autograd, module, session

    missing: list[str] = []

    def wrap(owner: Any, attr: str, label: str, kind: str = "plain") -> None:
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if raw is None:
            missing.append(f"{getattr(owner, '__name__', owner)}.{attr}")
            return
        if kind == "static":
            setattr(owner, attr, staticmethod(timed(label, raw.__func__)))
        elif kind == "class":
            setattr(owner, attr, classmethod(timed(label, raw.__func__)))
        else:
            setattr(owner, attr, timed(label, raw))

    wrap(module.ORTModule, "_ortfx_forward", "_ortfx_forward")
    wrap(io, "call_tree", "flatten")
    wrap(io, "flatten", "flatten")
    wrap(io, "check_leaves", "check_leaves")
    wrap(module.ModelSchema, "from_flat", "schema", "class")
    wrap(module.ORTModule, "_ortfx_tracked_now", "track")
    wrap(module, "_check_input_devices", "check_devices")
    wrap(module, "decide", "decide")
    wrap(transitions.ExportState, "lookup", "lookup")
    wrap(module, "apply", "apply")
    wrap(model_info.PostExportProcessedModelInfo, "construct_inputs_flat", "construct_inputs")
    wrap(model_info.PostExportProcessedModelInfo, "restore_outputs", "restore")
    wrap(autograd.RunORT, "forward", "RunORT.forward", "static")
    wrap(autograd.RunORT, "backward", "RunORT.backward", "static")
    real_apply = module.RunORT.apply
    module.RunORT = types.SimpleNamespace(apply=timed("RunORT.apply", real_apply))  # type: ignore[attr-defined]
    wrap(session.TrainingRunner, "forward", "runner.forward")
    wrap(session.TrainingRunner, "backward", "runner.backward")
    wrap(session, "_to_ort", "dlpack_in")
    wrap(session, "_to_torch", "dlpack_out")
    patch_agent()
    return missing


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


def run_mode(mode: str, steps: int, warmup: int, threads: int) -> dict[str, Any]:
    """One measurement in this process. ``mode``: eager, ortfx, ortfx+agent, ortfx+stages."""
    import torch

    torch.set_num_threads(threads)
    missing: list[str] = []
    if mode == "ortfx+agent":
        patch_agent()
    elif mode == "ortfx+stages":
        missing = patch_stages()
    model, make_batch = make("eager" if mode == "eager" else "ortfx", threads)
    batches = [make_batch(i) for i in range(64)]
    loop(model, batches, 1, warmup)  # export and session creation happen here
    for slot in TIMES.values():  # the timers hold their slots: reset in place
        slot[0] = slot[1] = 0
    fwd, bwd = loop(model, batches, steps, 0)
    return {
        "mode": mode,
        "fwd_us": med(fwd),
        "bwd_us": med(bwd),
        "step_us": med([a + b for a, b in zip(fwd, bwd, strict=False)]),
        "mean_step_us": sum(fwd + bwd) / steps,
        "times": {k: (v[0] / 1e3 / steps, v[1] / steps) for k, v in TIMES.items()},
        "missing": missing,
    }


def run_paired(steps: int, warmup: int, threads: int, block: int = 50) -> dict[str, Any]:
    """Eager and ortfx (ORT run timed) in one process, alternating blocks of ``block`` steps, so
    both see the same machine state; per-block medians, then the median over blocks."""
    import torch

    torch.set_num_threads(threads)
    patch_agent()
    eager, make_batch = make("eager", threads)
    ortfx_model, _ = make("ortfx", threads)
    batches = [make_batch(i) for i in range(64)]
    loop(eager, batches, 1, warmup)
    loop(ortfx_model, batches, 1, warmup)
    e_blocks, o_blocks, ort_blocks = [], [], []
    for b in range(max(1, steps // block)):
        for which in ("e", "o") if b % 2 else ("o", "e"):
            if which == "e":
                f, w = loop(eager, batches, block, 0)
                e_blocks.append(med([x + y for x, y in zip(f, w, strict=True)]))
            else:
                for slot in TIMES.values():
                    slot[0] = slot[1] = 0
                f, w = loop(ortfx_model, batches, block, 0)
                o_blocks.append(med([x + y for x, y in zip(f, w, strict=True)]))
                ort_ns = TIMES["ort.run_forward"][0] + TIMES["ort.run_backward"][0]
                ort_blocks.append(ort_ns / 1e3 / block)
    return {
        "mode": "paired",
        "eager_us": med(e_blocks),
        "ortfx_us": med(o_blocks),
        "ort_us": med(ort_blocks),
        "overhead_us": med([o - r for o, r in zip(o_blocks, ort_blocks, strict=True)]),
        "minus_eager_us": med([o - e for o, e in zip(o_blocks, e_blocks, strict=True)]),
    }


def in_subprocess(mode: str, ns: argparse.Namespace) -> dict[str, Any]:
    import json
    import subprocess

    cmd = [sys.executable, "-m", "bench.overhead", "--_mode", mode, "--steps", str(ns.steps),
           "--warmup", str(ns.warmup), "--threads", str(ns.threads)]  # fmt: skip
    if ns.pin is not None:
        cmd += ["--pin", str(ns.pin)]
    out = subprocess.run(cmd, env=common.thread_env(ns.threads), cwd=common.ROOT,
                         capture_output=True, text=True, check=False)  # fmt: skip
    if out.returncode:
        raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def breakdown(t: dict[str, tuple[float, float]]) -> list[tuple[str, float]]:
    """Exclusive microseconds per step from the inclusive timers (nesting known from the code)."""

    def g(k: str) -> float:
        return t.get(k, (0.0, 0.0))[0]

    ort = g("ort.run_forward") + g("ort.run_backward")
    rows = [
        ("ORT TrainingAgent.run_forward", g("ort.run_forward")),
        ("ORT TrainingAgent.run_backward", g("ort.run_backward")),
        ("DLPack in (_to_ort, per tensor)", g("dlpack_in")),
        ("DLPack out (_to_torch)", g("dlpack_out")),
        (
            "runner.forward/backward rest (OrtValueVector, run state, grads for None)",
            g("runner.forward") + g("runner.backward") - ort - g("dlpack_in") - g("dlpack_out"),
        ),
        (
            "RunORT.forward body (ctx, save_for_backward, marks)",
            g("RunORT.forward") - g("runner.forward"),
        ),
        ("RunORT.backward body (result tuple)", g("RunORT.backward") - g("runner.backward")),
        ("autograd.Function.apply machinery", g("RunORT.apply") - g("RunORT.forward")),
        ("flatten (call_tree + optree flatten)", g("flatten")),
        ("check_leaves", g("check_leaves")),
        ("schema (ModelSchema.from_flat)", g("schema")),
        ("track params + check devices", g("track") + g("check_devices")),
        ("decide", g("decide")),
        ("state.lookup", g("lookup")),
        ("apply (new state)", g("apply")),
        ("construct_inputs", g("construct_inputs")),
        ("restore_outputs", g("restore")),
    ]
    accounted = sum(
        g(k) for k in ("flatten", "check_leaves", "schema", "track", "check_devices", "decide",
                       "lookup", "apply", "construct_inputs", "restore", "RunORT.apply")
    )  # fmt: skip
    rows.append(("_ortfx_forward rest (inline code: fast-path key, Call build, bookkeeping)",
                 g("_ortfx_forward") - accounted))  # fmt: skip
    return rows


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
    modes = ["eager", "ortfx", "ortfx+agent", "ortfx+stages", "paired"]
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(ns.repeats):
        for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
            res = in_subprocess(m, ns)
            results[m].append(res)
            if m == "paired":
                print(f"repeat {r} paired        eager {res['eager_us']:.1f} us, ortfx "
                      f"{res['ortfx_us']:.1f} us, ORT run {res['ort_us']:.1f} us",
                      flush=True)  # fmt: skip
                continue
            print(f"repeat {r} {m:13s} step {res['step_us']:8.1f} us (fwd {res['fwd_us']:.1f}, "
                  f"bwd {res['bwd_us']:.1f})", flush=True)  # fmt: skip

    def stat(m: str, key: str) -> float:
        return med([x[key] for x in results[m]])

    agent_ort = med([x["times"]["ort.run_forward"][0] + x["times"]["ort.run_backward"][0]
                     for x in results["ortfx+agent"]])  # fmt: skip
    ort_fwd = med([x["times"]["ort.run_forward"][0] for x in results["ortfx+agent"]])
    ort_bwd = med([x["times"]["ort.run_backward"][0] for x in results["ortfx+agent"]])
    clean = stat("ortfx", "step_us")
    eager = stat("eager", "step_us")
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
        f"| ortfx (uninstrumented) | {stat('ortfx', 'fwd_us'):.1f} "
        f"| {stat('ortfx', 'bwd_us'):.1f} | {clean:.1f} |",
        f"| ORT's own run (TrainingAgent.run_forward / run_backward) | {ort_fwd:.1f} "
        f"| {ort_bwd:.1f} | {agent_ort:.1f} |",
        f"| **ortfx Python overhead = ortfx - ORT run** | {stat('ortfx', 'fwd_us') - ort_fwd:.1f} "
        f"| {stat('ortfx', 'bwd_us') - ort_bwd:.1f} | **{clean - agent_ort:.1f}** |",
        f"| ortfx - eager | | | {clean - eager:.1f} |",
        "",
        "Paired (eager and ortfx in one process, alternating blocks of 50 steps; robust to a "
        "noisy machine; median over blocks, then over processes):",
        "",
        "| eager us | ortfx us | ORT run us | ortfx - ORT run us | ortfx - eager us |",
        "|---:|---:|---:|---:|---:|",
        f"| {stat('paired', 'eager_us'):.1f} | {stat('paired', 'ortfx_us'):.1f} "
        f"| {stat('paired', 'ort_us'):.1f} | {stat('paired', 'overhead_us'):.1f} "
        f"| {stat('paired', 'minus_eager_us'):.1f} |",
        "",
        "Breakdown (every stage timed; exclusive us per step, mean over steps; the timers "
        f"themselves inflate the total to {stat('ortfx+stages', 'mean_step_us'):.1f} us):",
        "",
        "| stage | us/step | share |",
        "|---|---:|---:|",
    ]
    rows = [(name, med([dict(breakdown(x["times"]))[name] for x in results["ortfx+stages"]]))
            for name, _ in breakdown(results["ortfx+stages"][0]["times"])]  # fmt: skip
    total = stat("ortfx+stages", "mean_step_us")
    accounted = sum(v for _, v in rows)
    rows.append(("outside (nn.Module.__call__, autograd engine, grad accumulation, zero_grad)",
                 total - accounted))  # fmt: skip
    for name, v in sorted(rows, key=lambda r: -r[1]):
        lines.append(f"| {name} | {v:.1f} | {100 * v / total:.0f}% |")
    missing = results["ortfx+stages"][0]["missing"]
    if missing:
        lines += ["", f"Not found (not timed): {', '.join(missing)}"]
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
