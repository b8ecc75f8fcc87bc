"""Training-memory benchmark: eager, per-block checkpointing and ortfx memory_opt_level 0/1/2.

    python -m bench.memory

Each (model, round, configuration) runs in a fresh subprocess with
``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0`` (large blocks are mmapped and freed
blocks go back to the OS, so RSS follows what is live) and one thread (``torch.set_num_threads(1)``,
OMP/MKL 1, ``ortfx.Options(intra_op_threads=1)``). The worker builds the model and AdamW, runs
``--warmup`` training steps, then ``--steps`` measured steps. For every measured step:

* ``growth`` = VmHWM during the step - VmRSS just before it. VmHWM is reset before the step by
  writing ``5`` to ``/proc/self/clear_refs``, so it is the exact peak of that step (no sampling);
* the step time (forward, loss, backward, AdamW step, zero_grad).

One extra step afterwards is sampled by a thread reading VmRSS every ~1 ms, as a cross-check of
the VmHWM number (a sampler can only see less than the true peak). The first losses are kept to
check that every configuration trains like eager, and for ortfx the plans of
``ortfx.memory_report``.

ONNX Runtime's CPU arena (``enable_cpu_mem_arena``, on by default and in ortfx) keeps the
largest step's memory mapped from the first step on, so with it "growth over the pre-step RSS"
is only what the arena has to add and says nothing about activations. The ``ortfx<N>``
configurations therefore turn the arena off (a monkeypatch of ``session_options`` here, in the
bench only) so that RSS shows ORT's real allocations; ``ortfx<N>+arena`` keep ortfx's defaults
and are compared by their absolute peak RSS. Every configuration also reports
``footprint`` = peak VmRSS of the measured steps - VmRSS after building the model (before any
step): parameters' gradients, AdamW state, activations, and whatever the arena retains.

Configurations run in an order rotated from round to round; the tables give medians over rounds.
Results: ``bench/results/memory-<date>.{jsonl,md}`` and the worker log ``memory-<date>.log``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import common

N_LOSSES = 5

# name -> (kind, memory_opt_level, ORT CPU arena)
CONFIGS: dict[str, tuple[str, int, bool]] = {
    "eager": ("eager", 0, False),
    "checkpoint": ("checkpoint", 0, False),
    "ortfx0": ("ortfx", 0, False),
    "ortfx1": ("ortfx", 1, False),
    "ortfx2": ("ortfx", 2, False),
    "ortfx0+arena": ("ortfx", 0, True),
    "ortfx1+arena": ("ortfx", 1, True),
}

# name -> (gpt2 builder kwargs, measured steps)
MODELS: dict[str, dict[str, Any]] = {
    "gpt2-4x256-b16-s128": {
        "kw": {"n_layer": 4, "n_embd": 256, "n_head": 4, "batch": 16, "seq": 128},
        "steps": 8,
    },
    # The brief's 8x512, batch 16, seq 256 takes ~10 s per eager step here (2 shared cores):
    # too slow for ~10 steps x 7 configurations x 2 rounds. Same depth and sequence, narrower
    # and half the batch.
    "gpt2-8x384-b8-s256": {
        "kw": {"n_layer": 8, "n_embd": 384, "n_head": 6, "batch": 8, "seq": 256},
        "steps": 6,
    },
}

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


# ---- worker ---------------------------------------------------------------------------------


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _rss_mb() -> float:
    return _status_kb("VmRSS:") / 1024.0


def _hwm_mb() -> float:
    return _status_kb("VmHWM:") / 1024.0


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Sampler:
    """Polls VmRSS every ``period`` seconds in a thread; ``peak`` is the largest seen."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.peak = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with open("/proc/self/status", "rb") as f:
            while not self._stop.is_set():
                f.seek(0)
                for line in f.read().split(b"\n"):
                    if line.startswith(b"VmRSS:"):
                        self.peak = max(self.peak, int(line.split()[1]) / 1024.0)
                        break
                self.samples += 1
                time.sleep(self.period)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _disable_ort_arena() -> None:
    from ortfx.runtime import events

    def no_arena(so: Any, training: bool) -> None:
        so.enable_cpu_mem_arena = False
        # ortfx's shared arena in ORT's environment would serve the session anyway.
        so.add_session_config_entry("session.use_env_allocators", "0")

    events.session_option_edits.append(no_arena)


