"""Memory-efficient gradients and optimizer-in-backward: peak step memory and step time.

    python -m bench.mem_grad            # the full run (about 15 minutes on 2 shared cores)
    python -m bench.mem_grad --pairs 20 # step-time ratios of PAIRS, trained side by side
    python -m bench.mem_grad --quick    # a few-second smoke run, in this process, into --out-dir

Configurations (``CONFIGS``): eager PyTorch and ortfx, each with a plain AdamW step after
``backward()`` or with the optimizer fused into backward (``+oib``: PyTorch's tutorial pattern,
one AdamW per parameter stepped in ``register_post_accumulate_grad_hook``, then
``p.grad = None``); ortfx in its default mode or with
``Options(enable_mem_efficient_grad_management=True)`` (``mem``). ``ortfx+oib`` is the control:
the same hooks without the option run only after ORT has returned every gradient.

Each (model, round, configuration) runs in a fresh subprocess with one thread,
``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0`` (as ``bench.memory``: RSS follows what
is live) and, for ortfx, ORT's CPU arena off (``Options(cpu_mem_arena=False)``; with the arena on,
RSS keeps the first step's high-water mark). Per measured step:

* ``growth``: the step's peak RSS (VmHWM, reset through ``/proc/self/clear_refs``) minus the RSS
  just before the step: gradients, activations, optimizer temporaries;
* ``footprint``: the peak RSS over the measured steps minus the RSS after building the model;
* step time: forward, loss, backward, optimizer step, ``zero_grad``.

One extra step counts gradient bytes through ``Tensor.register_hook`` (the hooks are removed
after it): at every gradient's arrival, the bytes of the ``.grad`` tensors alive plus the
arriving one. ``peak_grad_mb`` is the largest such sum: what torch holds as ``.grad`` at once
(ORT's own buffers are not in it; RSS sees them).

Rounds rotate the configuration order. Memory repeats to within a few MB between rounds; step
times do not (the machine is shared), so the tables give the *minimum* over rounds of each
process's median step time, and ratios against eager are those minima's ratios; the per-round
ratios (each against eager of the same round) are in the JSON lines. Separate processes cannot
resolve a 5 % difference on a shared machine: ``--pairs N`` instead trains both configurations of
each pair in ``PAIRS`` in one process, steps interleaved, and gives the median per-pair ratio
(``mem_grad-paired-<date>.{jsonl,md}``).
Results: ``bench/results/mem_grad-<date>.{jsonl,md}`` and the worker log ``mem_grad-<date>.log``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.memory import MALLOC_ENV, _hwm_mb, _reset_hwm, _rss_mb

N_LOSSES = 5
LR = 1e-4

# name -> (backend, memory-efficient gradients, optimizer in backward)
CONFIGS: dict[str, tuple[str, bool, bool]] = {
    "eager": ("eager", False, False),
    "eager+oib": ("eager", False, True),
    "ortfx": ("ortfx", False, False),
    "ortfx+oib": ("ortfx", False, True),
    "ortfx+mem": ("ortfx", True, False),
    "ortfx+mem+oib": ("ortfx", True, True),
    # The memory moonshot (issue 31): the above with layer-wise recompute (memory_opt_level 1)
    # and each parameter's AdamW fused (torch's CPU kernel: no temporaries of the parameter's
    # size, measured 294 MB and 274 ms against 0 MB and 32 ms for GPT-2's 50257 x 768 table).
    "ortfx+rc1+mem+oib": ("ortfx", True, True),
}
RECOMPUTE = {"ortfx+rc1+mem+oib": 1}
FUSED = {"ortfx+rc1+mem+oib"}

# name -> (bench.models builder, its kwargs, warm-up steps, measured steps)
MODELS: dict[str, tuple[str, dict[str, Any], int, int]] = {
    # The GPT-2 (4 layers, d 256, vocab 8192) at a batch where its 20 MB of gradients
    # are a large share of the step's memory...
    "gpt2-4x256-b4-s64": (
        "gpt2",
        {"n_layer": 4, "n_embd": 256, "n_head": 4, "batch": 4, "seq": 64},
        2,
        8,
    ),
    # ... and at bench.memory's batch, where activations dominate.
    "gpt2-4x256-b16-s128": (
        "gpt2",
        {"n_layer": 4, "n_embd": 256, "n_head": 4, "batch": 16, "seq": 128},
        2,
        4,
    ),
    # A wide MLP: 38 M parameters, 144 MB of gradients, small activations.
    "mlp-4096x3-b64": ("mlp", {"batch": 64, "sizes": (1024, 4096, 4096, 4096, 10)}, 2, 6),
}
# Run only when named (``--models``): the memory moonshot's models (issue 31), the benchmark
# GPT-2-like model at bench.compare's batch and GPT-2 small.
SCALE: dict[str, tuple[str, dict[str, Any], int, int]] = {
    "gpt2-4x256-b8-s128": ("gpt2", {"batch": 8, "seq": 128}, 2, 4),
    "gpt2-124m-b2-s128": (
        "gpt2",
        {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab": 50257, "batch": 2, "seq": 128},
        2,
        3,
    ),
}
QUICK_MODEL = ("mlp", {"batch": 8, "sizes": (32, 64, 64, 10)}, 1, 2)


# ---- worker ---------------------------------------------------------------------------------


def _optimizer_in_backward(params: list[Any], fused: bool = False) -> list[Any]:
    """One AdamW per parameter, stepped as its gradient is accumulated; the gradient dropped."""
    import torch

    optimizers = {
        p: torch.optim.AdamW([p], lr=LR, foreach=False, fused=fused or None) for p in params
    }

    def step(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    for p in params:
        p.register_post_accumulate_grad_hook(step)
    return list(optimizers.values())


class GradBytes:
    """Counts the bytes of ``.grad`` tensors alive each time a gradient arrives."""

    def __init__(self, params: list[Any]) -> None:
        self.params = params
        self.peak = 0
        self.arrivals = 0
        self.handles = [p.register_hook(self._arrive(p)) for p in params]

    def _arrive(self, p: Any) -> Any:
        def hook(grad: Any) -> None:
            alive = sum(q.grad.nbytes for q in self.params if q.grad is not None and q is not p)
            held = p.grad.nbytes if p.grad is not None else 0
            # Before accumulation: p's old .grad (if any) and the arriving gradient both exist.
            self.peak = max(self.peak, alive + held + grad.nbytes)
            self.arrivals += 1

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def build(model_name: str, seed: int) -> tuple[Any, Any, Any, int, int]:
    from bench import models

    builder, kw, warmup, steps = (
        QUICK_MODEL if model_name == "quick" else {**MODELS, **SCALE}[model_name]
    )
    model, make_batch, loss_fn = getattr(models, builder)(seed, **kw)
    return model, make_batch, loss_fn, warmup, steps


def trainer(model_name: str, config: str, seed: int) -> tuple[Any, list[Any], Any, int, int]:
    """``(step(i) -> loss, trainable parameters, module called, warm-up steps, measured steps)``."""
    import torch

    backend, mem, oib = CONFIGS[config]
    torch.manual_seed(seed)
    model, make_batch, loss_fn, warmup, steps = build(model_name, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    wrapped: Any = model
    if backend == "ortfx":
        import ortfx

        wrapped = ortfx.ORTModule(
            model,
            options=ortfx.Options(
                enable_mem_efficient_grad_management=mem,
                intra_op_threads=1,
                cpu_mem_arena=False,
                memory_opt_level=RECOMPUTE.get(config, 0),
            ),
        )
    optimizer = None if oib else torch.optim.AdamW(params, lr=LR, foreach=False)
    if oib:
        _optimizer_in_backward(params, fused=config in FUSED)

    def step(i: int) -> float:
        args, kwargs = make_batch(i)
        loss = loss_fn(wrapped(*args, **kwargs))
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())
        del loss
        return value

    return step, params, wrapped, warmup, steps


def measure(model_name: str, config: str, seed: int, steps: int = 0) -> dict[str, Any]:
    import torch

    backend, mem, oib = CONFIGS[config]
    torch.set_num_threads(1)
    step, params, wrapped, warmup, default_steps = trainer(model_name, config, seed)
    steps = steps or default_steps
    rss_after_build = _rss_mb()

    losses: list[float] = []
    times: list[float] = []
    growth: list[float] = []
    peaks: list[float] = []
    hwm_ok = True
    for i in range(warmup + steps):
        rss0 = _rss_mb()
        hwm_ok = _reset_hwm() and hwm_ok
        t0 = time.perf_counter()
        losses.append(step(i))
        dt = time.perf_counter() - t0
        peak = _hwm_mb()
        if i >= warmup:
            times.append(dt)
            peaks.append(peak)
            growth.append(peak - rss0)
    counter = GradBytes(params)
    losses.append(step(warmup + steps))
    counter.remove()
    result: dict[str, Any] = {
        "model": model_name,
        "config": config,
        "backend": backend,
        "mem_efficient": mem,
        "optimizer_in_backward": oib,
        "params": sum(p.numel() for p in params),
        "grad_mb": sum(p.nbytes for p in params) / 2**20,
        "hwm_reset_works": hwm_ok,
        "rss_after_build_mb": rss_after_build,
        "growth_mb": growth,
        "footprint_mb": max(peaks) - rss_after_build,
        "peak_rss_mb": max(peaks),
        "step_times_s": times,
        "peak_grad_mb": counter.peak / 2**20,
        "grad_arrivals": counter.arrivals,
        "grads_left": sum(p.grad is not None for p in params),
        "losses": losses[:N_LOSSES],
    }
    if backend == "ortfx":
        import ortfx

        s = ortfx.stats(wrapped)
        result["ortfx_stats"] = {"calls": s.calls, "exports": s.exports, "fallback": s.fallback}
    return result


def paired(model_name: str, a: str, b: str, seed: int, pairs: int) -> dict[str, Any]:
    """Step times of ``a`` and ``b`` trained side by side in one process, steps interleaved
    (a, b then b, a): load from other processes hits both alike. ``ratio``: the median of the
    per-pair ratios b / a."""
    import torch

    torch.set_num_threads(1)
    step_a, _, _, warmup, _ = trainer(model_name, a, seed)
    step_b, _, _, _, _ = trainer(model_name, b, seed)
    for i in range(warmup):
        step_a(i)
        step_b(i)
    times: dict[str, list[float]] = {a: [], b: []}
    for i in range(warmup, warmup + pairs):
        order = [(a, step_a), (b, step_b)]
        for name, step in order if i % 2 else order[::-1]:
            t0 = time.perf_counter()
            step(i)
            times[name].append(time.perf_counter() - t0)
    ratios = [tb / ta for ta, tb in zip(times[a], times[b], strict=True)]
    q1, _, q3 = statistics.quantiles(ratios)
    return {
        "model": model_name,
        "a": a,
        "b": b,
        "pairs": pairs,
        "step_s": {k: common.median(v) for k, v in times.items()},
        "ratio": common.median(ratios),
        "ratio_q1_q3": [q1, q3],
    }


def failed(model: str, config: str, error: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "config": config, "ok": False, "error": error, **extra}


def worker(ns: argparse.Namespace) -> None:
    common.quiet()
    try:
        if ns.paired_with:
            record = paired(ns.model, ns.config, ns.paired_with, ns.seed, ns.pairs)
        else:
            record = measure(ns.model, ns.config, ns.seed, ns.steps)
        result = {**record, "ok": True}
    except BaseException as e:  # a failing configuration is a result
        import traceback

        result = failed(
            ns.model, ns.config, f"{type(e).__name__}: {str(e)[:2000]}",
            traceback=traceback.format_exc()[-4000:],
        )  # fmt: skip
    Path(ns.out).write_text(json.dumps(result))


# ---- parent ---------------------------------------------------------------------------------


def run_one(
    model: str, config: str, ns: argparse.Namespace, log: Path, paired_with: str = ""
) -> dict[str, Any]:
    if ns.quick:  # in this process: no RSS numbers worth keeping, only the records' shape
        try:
            return {**measure(model, config, ns.seed, ns.steps), "ok": True}
        except Exception as e:
            return failed(model, config, f"{type(e).__name__}: {e}")
    env = common.thread_env(1)
    env.update(MALLOC_ENV)
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [
        sys.executable, "-m", "bench.mem_grad", "--worker", "--model", model, "--config", config,
        "--steps", str(ns.steps), "--seed", str(ns.seed), "--out", out,
        "--pairs", str(ns.pairs), "--paired-with", paired_with,
    ]  # fmt: skip
    try:
        with log.open("a") as logf:
            logf.write(f"\n==== {model} {config} {paired_with} ====\n")
            logf.flush()
            proc = subprocess.run(
                cmd, env=env, cwd=common.ROOT, stdout=logf, stderr=logf, timeout=ns.timeout
            )
        text = Path(out).read_text()
        if text:
            return json.loads(text)  # type: ignore[no-any-return]
        return failed(model, config, f"worker exited with {proc.returncode}, see {log.name}")
    except subprocess.TimeoutExpired:
        return failed(model, config, "timeout")
    finally:
        Path(out).unlink(missing_ok=True)


def _med(xs: list[float]) -> float:
    return common.median([x for x in xs if x == x])


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, configuration): medians over rounds for memory, minima for time."""
    rows = []
    for model in dict.fromkeys(r["model"] for r in records):
        mine = [r for r in records if r["model"] == model]
        by = {(r["round"], r["config"]): r for r in mine if r["ok"]}
        step_min: dict[str, float] = {}
        for config in dict.fromkeys(r["config"] for r in mine):
            runs = [r for r in mine if r["config"] == config]
            ok = [r for r in runs if r["ok"]]
            row: dict[str, Any] = {"model": model, "config": config, "runs": len(runs)}
            row["ok"] = len(ok)
            if not ok:
                row["error"] = runs[0].get("error", "?")
                rows.append(row)
                continue
            per_round = [_med(r["step_times_s"]) for r in ok]
            step_min[config] = min(per_round)
            loss_diffs, round_ratios = [], []
            for r in ok:
                e = by.get((r["round"], "eager"))
                if e is not None:
                    loss_diffs.append(
                        max(abs(a - b) for a, b in zip(r["losses"], e["losses"], strict=True))
                    )
                    round_ratios.append(_med(r["step_times_s"]) / _med(e["step_times_s"]))
            row.update(
                params=ok[0]["params"],
                grad_mb=ok[0]["grad_mb"],
                growth_mb=_med([_med(r["growth_mb"]) for r in ok]),
                growth_spread_mb=max(max(r["growth_mb"]) - min(r["growth_mb"]) for r in ok),
                footprint_mb=_med([r["footprint_mb"] for r in ok]),
                peak_rss_mb=_med([r["peak_rss_mb"] for r in ok]),
                peak_grad_mb=max(r["peak_grad_mb"] for r in ok),
                grads_left=max(r["grads_left"] for r in ok),
                step_s_min=step_min[config],
                step_s_per_round=per_round,
                vs_eager_per_round=round_ratios,
                loss_diff=max(loss_diffs) if loss_diffs else float("nan"),
            )
            rows.append(row)
        for row in rows:
            if row["model"] == model and row["ok"] and "eager" in step_min:
                row["step_vs_eager"] = row["step_s_min"] / step_min["eager"]
    return rows


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets for ortfx+mem+oib (issue 14) and the memory moonshot (issue 31)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        get = {r["config"]: r for r in rows if r["model"] == model and r.get("ok")}
        moon, eager = get.get("ortfx+rc1+mem+oib"), get.get("eager")
        if moon is not None and eager is not None and eager["growth_mb"] < 1:
            out.append(f"- {model}: memory moonshot: eager's step grows < 1 MB, not measurable")
        elif moon is not None and eager is not None:
            ratio = moon["growth_mb"] / eager["growth_mb"]
            out.append(
                f"- {model}: memory moonshot (recompute 1 + memory-efficient gradients + "
                f"optimizer in backward): peak step growth {moon['growth_mb']:.0f} MB vs eager's "
                f"{eager['growth_mb']:.0f} MB = **{ratio:.2f}x** (target <= 0.5) -> "
                f"**{'MET' if ratio <= 0.5 else 'NOT MET'}**; footprint "
                f"{moon['footprint_mb']:.0f} vs {eager['footprint_mb']:.0f} MB; step "
                f"{moon['step_s_min']:.3f} s vs {eager['step_s_min']:.3f} s = "
                f"{moon['step_s_min'] / eager['step_s_min']:.2f}x eager"
            )
        best, base, eager_oib = get.get("ortfx+mem+oib"), get.get("ortfx"), get.get("eager+oib")
        if best is None or base is None or eager_oib is None:
            out.append(f"- {model}: not measured (ortfx+mem+oib, ortfx or eager+oib failed)")
            continue
        saved = base["growth_mb"] - best["growth_mb"]
        slower = best["step_s_min"] / base["step_s_min"]
        out += [
            f"- {model}: peak step growth {best['growth_mb']:.0f} MB vs {base['growth_mb']:.0f} "
            f"MB in the default mode: **{saved:.0f} MB saved**, gradients are "
            f"{best['grad_mb']:.0f} MB -> **{'MET' if saved >= best['grad_mb'] else 'NOT MET'}**",
            f"- {model}: against eager+oib ({eager_oib['growth_mb']:.0f} MB): "
            f"{best['growth_mb'] - eager_oib['growth_mb']:+.0f} MB -> "
            f"**{'MET' if best['growth_mb'] <= eager_oib['growth_mb'] + 2 else 'NOT MET'}** "
            "(2 MB measurement slack)",
            f"- {model}: step time {best['step_s_min']:.3f} s vs {base['step_s_min']:.3f} s "
            f"(min over rounds) = **{slower:.3f}x** (target <= 1.05) -> "
            f"**{'MET' if slower <= 1.05 else 'NOT MET'}**",
        ]
    return out


