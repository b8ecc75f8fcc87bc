"""Training-step benchmark: PyTorch eager vs torch.compile vs ortfx, one fresh process per run.

    python -m bench.compare --models all --backends eager,compile,ortfx --rounds 3 --steps 20 \
        --threads 1

Each (round, backend) runs in a fresh subprocess (nothing warm carries over: no allocator
state, no inductor cache unless ``--compile-cache shared``), and the backend order rotates from
round to round so that a slow phase of a shared machine does not always hit the same backend.
Ratios are taken against eager *of the same round* and then summarised over rounds.

Each worker builds the model with a fixed seed, wraps it, and runs ``--steps`` AdamW training
steps (forward, loss, backward, optimizer step). It reports the first-step latency (export /
compile included), the per-step times after ``--warmup`` steps, the peak RSS of the process
(and of its children: inductor's compile workers) and the first losses.

Results go to ``bench/results/compare-<stamp>.{jsonl,md,png}``.

``--paired`` measures what a sequential-process run cannot separate from load on a shared
machine: one process per round builds every backend's model (same seed, same batches) and
interleaves their steps, step ``i`` of each backend back to back, the order rotating per step.
A burst of load then hits every backend alike, and the ratio of a round is the median over
steps of (backend step / eager step of the same index). The first step is still reported, but
in a process that has already imported and warmed torch for the other backends.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.models import EXTRA, MODELS

BACKENDS = ("eager", "compile", "ortfx")
N_LOSSES = 5


# ---- worker ---------------------------------------------------------------------------------


def wrap(
    model: Any, backend: str, threads: int, ortfx_options: dict[str, Any] | None = None
) -> Any:
    import torch

    if backend == "eager":
        return model
    if backend == "compile":
        return torch.compile(model)
    if backend == "ortfx":
        import ortfx

        return ortfx.ORTModule(
            model, options=ortfx.Options(intra_op_threads=threads, **(ortfx_options or {}))
        )
    raise SystemExit(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


def adamw(params: Any, optimizer: str) -> Any:
    """The step's optimizer, the same for every backend: torch's AdamW (``adamw``), or its
    fused CPU kernel (``adamw-fused``: at 100M+ parameters the default implementation is a
    third of the step, 7x the fused one's time)."""
    import torch

    return torch.optim.AdamW(params, lr=1e-3, fused=True if optimizer == "adamw-fused" else None)


def train_steps(
    model_name: str,
    backend: str,
    steps: int,
    threads: int,
    seed: int = 0,
    ortfx_options: dict[str, Any] | None = None,
    optimizer_name: str = "adamw",
) -> dict[str, Any]:
    """Build, wrap and train in this process; return the measurements."""
    import torch

    from bench.models import build

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    start = time.perf_counter()
    model, make_batch, loss_fn = build(model_name, seed)
    wrapped = wrap(model, backend, threads, ortfx_options)
    build_s = time.perf_counter() - start
    rss_after_build = common.current_rss_mb()
    optimizer = adamw(model.parameters(), optimizer_name)
    times: list[float] = []
    cpu: list[float] = []
    losses: list[float] = []
    for step in range(steps):
        args, kwargs = make_batch(step)
        c0 = time.process_time()
        t0 = time.perf_counter()
        loss = loss_fn(wrapped(*args, **kwargs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(value)
    extra: dict[str, Any] = {}
    if backend == "ortfx":
        import ortfx

        s = ortfx.stats(wrapped)
        extra["ortfx_stats"] = {"calls": s.calls, "exports": s.exports}
    return {
        "model": model_name,
        "backend": backend,
        "threads": threads,
        "torch_threads": torch.get_num_threads(),
        "steps": steps,
        "build_s": build_s,
        "first_step_s": times[0],
        "step_times_s": times,
        # CPU time of the process: on a shared machine, time spent descheduled is not counted
        "step_cpu_s": cpu,
        "losses": losses,
        "rss_after_build_mb": rss_after_build,
        "peak_rss_mb": common.peak_rss_mb(),
        "peak_rss_children_mb": common.peak_rss_mb(common.resource.RUSAGE_CHILDREN),
        **extra,
    }


def paired_steps(
    model_name: str,
    backends: list[str],
    steps: int,
    threads: int,
    seed: int = 0,
    ortfx_options: dict[str, Any] | None = None,
    optimizer_name: str = "adamw",
) -> list[dict[str, Any]]:
    """Every backend in this process, steps interleaved (order rotated per step); one record
    per backend in :func:`train_steps`'s form."""
    import torch

    from bench.models import build

    torch.set_num_threads(threads)
    runs = []
    for backend in backends:
        model, make_batch, loss_fn = build(model_name, seed)
        runs.append(
            {
                "backend": backend,
                "wrapped": wrap(model, backend, threads, ortfx_options),
                "optimizer": adamw(model.parameters(), optimizer_name),
                "make_batch": make_batch,
                "loss_fn": loss_fn,
                "times": [],
                "cpu": [],
                "losses": [],
            }
        )
    for step in range(steps):
        k = step % len(runs)
        for run in runs[k:] + runs[:k]:
            args, kwargs = run["make_batch"](step)
            c0 = time.process_time()
            t0 = time.perf_counter()
            loss = run["loss_fn"](run["wrapped"](*args, **kwargs))
            loss.backward()
            run["optimizer"].step()
            run["optimizer"].zero_grad(set_to_none=True)
            value = float(loss.detach())
            run["times"].append(time.perf_counter() - t0)
            run["cpu"].append(time.process_time() - c0)
            run["losses"].append(value)
    out = []
    for run in runs:
        record: dict[str, Any] = {
            "model": model_name,
            "backend": run["backend"],
            "threads": threads,
            "torch_threads": torch.get_num_threads(),
            "steps": steps,
            "paired": True,
            "first_step_s": run["times"][0],
            "step_times_s": run["times"],
            "step_cpu_s": run["cpu"],
            "losses": run["losses"],
            "peak_rss_mb": common.peak_rss_mb(),
            "peak_rss_children_mb": common.peak_rss_mb(common.resource.RUSAGE_CHILDREN),
        }
        if run["backend"] == "ortfx":
            import ortfx

            s = ortfx.stats(run["wrapped"])
            record["ortfx_stats"] = {"calls": s.calls, "exports": s.exports}
        out.append(record)
    return out


def worker(ns: argparse.Namespace) -> None:
    common.pin(ns.pin)
    common.quiet()
    if ns.paired:
        backends = ns.backend.split(",")
        try:
            results = paired_steps(
                ns.model,
                backends,
                ns.steps,
                ns.threads,
                ns.seed,
                parse_options(ns.ortfx_option),
                ns.optimizer,
            )
            for r in results:
                r["ok"] = True
        except BaseException as e:  # one failing backend fails the paired round: report it
            import traceback

            results = [
                {
                    "model": ns.model,
                    "backend": b,
                    "ok": False,
                    "error": f"{type(e).__name__}: {str(e)[:2000]}",
                    "traceback": traceback.format_exc()[-4000:],
                }
                for b in backends
            ]
        Path(ns.out).write_text(json.dumps(results))
        return
    try:
        result = train_steps(
            ns.model,
            ns.backend,
            ns.steps,
            ns.threads,
            ns.seed,
            parse_options(ns.ortfx_option),
            ns.optimizer,
        )
        result["ok"] = True
    except BaseException as e:  # report failures as data: one backend failing is a result
        import traceback

        result = {
            "model": ns.model,
            "backend": ns.backend,
            "ok": False,
            "error": f"{type(e).__name__}: {str(e)[:2000]}",
            "traceback": traceback.format_exc()[-4000:],
        }
    Path(ns.out).write_text(json.dumps(result))


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``["enable_compute_optimizer=false", "allow_spinning=true"]`` -> ortfx.Options kwargs."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise SystemExit(f"--ortfx-option takes KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(raw.lower() if raw.lower() in ("true", "false") else raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


# ---- parent ---------------------------------------------------------------------------------


def run_one(model: str, backend: str, ns: argparse.Namespace, log: Path) -> Any:
    """One worker process; ``backend`` is a comma-separated list in paired mode, and the
    result then a list of records."""
    env = common.thread_env(ns.threads)
    cache: str | None = None
    if "compile" in backend.split(",") and ns.compile_cache == "fresh":
        cache = tempfile.mkdtemp(prefix="inductor-bench-")
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [
        sys.executable, "-m", "bench.compare", "--worker",
        "--model", model, "--backend", backend, "--steps", str(ns.steps),
        "--threads", str(ns.threads), "--seed", str(ns.seed), "--out", out,
    ]  # fmt: skip
    if ns.pin is not None:
        cmd += ["--pin", str(ns.pin)]
    if ns.paired:
        cmd.append("--paired")
    cmd += ["--optimizer", ns.optimizer]
    for opt in ns.ortfx_option:
        cmd += ["--ortfx-option", opt]
    start = time.perf_counter()
    try:
        with log.open("a") as logf:
            logf.write(f"\n==== {model} {backend} ====\n")
            logf.flush()
            proc = subprocess.run(
                cmd, env=env, cwd=common.ROOT, stdout=logf, stderr=logf, timeout=ns.timeout
            )
        text = Path(out).read_text() if Path(out).stat().st_size else ""
        result = json.loads(text) if text else {
            "model": model, "backend": backend, "ok": False,
            "error": f"worker exited with {proc.returncode} and no result (see {log.name})",
        }  # fmt: skip
    except subprocess.TimeoutExpired:
        result = {"model": model, "backend": backend, "ok": False, "error": "timeout"}
    finally:
        Path(out).unlink(missing_ok=True)
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    if ns.paired and isinstance(result, dict):  # the worker died: one failed record per backend
        result = [{**result, "backend": b} for b in backend.split(",")]
    wall = time.perf_counter() - start
    for r in result if isinstance(result, list) else [result]:
        r["wall_s"] = wall
    return result


def steady(r: dict[str, Any], warmup: int, key: str = "step_times_s") -> list[float]:
    return list(r.get(key, [])[warmup:])


def per_step_ratio(r: dict[str, Any], e: dict[str, Any], warmup: int, key: str) -> float:
    """Median over steps of backend step / eager step of the same index (paired mode)."""
    pairs = zip(steady(r, warmup, key), steady(e, warmup, key), strict=True)
    return common.median([a / b for a, b in pairs])


def roofline(model: str, ns: argparse.Namespace, log: Path) -> dict[str, Any]:
    """``bench.roofline`` for ``model`` in a worker of its own, at the run's thread count."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "bench.roofline", "--model", model,
           "--threads", str(ns.threads), "--out", out]  # fmt: skip
    try:
        with log.open("a") as logf:
            logf.write(f"\n==== {model} roofline ====\n")
            logf.flush()
            subprocess.run(
                cmd, env=common.thread_env(ns.threads), cwd=common.ROOT, stdout=logf,
                stderr=logf, timeout=ns.timeout, check=True,
            )  # fmt: skip
        return {**json.loads(Path(out).read_text()), "ok": True}
    except (subprocess.SubprocessError, OSError, json.JSONDecodeError) as e:
        return {"model": model, "ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        Path(out).unlink(missing_ok=True)


def summarise(
    records: list[dict[str, Any]],
    warmup: int,
    limits: dict[str, list[dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """One row per (model, backend): statistics over rounds, ratios against same-round eager
    and, with a measured roofline, the step as a multiple of it."""
    rows = []
    models = list(dict.fromkeys(r["model"] for r in records))
    backends = list(dict.fromkeys(r["backend"] for r in records))
    for model in models:
        eager = {
            r["round"]: r
            for r in records
            if r["model"] == model and r["backend"] == "eager" and r["ok"]
        }
        for backend in backends:
            runs = [r for r in records if r["model"] == model and r["backend"] == backend]
            ok = [r for r in runs if r["ok"]]
            row: dict[str, Any] = {
                "model": model,
                "backend": backend,
                "runs": len(runs),
                "ok": len(ok),
            }
            if not ok:
                row["error"] = runs[0].get("error", "?") if runs else "not run"
                rows.append(row)
                continue
            pooled = [t for r in ok for t in steady(r, warmup)]
            per_round = [common.median(steady(r, warmup)) for r in ok]
            ratios, cpu_ratios, loss_diffs = [], [], []
            for r in ok:
                e = eager.get(r["round"])
                if e is None:
                    continue
                if r.get("paired"):  # same step index, back to back: ratio per step
                    ratios.append(per_step_ratio(r, e, warmup, "step_times_s"))
                    cpu_ratios.append(per_step_ratio(r, e, warmup, "step_cpu_s"))
                else:
                    med_r, med_e = (
                        common.median(steady(r, warmup)),
                        common.median(steady(e, warmup)),
                    )
                    ratios.append(med_r / med_e)
                    cpu_r = common.median(steady(r, warmup, "step_cpu_s"))
                    cpu_e = common.median(steady(e, warmup, "step_cpu_s"))
                    cpu_ratios.append(cpu_r / cpu_e)
                n = min(N_LOSSES, len(r["losses"]), len(e["losses"]))
                loss_diffs.append(
                    max(abs(a - b) for a, b in zip(r["losses"][:n], e["losses"][:n], strict=False))
                )
            row.update(
                step_ms_median=1e3 * common.median(per_round),
                step_ms_min=1e3 * min(pooled),
                step_ms_max=1e3 * max(pooled),
                ratio_median=common.median(ratios),
                ratio_min=min(ratios) if ratios else float("nan"),
                ratio_max=max(ratios) if ratios else float("nan"),
                cpu_ratio_median=common.median(cpu_ratios),
                cpu_ratio_min=min(cpu_ratios) if cpu_ratios else float("nan"),
                cpu_ratio_max=max(cpu_ratios) if cpu_ratios else float("nan"),
                first_step_s=common.median([r["first_step_s"] for r in ok]),
                first_step_s_max=max(r["first_step_s"] for r in ok),
                peak_rss_mb=common.median([r["peak_rss_mb"] for r in ok]),
                peak_rss_children_mb=common.median([r["peak_rss_children_mb"] for r in ok]),
                loss_diff=max(loss_diffs) if loss_diffs else float("nan"),
                losses=ok[0]["losses"][:N_LOSSES],
            )
            # Each round's steps against the roofline measured just before that round.
            by_round = {
                limit["round"]: limit["roofline_s"]
                for limit in (limits or {}).get(model, [])
                if limit.get("ok")
            }
            per_round_x = [
                (common.median(steady(r, warmup)), min(steady(r, warmup)), by_round[r["round"]])
                for r in ok
                if r["round"] in by_round
            ]
            if per_round_x:
                row["roofline_ms"] = 1e3 * common.median([lim for _, _, lim in per_round_x])
                row["x_roofline"] = common.median([med / lim for med, _, lim in per_round_x])
                row["x_roofline_min"] = min(low / lim for _, low, lim in per_round_x)
            rows.append(row)
    return rows


def markdown(
    rows: list[dict[str, Any]],
    ns: argparse.Namespace,
    mach: dict[str, Any],
    limits: dict[str, list[dict[str, Any]]] | None = None,
) -> str:
    from bench.roofline import summary

    roof = []
    for m, rounds in (limits or {}).items():
        good = [r for r in rounds if r.get("ok")]
        if not good:
            roof.append(f"Roofline of {m}: failed ({rounds[0].get('error', '?')[:200]}).")
            continue
        each = ", ".join(f"{1e3 * r['roofline_s']:.0f}" for r in good)
        roof.append(
            f"Roofline of {m} (bench.roofline before each round, this run): {each} ms by "
            f"round; the first: {summary(good[0])}."
        )
    lines = [
        f"# Training-step benchmark ({mach['date'][:10]})",
        "",
        f"Machine: {common.describe(mach)}",
        "",
        f"Command: `python -m bench.compare {' '.join(ns.argv)}`",
        "",
        f"{ns.rounds} rounds x {ns.steps} steps, "
        f"{'AdamW (fused=True)' if ns.optimizer == 'adamw-fused' else 'AdamW'}, "
        f"{ns.threads} thread(s)"
        f"{f', ortfx options {parse_options(ns.ortfx_option)}' if ns.ortfx_option else ''}"
        f"{f', pinned to cpu {ns.pin}' if ns.pin is not None else ''}; "
        + (
            "PAIRED: one process per round with every backend, steps interleaved (order "
            "rotated per step); ratio = median over steps of backend step / eager step of the "
            "same index, median (min-max) over rounds; first step includes export/compile but "
            "runs in a process already warmed by the other backends; peak RSS is the shared "
            "process's"
            if ns.paired
            else "fresh process per (round, backend), backend order rotated per round; ratio = "
            "backend median / eager median of the same round, median (min-max) over rounds; "
            "first step includes export/compile"
        )
        + f"; step times exclude the first {ns.warmup} steps"
        f"{' (inductor cache fresh per process)' if ns.compile_cache == 'fresh' else ''}; "
        "CPU ratio = the same with the process's CPU time per step (time spent descheduled by "
        "other load on a shared machine is not counted); "
        "loss diff = max |loss - eager loss| over the first 5 steps"
        + (
            "; x roofline = step median / the roofline measured just before the same round "
            "(fastest of each step's products, everything else counted as zero: see "
            "bench/roofline.py), median over rounds, with the fastest step's in brackets."
            if roof
            else "."
        ),
        "",
        *[line for r in roof for line in (r, "")],
        "| model | backend | step ms median | min | max | ratio to eager | CPU ratio "
        + ("| x roofline " if roof else "")
        + "| first step s | peak RSS MB (children) | loss diff |",
        "|---|---|---:|---:|---:|---|---|" + ("---|" if roof else "") + "---:|---:|---:|",
    ]
    for r in rows:
        if not r.get("ok"):
            lines.append(
                f"| {r['model']} | {r['backend']} | failed: {r.get('error', '?')[:120]} ||||||||"
            )
            continue
        children = f" (+{r['peak_rss_children_mb']:.0f})" if r["peak_rss_children_mb"] > 1 else ""
        lines.append(
            f"| {r['model']} | {r['backend']} | {r['step_ms_median']:.1f} | {r['step_ms_min']:.1f} "
            f"| {r['step_ms_max']:.1f} | {r['ratio_median']:.3f} ({r['ratio_min']:.2f}-"
            f"{r['ratio_max']:.2f}) | {r['cpu_ratio_median']:.3f} ({r['cpu_ratio_min']:.2f}-"
            f"{r['cpu_ratio_max']:.2f}) | "
            + (
                f"{r['x_roofline']:.2f} ({r['x_roofline_min']:.2f}) | "
                if "x_roofline" in r
                else ("n/a | " if roof else "")
            )
            + f"{r['first_step_s']:.2f} "
            f"| {r['peak_rss_mb']:.0f}{children} | {r['loss_diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    ok = [r for r in rows if r.get("ok")]
    models = list(dict.fromkeys(r["model"] for r in ok))
    backends = list(dict.fromkeys(r["backend"] for r in ok))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(backends))
    for j, backend in enumerate(backends):
        xs, ratio, lo, hi, first, cpu = [], [], [], [], [], []
        for i, model in enumerate(models):
            r = next((r for r in ok if r["model"] == model and r["backend"] == backend), None)
            if r is None:
                continue
            xs.append(i + (j - (len(backends) - 1) / 2) * width)
            ratio.append(r["ratio_median"])
            cpu.append(r["cpu_ratio_median"])
            lo.append(r["ratio_median"] - r["ratio_min"])
            hi.append(r["ratio_max"] - r["ratio_median"])
            first.append(r["first_step_s"])
        ax1.bar(xs, ratio, width, yerr=[lo, hi], capsize=3, label=backend)
        ax1.plot(xs, cpu, "k_", markersize=12, label="CPU-time ratio" if j == 0 else None)
        ax2.bar(xs, first, width, label=backend)
        for x, v in zip(xs, ratio, strict=False):
            ax1.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        for x, v in zip(xs, first, strict=False):
            ax2.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
    ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax1.set_ylabel("step time / eager, same round (bars: wall, -: CPU time)")
    ax2.set_ylabel("first-step latency, s (log)")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models, rotation=15, fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parent(ns: argparse.Namespace) -> None:
    models = list(MODELS) if ns.models == "all" else ns.models.split(",")
    for m in models:
        if m not in MODELS and m not in EXTRA:
            raise SystemExit(
                f"unknown model {m!r}; choose from all, {', '.join([*MODELS, *EXTRA])}"
            )
    backends = ns.backends.split(",")
    for b in backends:
        if b not in BACKENDS:
            raise SystemExit(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
    if "eager" not in backends:
        raise SystemExit("ratios are taken against eager: include it in --backends")
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    stem = common.RESULTS / f"compare-{ns.tag or common.stamp()}"
    log = stem.with_suffix(".log")
    mach = common.machine()
    print(common.describe(mach), flush=True)
    records: list[dict[str, Any]] = []
    jsonl = stem.with_suffix(".jsonl")
    with jsonl.open("w") as f:
        f.write(json.dumps({"machine": mach, "argv": ns.argv}) + "\n")
    limits: dict[str, list[dict[str, Any]]] = {}
    for model in models:
        for rnd in range(ns.rounds):
            if ns.roofline:  # every round: the host's speed drifts between rounds
                limit = {**roofline(model, ns, log), "round": rnd}
                limits.setdefault(model, []).append(limit)
                with jsonl.open("a") as f:
                    f.write(json.dumps({"roofline": limit}) + "\n")
                if limit.get("ok"):
                    from bench.roofline import summary

                    print(f"{model:18s} round {rnd} roofline: {summary(limit)}", flush=True)
            k = rnd % len(backends)
            order = backends[k:] + backends[:k]
            results = (
                run_one(model, ",".join(order), ns, log)
                if ns.paired
                else [run_one(model, b, ns, log) for b in order]
            )
            for r in results:
                backend = r["backend"]
                r["round"] = rnd
                records.append(r)
                with jsonl.open("a") as f:
                    f.write(json.dumps(r) + "\n")
                if r["ok"]:
                    st = steady(r, ns.warmup)
                    print(
                        f"{model:18s} round {rnd} {backend:8s} "
                        f"step {1e3 * common.median(st):8.1f} ms"
                        f"  first {r['first_step_s']:6.2f} s  rss {r['peak_rss_mb']:6.0f} MB"
                        f"  wall {r['wall_s']:5.1f} s",
                        flush=True,
                    )
                else:
                    print(
                        f"{model:18s} round {rnd} {backend:8s} FAILED: {r['error'][:300]}",
                        flush=True,
                    )
    rows = summarise(records, ns.warmup, limits)
    table = markdown(rows, ns, mach, limits)
    stem.with_suffix(".md").write_text(table)
    if plot(rows, stem.with_suffix(".png"), common.describe(mach)[:160]):
        print(f"plot: {stem.with_suffix('.png')}")
    print()
    print(table)
    print(f"results: {jsonl}, {stem.with_suffix('.md')}; worker logs: {log}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models",
        "--model",
        default="gpt2-4x256",
        help=f"comma-separated, or 'all' ({', '.join(MODELS)}; extra: {', '.join(EXTRA)})",
    )
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the step times")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads, OMP/MKL threads and ortfx intra-op threads",
    )
    p.add_argument(
        "--pin",
        type=int,
        nargs="?",
        const=0,
        default=None,
        help="pin each worker to this CPU (default 0 when given without a value)",
    )
    p.add_argument(
        "--compile-cache",
        choices=("fresh", "shared"),
        default="fresh",
        help="fresh: a new inductor cache per process, so every first step is a cold compile",
    )
    p.add_argument(
        "--ortfx-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an ortfx.Options field for the ortfx backend, e.g. enable_compute_optimizer=false",
    )
    p.add_argument(
        "--paired",
        action="store_true",
        help="one process per round with every backend, steps interleaved (see above)",
    )
    p.add_argument(
        "--roofline",
        action="store_true",
        help="measure each model's roofline first (bench.roofline) and report steps against it",
    )
    p.add_argument(
        "--optimizer",
        choices=("adamw", "adamw-fused"),
        default="adamw",
        help="every backend's optimizer: torch's AdamW, or its fused CPU kernel",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="per worker, seconds")
    p.add_argument("--tag", default="", help="results file stem (default: date and time)")
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    ns.argv = argv
    if ns.worker:
        ns.model = ns.models
        worker(ns)
    else:
        parent(ns)


if __name__ == "__main__":
    main()