def measure(model_name: str, config: str, warmup: int, steps: int, seed: int) -> dict[str, Any]:
    import torch

    from bench.models import gpt2

    kind, level, arena = CONFIGS[config]
    spec = MODELS[model_name]
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model, make_batch, loss_fn = gpt2(seed, **spec["kw"])
    wrapped: Any = model
    if kind == "checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif kind == "ortfx":
        import ortfx

        if not arena:
            _disable_ort_arena()
        wrapped = ortfx.ORTModule(
            model, options=ortfx.Options(memory_opt_level=level, intra_op_threads=1)
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rss_after_build = _rss_mb()

    def step(i: int) -> float:
        args, kwargs = make_batch(i)
        loss = loss_fn(wrapped(*args, **kwargs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())
        del loss
        return value

    losses: list[float] = []
    times: list[float] = []
    growth: list[float] = []
    before: list[float] = []
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
            before.append(rss0)
            peaks.append(peak)
            growth.append(peak - rss0)
        if i == 0:
            first_step_s = dt
    # Cross-check: one more step sampled by a polling thread.
    rss0 = _rss_mb()
    _reset_hwm()
    with Sampler() as sampler:
        losses.append(step(warmup + steps))
    cross = {
        "sampler_growth_mb": sampler.peak - rss0,
        "sampler_samples": sampler.samples,
        "hwm_growth_mb": _hwm_mb() - rss0,
    }
    result: dict[str, Any] = {
        "model": model_name,
        "config": config,
        "kind": kind,
        "memory_opt_level": level if kind == "ortfx" else None,
        "ort_arena": arena if kind == "ortfx" else None,
        "model_kw": spec["kw"],
        "params": sum(p.numel() for p in model.parameters()),
        "torch_threads": torch.get_num_threads(),
        "hwm_reset_works": hwm_ok,
        "rss_after_build_mb": rss_after_build,
        "rss_before_step_mb": before,
        "peak_rss_step_mb": peaks,
        "growth_mb": growth,
        "footprint_mb": max(peaks) - rss_after_build,
        "peak_rss_mb": max(peaks),
        "first_step_s": first_step_s,
        "step_times_s": times,
        "losses": losses[:N_LOSSES],
        **cross,
    }
    if kind == "ortfx":
        import ortfx

        s = ortfx.stats(wrapped)
        result["ortfx_stats"] = {"calls": s.calls, "exports": s.exports, "fallback": s.fallback}
        plans = ortfx.memory_report(wrapped)  # last: at level 0 it builds a probe graph
        result["plans_found"] = len(plans)
        result["plans_enabled"] = sum(p.enabled for p in plans)
        result["plans"] = [
            {
                "cluster_id": p.cluster_id,
                "enabled": p.enabled,
                "frequency": p.frequency,
                "saving_bytes": p.saving_bytes,
            }
            for p in plans
        ]
        result["estimated_saving_enabled_mb"] = (
            sum(p.saving_bytes or 0 for p in plans if p.enabled) / 2**20
        )
    return result


def worker(ns: argparse.Namespace) -> None:
    common.quiet()
    try:
        result = measure(ns.model, ns.config, ns.warmup, ns.steps, ns.seed)
        result["ok"] = True
    except BaseException as e:  # a failing configuration is a result
        import traceback

        result = {
            "model": ns.model,
            "config": ns.config,
            "ok": False,
            "error": f"{type(e).__name__}: {str(e)[:2000]}",
            "traceback": traceback.format_exc()[-4000:],
        }
    Path(ns.out).write_text(json.dumps(result))


# ---- parent ---------------------------------------------------------------------------------


def run_one(model: str, config: str, steps: int, ns: argparse.Namespace, log: Path) -> dict:
    env = common.thread_env(1)
    env.update(MALLOC_ENV)
    env["ORTFX_INTRA_OP_THREADS"] = "1"
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [
        sys.executable, "-m", "bench.memory", "--worker", "--model", model, "--config", config,
        "--warmup", str(ns.warmup), "--steps", str(steps), "--seed", str(ns.seed), "--out", out,
    ]  # fmt: skip
    start = time.perf_counter()
    try:
        with log.open("a") as logf:
            logf.write(f"\n==== {model} {config} ====\n")
            logf.flush()
            proc = subprocess.run(
                cmd, env=env, cwd=common.ROOT, stdout=logf, stderr=logf, timeout=ns.timeout
            )
        text = Path(out).read_text()
        result = json.loads(text) if text else {
            "model": model, "config": config, "ok": False,
            "error": f"worker exited with {proc.returncode} and no result (see {log.name})",
        }  # fmt: skip
    except subprocess.TimeoutExpired:
        result = {"model": model, "config": config, "ok": False, "error": "timeout"}
    finally:
        Path(out).unlink(missing_ok=True)
    result["wall_s"] = time.perf_counter() - start
    return result


def _med(xs: list[float]) -> float:
    return common.median([x for x in xs if x == x])


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for model in dict.fromkeys(r["model"] for r in records):
        by = {(r["round"], r["config"]): r for r in records if r["model"] == model and r["ok"]}
        for config in dict.fromkeys(r["config"] for r in records if r["model"] == model):
            runs = [r for r in records if r["model"] == model and r["config"] == config]
            ok = [r for r in runs if r["ok"]]
            row: dict[str, Any] = {"model": model, "config": config, "runs": len(runs)}
            row["ok"] = len(ok)
            if not ok:
                row["error"] = runs[0].get("error", "?")
                rows.append(row)
                continue
            loss_diffs, t_ratio, g_ratio, p_ratio = [], [], [], []
            base_name = "ortfx0+arena" if "+arena" in config else "ortfx0"
            for r in ok:
                e = by.get((r["round"], "eager"))
                if e is not None:
                    n = min(len(r["losses"]), len(e["losses"]))
                    loss_diffs.append(
                        max(
                            abs(a - b)
                            for a, b in zip(r["losses"][:n], e["losses"][:n], strict=True)
                        )
                    )
                b = by.get((r["round"], base_name))
                if b is not None:
                    t_ratio.append(_med(r["step_times_s"]) / _med(b["step_times_s"]))
                    g_ratio.append(_med(r["growth_mb"]) / _med(b["growth_mb"]))
                    p_ratio.append(r["footprint_mb"] / b["footprint_mb"])
            row.update(
                steps=len(ok[0]["step_times_s"]),
                growth_mb=_med([_med(r["growth_mb"]) for r in ok]),
                growth_spread_mb=max(max(r["growth_mb"]) - min(r["growth_mb"]) for r in ok),
                sampler_growth_mb=_med([r["sampler_growth_mb"] for r in ok]),
                footprint_mb=_med([r["footprint_mb"] for r in ok]),
                peak_rss_mb=_med([r["peak_rss_mb"] for r in ok]),
                rss_before_mb=_med([_med(r["rss_before_step_mb"]) for r in ok]),
                step_s=_med([_med(r["step_times_s"]) for r in ok]),
                step_s_per_round=[_med(r["step_times_s"]) for r in ok],
                first_step_s=_med([r["first_step_s"] for r in ok]),
                loss_diff=max(loss_diffs) if loss_diffs else float("nan"),
                losses=ok[0]["losses"],
                time_vs_base=_med(t_ratio),
                growth_vs_base=_med(g_ratio),
                footprint_vs_base=_med(p_ratio),
                base=base_name,
                plans_enabled=ok[0].get("plans_enabled"),
                plans_found=ok[0].get("plans_found"),
                est_saving_mb=ok[0].get("estimated_saving_enabled_mb"),
                hwm_reset_works=all(r.get("hwm_reset_works") for r in ok),
            )
            rows.append(row)
    return rows


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The target: ortfx level 1 at most half of level 0's growth, at most 1.3x its step time."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        get = {r["config"]: r for r in rows if r["model"] == model and r.get("ok")}
        for l1, metric, label in (
            ("ortfx1", "growth", "per-step RSS growth, ORT arena off"),
            (
                "ortfx1+arena",
                "footprint",
                "footprint over post-build RSS, ortfx defaults (arena on)",
            ),
        ):
            r = get.get(l1)
            base = get.get("ortfx0+arena" if "+arena" in l1 else "ortfx0")
            if r is None or base is None:
                out.append(f"- {model}, {label}: not measured ({l1} or its level-0 run failed)")
                continue
            mem_ratio = r[f"{metric}_vs_base"]
            t_ratio = r["time_vs_base"]
            met = mem_ratio <= 0.5 and t_ratio <= 1.3
            out.append(
                f"- {model}, {label}: level 1 {r[f'{metric}_mb']:.0f} MB vs level 0 "
                f"{base[f'{metric}_mb']:.0f} MB = **{mem_ratio:.2f}x** (target <= 0.50), "
                f"step time {r['step_s']:.2f} s vs {base['step_s']:.2f} s = **{t_ratio:.2f}x** "
                "(target <= 1.30)"
                f" -> **{'MET' if met else 'NOT MET'}**"
                + ("" if mem_ratio <= 0.5 else " (memory)")
                + ("" if t_ratio <= 1.3 else " (time)")
            )
    return out


def markdown(rows: list[dict[str, Any]], ns: argparse.Namespace, mach: dict[str, Any]) -> str:
    lines = [
        "# Training memory: eager, checkpointing, ortfx memory_opt_level 0/1/2 "
        f"({mach['date'][:10]})",
        "",
        f"Machine: {common.describe(mach)}",
        "",
        f"Command: `{ns.command}`",
        "",
        f"{ns.rounds} rounds, configuration order rotated per round, fresh process per run, "
        f"{' '.join(f'{k}={v}' for k, v in MALLOC_ENV.items())}, 1 thread, AdamW, "
        f"{ns.warmup} warm-up steps then the measured steps (model column). Medians over rounds.",
        "",
        "- **growth**: VmHWM of the step (reset via /proc/self/clear_refs) - VmRSS before the "
        "step; median over steps. For `ortfx<N>` ORT's CPU arena is off (bench-only patch) so "
        "that RSS follows ORT's allocations; with the arena (`+arena`, ortfx's default) the "
        "pre-step RSS already holds the arena and growth is not an activation measure.",
        "- **sampler**: the same growth seen by a 1 ms VmRSS polling thread on one extra step.",
        "- **footprint**: peak VmRSS over the measured steps - VmRSS after building model and "
        "optimizer (grads + AdamW state + activations + retained arena).",
        "- **vs L0**: ratio to `ortfx0` (arena off) or `ortfx0+arena` of the same round, median.",
        "- **loss diff**: max |loss - eager loss| over the first 5 steps.",
        "",
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        spec = MODELS[model]
        steps = next((r["steps"] for r in rows if r["model"] == model and r.get("ok")), "?")
        lines += [
            f"## {model} ({spec['kw']}, vocab 8192, {steps} measured steps)",
            "",
            "| config | growth MB | sampler MB | footprint MB | peak RSS MB | step s | "
            "step vs L0 | growth vs L0 | footprint vs L0 | plans on/found | est. saving MB | "
            "first step s | loss diff |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            if r["model"] != model:
                continue
            if not r.get("ok"):
                lines.append(f"| {r['config']} | failed: {r.get('error', '?')[:150]} |||||||||||")
                continue
            is_ort = r["plans_found"] is not None
            plans = f"{r['plans_enabled']}/{r['plans_found']}" if is_ort else "-"
            est = f"{r['est_saving_mb']:.0f}" if is_ort else "-"
            lines.append(
                f"| {r['config']} | {r['growth_mb']:.0f} | {r['sampler_growth_mb']:.0f} | "
                f"{r['footprint_mb']:.0f} | {r['peak_rss_mb']:.0f} | {r['step_s']:.2f} | "
                + (
                    f"{r['time_vs_base']:.2f} | {r['growth_vs_base']:.2f} | "
                    f"{r['footprint_vs_base']:.2f} | "
                    if is_ort
                    else "- | - | - | "
                )
                + f"{plans} | {est} | {r['first_step_s']:.1f} | {r['loss_diff']:.1e} |"
            )
        lines.append("")
    lines += ["## Target: level 1 <= 0.5x level 0 memory at <= 1.3x level 0 step time", ""]
    lines += verdicts(rows)
    return "\n".join(lines) + "\n"


def parent(ns: argparse.Namespace) -> None:
    models = list(MODELS) if ns.models == "all" else ns.models.split(",")
    configs = list(CONFIGS) if ns.configs == "all" else ns.configs.split(",")
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; choose from all, {', '.join(MODELS)}")
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"unknown config {c!r}; choose from all, {', '.join(CONFIGS)}")
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    stem = common.RESULTS / f"memory-{ns.tag or _dt.date.today().strftime('%Y%m%d')}"
    log = stem.with_suffix(".log")
    log.write_text("")
    mach = common.machine()
    print(common.describe(mach), flush=True)
    jsonl = stem.with_suffix(".jsonl")
    with jsonl.open("w") as f:
        f.write(json.dumps({"machine": mach, "command": ns.command, "env": MALLOC_ENV}) + "\n")
    records: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for model in models:
        steps = ns.steps or MODELS[model]["steps"]
        for rnd in range(ns.rounds):
            k = (rnd * max(1, len(configs) // ns.rounds)) % len(configs)
            order = configs[k:] + configs[:k]
            if rnd % 2:
                order.reverse()
            for config in order:
                r = run_one(model, config, steps, ns, log)
                r["round"] = rnd
                records.append(r)
                with jsonl.open("a") as f:
                    f.write(json.dumps(r) + "\n")
                if r["ok"]:
                    plans = (
                        f" plans {r['plans_enabled']}/{r['plans_found']}"
                        if "plans_found" in r
                        else ""
                    )
                    print(
                        f"{model} r{rnd} {config:13s} growth {_med(r['growth_mb']):6.0f} MB "
                        f"(sampler {r['sampler_growth_mb']:4.0f}) footprint "
                        f"{r['footprint_mb']:5.0f} MB step {_med(r['step_times_s']):5.2f} s "
                        f"loss0 {r['losses'][0]:.5f}{plans} wall {r['wall_s']:4.0f} s",
                        flush=True,
                    )
                else:
                    print(f"{model} r{rnd} {config:13s} FAILED: {r['error'][:300]}", flush=True)
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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="all", help=f"comma-separated or all ({', '.join(MODELS)})")
    p.add_argument(
        "--configs", default="all", help=f"comma-separated or all ({', '.join(CONFIGS)})"
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="measured steps (default: per model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=240.0, help="per worker, seconds")
    p.add_argument("--tag", default="", help="results file stem suffix (default: today's date)")
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    ns.command = " ".join(["python -m bench.memory", *argv])
    if ns.worker:
        worker(ns)
    else:
        parent(ns)


if __name__ == "__main__":
    main()
