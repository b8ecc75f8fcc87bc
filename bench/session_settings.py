"""ONNX Runtime session settings for ortfx's training session, measured on one model.

    python -m bench.session_settings --model gpt2-4x256 --rounds 3 --steps 12 [--variants a,b]

Every variant runs in a fresh process (order rotated per round, like bench.compare). ortfx is
not edited: each variant monkeypatches ``ortfx.runtime.session.session_options`` (the
``SessionOptions`` of the gradient-graph session) and/or the
``TrainingGraphTransformerConfiguration`` that ``TrainingRunner`` hands to
``OrtModuleGraphBuilder.build``. The eager row is the reference of the same round.

Results: ``bench/results/session-settings-<stamp>.{jsonl,md}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import common

# name -> (description, SessionOptions edit, graph-transformer-config edit, ortfx.Options kwargs)
SoEdit = Callable[[Any, Any], None]
GcEdit = Callable[[Any], None]


def _entry(key: str, value: str) -> SoEdit:
    return lambda so, ort: so.add_session_config_entry(key, value)


def _set(attr: str, value: Callable[[Any], Any]) -> SoEdit:
    return lambda so, ort: setattr(so, attr, value(ort))


def _both(*edits: SoEdit) -> SoEdit:
    def run(so: Any, ort: Any) -> None:
        for e in edits:
            e(so, ort)

    return run


def _compute_optimizer(gc: Any) -> None:
    gc.enable_compute_optimizer = True


VARIANTS: dict[str, tuple[str, SoEdit | None, GcEdit | None, dict[str, Any]]] = {
    "eager": ("PyTorch eager (reference)", None, None, {}),
    "baseline": ("ortfx as shipped", None, None, {}),
    "opt-disable": ("graph_optimization_level = ORT_DISABLE_ALL",
                    _set("graph_optimization_level", lambda o: o.GraphOptimizationLevel.ORT_DISABLE_ALL), None, {}),
    "opt-basic": ("graph_optimization_level = ORT_ENABLE_BASIC",
                  _set("graph_optimization_level", lambda o: o.GraphOptimizationLevel.ORT_ENABLE_BASIC), None, {}),
    "opt-extended": ("graph_optimization_level = ORT_ENABLE_EXTENDED",
                     _set("graph_optimization_level", lambda o: o.GraphOptimizationLevel.ORT_ENABLE_EXTENDED), None, {}),
    "spinning-on": ("session.intra_op.allow_spinning = 1 (Options(allow_spinning=True))",
                    None, None, {"allow_spinning": True}),
    "order-priority": ("execution_order = PRIORITY_BASED",
                       _set("execution_order", lambda o: o.ExecutionOrder.PRIORITY_BASED), None, {}),
    "order-memeff": ("execution_order = MEMORY_EFFICIENT",
                     _set("execution_order", lambda o: o.ExecutionOrder.MEMORY_EFFICIENT), None, {}),
    "mem-pattern": ("enable_mem_pattern = True", _set("enable_mem_pattern", lambda o: True), None, {}),
    "no-prepack": ("session.disable_prepacking = 1", _entry("session.disable_prepacking", "1"), None, {}),
    "no-arena": ("enable_cpu_mem_arena = False", _set("enable_cpu_mem_arena", lambda o: False), None, {}),
    "compute-opt": ("TrainingGraphTransformerConfiguration.enable_compute_optimizer = True",
                    None, _compute_optimizer, {}),
    "upstream-like": ("upstream ORTModule's CPU settings: no-prepack + compute-opt",
                      _entry("session.disable_prepacking", "1"), _compute_optimizer, {}),
    "mem-reuse-UNSAFE": ("enable_mem_reuse = True (unsafe: overwrites user outputs; for insight)",
                         _set("enable_mem_reuse", lambda o: True), None, {}),
}  # fmt: skip


def patch(variant: str) -> None:
    """Apply ``variant``'s edits to ortfx's session construction in this process."""
    import onnxruntime as ort

    from bench import _compat
    from ortfx.runtime import session

    _compat.apply()
    _, so_edit, gc_edit, _ = VARIANTS[variant]
    if so_edit is not None:
        original = session.session_options

        def session_options(*args: Any, **kwargs: Any) -> Any:
            so = original(*args, **kwargs)
            so_edit(so, ort)
            return so

        session.session_options = session_options
    if gc_edit is not None:
        real = session.C

        class CProxy:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            @staticmethod
            def TrainingGraphTransformerConfiguration() -> Any:  # noqa: N802 - mirrors ORT
                gc = real.TrainingGraphTransformerConfiguration()
                gc_edit(gc)
                return gc

        session.C = CProxy()


def worker(ns: argparse.Namespace) -> None:
    common.pin(ns.pin)
    common.quiet()
    from bench import compare

    try:
        if ns.variant == "eager":
            r = compare.train_steps(ns.model, "eager", ns.steps, ns.threads)
        else:
            patch(ns.variant)
            import torch

            from bench.models import build

            # as compare.train_steps, with the variant's ortfx.Options
            torch.set_num_threads(ns.threads)
            kwargs = VARIANTS[ns.variant][3]
            orig_wrap = compare.wrap
            compare.wrap = lambda m, b, t, o=None: orig_wrap(m, b, t, kwargs)  # type: ignore[assignment]
            r = compare.train_steps(ns.model, "ortfx", ns.steps, ns.threads)
            del build
        r["ok"] = True
    except BaseException as e:
        import traceback

        r = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:1500]}",
             "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
    r["variant"] = ns.variant
    Path(ns.out).write_text(json.dumps(r))


def run_one(variant: str, ns: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "bench.session_settings", "--_variant", variant, "--model", ns.model,
           "--steps", str(ns.steps), "--threads", str(ns.threads), "--out", out]  # fmt: skip
    if ns.pin is not None:
        cmd += ["--pin", str(ns.pin)]
    proc = subprocess.run(cmd, env=common.thread_env(ns.threads), cwd=common.ROOT,
                          capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    text = Path(out).read_text()
    Path(out).unlink(missing_ok=True)
    if not text:
        return {"variant": variant, "ok": False, "error": f"rc {proc.returncode}: {proc.stderr[-800:]}"}
    return json.loads(text)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-4x256")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"from: {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pin", type=int, nargs="?", const=0, default=None)
    p.add_argument("--tag", default="")
    p.add_argument("--_variant", dest="variant", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.variant:
        worker(ns)
        return
    variants = ns.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    if "eager" not in variants:
        variants.insert(0, "eager")
    if "baseline" not in variants:
        variants.insert(1, "baseline")
    mach = common.machine()
    print(common.describe(mach), flush=True)
    stem = common.RESULTS / f"session-settings-{ns.tag or common.stamp()}"
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    with stem.with_suffix(".jsonl").open("w") as f:
        f.write(json.dumps({"machine": mach, "argv": argv}) + "\n")
    for rnd in range(ns.rounds):
        k = rnd % len(variants)
        for v in variants[k:] + variants[:k]:
            t = time.perf_counter()
            r = run_one(v, ns)
            r["round"] = rnd
            records.append(r)
            with stem.with_suffix(".jsonl").open("a") as f:
                f.write(json.dumps(r) + "\n")
            if r["ok"]:
                st = r["step_times_s"][ns.warmup:]
                print(f"round {rnd} {v:17s} step {1e3 * common.median(st):7.1f} ms  first "
                      f"{r['first_step_s']:5.2f} s  rss {r['peak_rss_mb']:5.0f} MB  "
                      f"wall {time.perf_counter() - t:5.1f} s", flush=True)  # fmt: skip
            else:
                print(f"round {rnd} {v:17s} FAILED {r['error'][:300]}", flush=True)

    def med_step(r: dict[str, Any]) -> float:
        return common.median(r["step_times_s"][ns.warmup:])

    lines = [
        f"# ORT session settings for ortfx on {ns.model} ({mach['date'][:10]})",
        "",
        f"Machine: {common.describe(mach)}",
        "",
        f"Command: `python -m bench.session_settings {' '.join(argv)}`",
        "",
        f"{ns.rounds} rounds x {ns.steps} AdamW steps ({ns.warmup} warm-up left out), "
        f"{ns.threads} thread(s), fresh process per run, order rotated. Ratios are to the "
        "same round's eager and to the same round's ortfx baseline; median (min-max) over rounds.",
        "",
        "| variant | setting | step ms | / eager | / baseline | first step s | peak RSS MB | loss diff vs eager |",
        "|---|---|---:|---|---|---:|---:|---:|",
    ]
    by = {(r["variant"], r["round"]): r for r in records if r["ok"]}
    for v in variants:
        runs = [r for r in records if r["variant"] == v and r["ok"]]
        if not runs:
            err = next((r["error"] for r in records if r["variant"] == v), "?")
            lines.append(f"| {v} | {VARIANTS[v][0]} | failed: {err[:100]} ||||||")
            continue
        re, rb, ld = [], [], []
        for r in runs:
            e, b = by.get(("eager", r["round"])), by.get(("baseline", r["round"]))
            if e:
                re.append(med_step(r) / med_step(e))
                ld.append(max(abs(a - c) for a, c in zip(r["losses"][:5], e["losses"][:5])))
            if b:
                rb.append(med_step(r) / med_step(b))

        def fmt(xs: list[float]) -> str:
            return f"{common.median(xs):.3f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"

        lines.append(
            f"| {v} | {VARIANTS[v][0]} | {1e3 * common.median([med_step(r) for r in runs]):.1f} | "
            f"{fmt(re)} | {fmt(rb)} | {common.median([r['first_step_s'] for r in runs]):.2f} | "
            f"{common.median([r['peak_rss_mb'] for r in runs]):.0f} | {max(ld) if ld else float('nan'):.1e} |"
        )
    text = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(text)
    print()
    print(text)


if __name__ == "__main__":
    main()