def markdown(rows: list[dict[str, Any]], ns: argparse.Namespace, mach: dict[str, Any]) -> str:
    lines = [
        f"# Memory-efficient gradients and optimizer in backward ({mach['date'][:10]})",
        "",
        f"Machine: {common.describe(mach)}",
        "",
        f"Command: `{ns.command}`",
        "",
        f"{ns.rounds} rounds, configuration order rotated per round, a fresh process per run, "
        f"{' '.join(f'{k}={v}' for k, v in MALLOC_ENV.items())}, 1 thread, AdamW "
        f"(lr {LR}, foreach=False), ORT CPU arena off. Method: `bench/mem_grad.py`'s docstring.",
        "",
        "- **growth**: peak RSS of the step (VmHWM reset before it) - RSS before it; median "
        "over steps, then over rounds.",
        "- **footprint**: peak RSS over the measured steps - RSS after building the model.",
        "- **peak .grad**: the most gradient bytes torch held as `.grad` at once (hooks).",
        "- **step s**: the minimum over rounds of each process's median step time (the machine "
        "is shared); **vs eager**: ratio of those minima; **per round**: each round's ratio "
        "against eager of the same round.",
        "- **loss diff**: max |loss - eager loss| over the first steps, same round.",
        "",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        first = next((r for r in rows if r["model"] == model and r.get("ok")), None)
        head = (
            f"{first['params'] / 1e6:.1f} M parameters, {first['grad_mb']:.0f} MB of gradients"
            if first
            else "no run succeeded"
        )
        lines += [
            f"## {model} ({head})",
            "",
            "| config | growth MB | footprint MB | peak RSS MB | peak .grad MB | step s | "
            "vs eager | per round | loss diff |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
        for r in rows:
            if r["model"] != model:
                continue
            if not r.get("ok"):
                lines.append(f"| {r['config']} | failed: {r.get('error', '?')[:150]} ||||||||")
                continue
            per_round = ", ".join(f"{x:.2f}" for x in r["vs_eager_per_round"])
            lines.append(
                f"| {r['config']} | {r['growth_mb']:.0f} | {r['footprint_mb']:.0f} | "
                f"{r['peak_rss_mb']:.0f} | {r['peak_grad_mb']:.1f} | {r['step_s_min']:.3f} | "
                f"{r.get('step_vs_eager', float('nan')):.2f} | {per_round} | "
                f"{r['loss_diff']:.1e} |"
            )
        lines.append("")
    lines += [
        "## Targets (issue 14): ortfx+mem+oib saves at least the gradients' size against the "
        "default mode, is no worse than eager+oib, and at most 5 % slower per step",
        "",
        *verdicts(rows),
    ]
    return "\n".join(lines) + "\n"


# (a, b): b's step time over a's. The last two separate the cost of memory-efficient gradients
# from that of the optimizer-in-backward pattern itself (one optimizer per parameter).
PAIRS = [
    ("ortfx", "ortfx+mem"),
    ("ortfx", "ortfx+mem+oib"),
    ("ortfx+oib", "ortfx+mem+oib"),
    ("eager", "eager+oib"),
]


def _chosen_pairs(spec: str) -> list[tuple[str, str]]:
    if spec == "all":
        return PAIRS
    chosen = [tuple(item.split(":", 1)) for item in spec.split(",")]
    for pair in chosen:
        if pair not in PAIRS:
            raise SystemExit(f"unknown pair {':'.join(pair)!r}; choose from all, {_pair_names()}")
    return chosen  # type: ignore[return-value]


def _pair_names() -> str:
    return ", ".join(f"{a}:{b}" for a, b in PAIRS)


def parent_paired(ns: argparse.Namespace, models: list[str]) -> Path:
    """Step-time ratios of ``PAIRS`` from side-by-side training in one process per pair."""
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    stem = common.RESULTS / f"mem_grad-paired-{ns.tag or _dt.date.today().strftime('%Y%m%d')}"
    log = stem.with_suffix(".log")
    log.write_text("")
    mach = common.machine()
    lines = [
        f"# Memory-efficient gradients: paired step times ({mach['date'][:10]})",
        "",
        f"Machine: {common.describe(mach)}",
        "",
        f"Command: `{ns.command}`",
        "",
        "Both configurations train side by side in one process (1 thread, ORT arena off), "
        f"steps interleaved a,b / b,a, {ns.pairs} pairs after the warm-up; ratio: median of the "
        "per-pair ratios b / a, with the quartiles.",
        "",
        "| model | a | b | step a s | step b s | b / a | quartiles |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    with stem.with_suffix(".jsonl").open("w") as f:
        f.write(json.dumps({"machine": mach, "command": ns.command}) + "\n")
        for model in models:
            for a, b in _chosen_pairs(ns.pair_list):
                r = run_one(model, a, ns, log, paired_with=b)
                f.write(json.dumps(r) + "\n")
                if not r["ok"]:
                    lines.append(f"| {model} | {a} | {b} | failed: {r['error'][:150]} ||||")
                    continue
                q1, q3 = r["ratio_q1_q3"]
                lines.append(
                    f"| {model} | {a} | {b} | {r['step_s'][a]:.3f} | {r['step_s'][b]:.3f} | "
                    f"**{r['ratio']:.3f}** | {q1:.3f}-{q3:.3f} |"
                )
                print(lines[-1], flush=True)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem.with_suffix(".jsonl")


def parent(ns: argparse.Namespace) -> Path:
    if ns.quick:
        models, ns.rounds = ["quick"], 1
    else:
        models = list(MODELS) if ns.models == "all" else ns.models.split(",")
    configs = list(CONFIGS) if ns.configs == "all" else ns.configs.split(",")
    for m in models:
        if m not in MODELS and m not in SCALE and m != "quick":
            known = ", ".join([*MODELS, *SCALE])
            raise SystemExit(f"unknown model {m!r}; choose from all, {known}")
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"unknown config {c!r}; choose from all, {', '.join(CONFIGS)}")
    if ns.pairs and not ns.quick:
        return parent_paired(ns, models)
    out_dir = Path(ns.out_dir) if ns.out_dir else common.RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"mem_grad-{ns.tag or _dt.date.today().strftime('%Y%m%d')}"
    log = stem.with_suffix(".log")
    log.write_text("")
    mach = common.machine()
    print(common.describe(mach), flush=True)
    jsonl = stem.with_suffix(".jsonl")
    with jsonl.open("w") as f:
        f.write(json.dumps({"machine": mach, "command": ns.command, "env": MALLOC_ENV}) + "\n")
    records: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for rnd in range(ns.rounds):
        for model in models:
            k = rnd % len(configs)
            order = configs[k:] + configs[:k]
            if rnd % 2:
                order.reverse()
            for config in order:
                start = time.perf_counter()
                r = {**run_one(model, config, ns, log), "round": rnd}
                r["wall_s"] = time.perf_counter() - start
                records.append(r)
                with jsonl.open("a") as f:
                    f.write(json.dumps(r) + "\n")
                if r["ok"]:
                    print(
                        f"{model} r{rnd} {config:14s} growth {_med(r['growth_mb']):6.1f} MB "
                        f"footprint {r['footprint_mb']:6.1f} MB .grad {r['peak_grad_mb']:6.1f} "
                        f"MB step {_med(r['step_times_s']):6.3f} s loss0 {r['losses'][0]:.5f} "
                        f"wall {r['wall_s']:4.0f} s",
                        flush=True,
                    )
                else:
                    print(f"{model} r{rnd} {config:14s} FAILED: {r['error'][:300]}", flush=True)
    rows = summarise(records)
    mach["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    table = markdown(rows, ns, mach)
    table += f"\nTotal wall time {time.perf_counter() - t_start:.0f} s; load average at the end "
    table += f"{mach['loadavg_end']}.\n"
    stem.with_suffix(".md").write_text(table)
    with jsonl.open("a") as f:
        f.write(json.dumps({"summary": rows}) + "\n")
    print()
    print(table)
    print(f"results: {jsonl}, {stem.with_suffix('.md')}; worker log: {log}")
    return jsonl


def main(argv: list[str] | None = None) -> Path | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="all", help=f"comma-separated or all ({', '.join(MODELS)})")
    p.add_argument(
        "--configs", default="all", help=f"comma-separated or all ({', '.join(CONFIGS)})"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="measured steps (default: per model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="per worker, seconds")
    p.add_argument("--tag", default="", help="results file stem suffix (default: today's date)")
    p.add_argument("--out-dir", default="", help="results directory (default: bench/results)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: a tiny MLP, 1 round, every configuration in this process",
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="instead: step-time ratios of PAIRS, trained side by side, over this many pairs",
    )
    p.add_argument(
        "--pair-list", default="all", help=f"with --pairs: comma-separated or all ({_pair_names()})"
    )
    # worker-only
    p.add_argument("--paired-with", default="", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    ns.command = " ".join(["python -m bench.mem_grad", *argv])
    if ns.worker:
        worker(ns)
        return None
    return parent(ns)


if __name__ == "__main__":
    main()
