"""ONNX Runtime session settings for ortfx's training session, measured on one model.

    python -m bench.session_settings --model gpt2-4x256 --rounds 3 --steps 12 [--variants a,b]

Every variant runs in a fresh process (order rotated per round, like bench.compare). ortfx is
not edited: a variant either monkeypatches ``ortfx.runtime.session.session_options`` (the
``SessionOptions`` of the gradient-graph session) or sets an ``ortfx.Options`` field
(``allow_spinning``; ``enable_compute_optimizer``, which ortfx copies into the
``TrainingGraphTransformerConfiguration`` given to ``OrtModuleGraphBuilder.build``). The eager
row is the reference of the same round.

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

# name -> (description, SessionOptions edit or None, ortfx.Options kwargs)
SoEdit = Callable[[Any, Any], None]


def _entry(key: str, value: str) -> SoEdit:
    return lambda so, ort: so.add_session_config_entry(key, value)


def _set(attr: str, value: Callable[[Any], Any]) -> SoEdit:
    return lambda so, ort: setattr(so, attr, value(ort))


def _level(name: str) -> SoEdit:
    return _set("graph_optimization_level", lambda o: getattr(o.GraphOptimizationLevel, name))


def _no_arena(so: Any, ort: Any) -> None:
    so.enable_cpu_mem_arena = False
    # ortfx's shared arena in ORT's environment would serve the session anyway.
    so.add_session_config_entry("session.use_env_allocators", "0")


def _order(name: str) -> SoEdit:
    return _set("execution_order", lambda o: getattr(o.ExecutionOrder, name))


VARIANTS: dict[str, tuple[str, SoEdit | None, dict[str, Any]]] = {
    "eager": ("PyTorch eager (reference)", None, {}),
    "baseline": ("ortfx defaults", None, {}),
    "opt-disable": ("graph_optimization_level = ORT_DISABLE_ALL", _level("ORT_DISABLE_ALL"), {}),
    # ortfx's plain CPU training sessions skip ORT's passes since 2026-11-26: this measures
    # what the passes would still bring.
    "opt-all": ("graph_optimization_level = ORT_ENABLE_ALL", _level("ORT_ENABLE_ALL"), {}),
    "opt-basic": ("graph_optimization_level = ORT_ENABLE_BASIC", _level("ORT_ENABLE_BASIC"), {}),
    "opt-extended": (
        "graph_optimization_level = ORT_ENABLE_EXTENDED",
        _level("ORT_ENABLE_EXTENDED"),
        {},
    ),
    "spinning-on": ("Options(allow_spinning=True): intra-op spinning on", None,
                    {"allow_spinning": True}),
    "order-priority": ("execution_order = PRIORITY_BASED", _order("PRIORITY_BASED"), {}),
    "order-memeff": ("execution_order = MEMORY_EFFICIENT", _order("MEMORY_EFFICIENT"), {}),
    "mem-pattern": ("enable_mem_pattern = True", _set("enable_mem_pattern", lambda o: True), {}),
    "no-prepack": ("session.disable_prepacking = 1", _entry("session.disable_prepacking", "1"),
                   {}),
    # ortfx's CPU sessions share one arena registered in ORT's environment since 2026-11-26;
    # this gives each session its own again (compare in separate processes, not --paired).
    "own-arena": (
        "session.use_env_allocators = 0: an arena per session",
        _entry("session.use_env_allocators", "0"),
        {},
    ),
    "no-arena": ("enable_cpu_mem_arena = False", _no_arena, {}),
    "compute-opt-off": (
        "Options(enable_compute_optimizer=False) (TrainingGraphTransformerConfiguration)",
        None,
        {"enable_compute_optimizer": False},
    ),
    "compute-opt-on": (
        "Options(enable_compute_optimizer=True) (TrainingGraphTransformerConfiguration)",
        None,
        {"enable_compute_optimizer": True},
    ),
    "mem-reuse-UNSAFE": (
        "enable_mem_reuse = True (unsafe: ORT may overwrite user outputs; for insight only)",
        _set("enable_mem_reuse", lambda o: True),
        {},
    ),
    "relu-grad-ort": (
        "gradient pass off: passes.relu_grad_in_torch (ORT's ReluGrad, torch's NaN rule as Where)",
        None,
        {},
    ),
    "no-empty-reductions": (
        "gradient pass off: reductions.drop_empty_broadcast_reductions (2026-11-24)", None, {},
    ),
    "weights-transposed": (
        "export pass off: speed.weights_untransposed (MatMul of a transposed weight, 2026-11-27)",
        None,
        {},
    ),
    "tied-gather-dense": (
        "gradient pass off: grad_kernels.embedding_grads_scattered (a tied embedding's dense "
        "GatherGrad table and Sum, 2026-11-27)",
        None,
        {},
    ),
    "ce-split": (
        "export pass off: cross_entropy.cross_entropy_in_torch (the LogSoftmax + GatherElements "
        "form, torch's log-softmax gradient; 2026-11-27)",
        None,
        {},
    ),
    "ce-unfolded": (
        "gradient pass off: grad_kernels.cross_entropy_grads_summed (the logits' fed gradient "
        "added by an ORT Add after the cross-entropy's gradient; 2026-11-27)",
        None,
        {},
    ),
    "gelu-decomposed": (
        "export pass off: activations.tanh_gelu_in_torch (GPT-2's hand-written tanh GELU as "
        "ONNX elementwise ops, its tanh through Sigmoid; 2026-11-27)",
        None,
        {},
    ),
    "keep-torch-threads": (
        "Options(release_torch_threads=False): torch's OpenMP workers spin during ORT runs",
        None,
        {"release_torch_threads": False},
    ),
}  # fmt: skip

UNCHANGED = object()  # a pass over the model record: "did nothing" returns its input

# Variants that turn ortfx gradient-model passes off: (module, function, what "did nothing"
# returns), patched for the sessions built while the variant is active.
PASSES_OFF: dict[str, list[tuple[str, str, Any]]] = {
    "no-empty-reductions": [("ortfx.passes.reductions", "drop_empty_broadcast_reductions", 0)],
    "relu-grad-ort": [("ortfx.passes", "relu_grad_in_torch", False)],
    "weights-transposed": [("ortfx.passes.speed", "weights_untransposed", UNCHANGED)],
    "tied-gather-dense": [("ortfx.passes", "embedding_grads_scattered", False)],
    "ce-split": [("ortfx.passes.cross_entropy", "cross_entropy_in_torch", UNCHANGED)],
    "ce-unfolded": [("ortfx.passes", "cross_entropy_grads_summed", False)],
    "gelu-decomposed": [("ortfx.passes.activations", "tanh_gelu_in_torch", UNCHANGED)],
}


def _passes_off(variant: str, when: Callable[[], bool]) -> None:
    import importlib

    for module_name, name, nothing in PASSES_OFF.get(variant, []):
        module = importlib.import_module(module_name)
        original = getattr(module, name)

        def off(*args: Any, _original: Any = original, _nothing: Any = nothing) -> Any:
            if not when():
                return _original(*args)
            return args[0] if _nothing is UNCHANGED else _nothing

        setattr(module, name, off)


def patch(variant: str, when: Callable[[], bool] = lambda: True) -> None:
    """Apply ``variant``'s SessionOptions edit / graph pass to ortfx's session construction in
    this process, for sessions created while ``when()`` is true."""
    import onnxruntime as ort

    from ortfx.runtime import events

    _passes_off(variant, when)
    so_edit = VARIANTS[variant][1]
    if so_edit is None:
        return

    def edit(so: Any, training: bool) -> None:
        if training and when():
            so_edit(so, ort)

    events.session_option_edits.append(edit)


def worker(ns: argparse.Namespace) -> None:
    common.pin(ns.pin)
    common.quiet()
    from bench import compare

    try:
        if ns.paired:
            r = paired(ns)
        elif ns.variant == "eager":
            r = compare.train_steps(ns.model, "eager", ns.steps, ns.threads)
        else:
            patch(ns.variant)
            options = VARIANTS[ns.variant][2]
            r = compare.train_steps(ns.model, "ortfx", ns.steps, ns.threads, 0, options)
        r["ok"] = True
    except BaseException as e:
        import traceback

        r = {
            "ok": False,
            "error": f"{type(e).__name__}: {str(e)[:1500]}",
            "traceback": traceback.format_exc()[-3000:],
        }
    r["variant"] = ns.variant
    Path(ns.out).write_text(json.dumps(r))


def paired(ns: argparse.Namespace) -> dict[str, Any]:
    """Baseline ortfx (A) and the variant (B) in one process, steps interleaved A/B then B/A:
    both see the same machine state, so their ratio survives the noise of a shared machine."""
    import torch

    from bench import compare
    from bench.models import build

    torch.set_num_threads(ns.threads)
    active = [False]
    if ns.variant != "eager":
        patch(ns.variant, lambda: active[0])

    def make(backend: str, options: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
        model, make_batch, loss_fn = build(ns.model, 0)
        wrapped = compare.wrap(model, backend, ns.threads, options)
        return wrapped, torch.optim.AdamW(model.parameters(), lr=1e-3), make_batch, loss_fn

    def one(
        m: Any, opt: Any, make_batch: Any, loss_fn: Any, step: int
    ) -> tuple[float, float, float]:
        args, kwargs = make_batch(step)
        c0, t0 = time.process_time(), time.perf_counter()
        loss = loss_fn(m(*args, **kwargs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        return time.perf_counter() - t0, time.process_time() - c0, value

    a = make("ortfx", {})
    first_a = one(*a, 0)
    active[0] = True
    b = make("eager", {}) if ns.variant == "eager" else make("ortfx", VARIANTS[ns.variant][2])
    first_b = one(*b, 0)
    active[0] = False
    ta, tb, ca, cb, la, lb = [], [], [], [], [first_a[2]], [first_b[2]]
    for step in range(1, ns.steps):
        order = ((a, ta, ca, la), (b, tb, cb, lb))
        for m, t, c, losses in order if step % 2 else order[::-1]:
            wall, cpu, value = one(*m, step)
            t.append(wall)
            c.append(cpu)
            losses.append(value)
    return {
        "variant": ns.variant,
        "wall_a": ta,
        "wall_b": tb,
        "cpu_a": ca,
        "cpu_b": cb,
        "losses_a": la,
        "losses_b": lb,
        "first_a_s": first_a[0],
        "first_b_s": first_b[0],
        "peak_rss_mb": common.peak_rss_mb(),
    }


def run_one(variant: str, ns: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "bench.session_settings", "--_variant", variant,
           "--model", ns.model, "--steps", str(ns.steps), "--threads", str(ns.threads),
           "--out", out]  # fmt: skip
    if ns.pin is not None:
        cmd += ["--pin", str(ns.pin)]
    if ns.paired:
        cmd += ["--paired"]
    proc = subprocess.run(cmd, env=common.thread_env(ns.threads), cwd=common.ROOT,
                          capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    text = Path(out).read_text()
    Path(out).unlink(missing_ok=True)
    if not text:
        return {
            "variant": variant,
            "ok": False,
            "error": f"rc {proc.returncode}: {proc.stderr[-800:]}",
        }
    return json.loads(text)  # type: ignore[no-any-return]


def paired_parent(ns: argparse.Namespace, argv: list[str], variants: list[str]) -> None:
    mach = common.machine()
    print(common.describe(mach), flush=True)
    stem = common.RESULTS / f"session-settings-paired-{ns.tag or common.stamp()}"
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    with stem.with_suffix(".jsonl").open("w") as f:
        f.write(json.dumps({"machine": mach, "argv": argv}) + "\n")
    records: list[dict[str, Any]] = []
    w = ns.warmup - 1  # the lists start at step 1

    def ratio(r: dict[str, Any], key: str) -> float:
        a, b = r[f"{key}_a"][w:], r[f"{key}_b"][w:]
        return common.median([y / x for x, y in zip(a, b, strict=True)])

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
                print(f"round {rnd} {v:17s} B/A cpu {ratio(r, 'cpu'):.3f} wall "
                      f"{ratio(r, 'wall'):.3f}  A {1e3 * common.median(r['cpu_a'][w:]):6.1f} ms"
                      f"  B {1e3 * common.median(r['cpu_b'][w:]):6.1f} ms  "
                      f"({time.perf_counter() - t:4.1f} s)", flush=True)  # fmt: skip
            else:
                print(f"round {rnd} {v:17s} FAILED {r['error'][:300]}", flush=True)
    lines = [
        f"# ORT session settings for ortfx on {ns.model}, paired ({mach['date'][:10]})",
        "",
        f"Machine: {common.describe(mach)}",
        "",
        f"Command: `python -m bench.session_settings {' '.join(argv)}`",
        "",
        f"Each process trains two copies of the model from the same seed: A = ortfx with its "
        f"defaults, B = the variant, {ns.steps} AdamW steps each, interleaved A,B / B,A; "
        f"ratio = median over steps (after {ns.warmup} warm-up) of B/A CPU time (wall in "
        f"brackets), then median (min-max) over {ns.rounds} fresh processes. For 'eager', B is "
        "plain PyTorch, so B/A < 1 means eager is faster than ortfx. Loss diff: max |B - A| over "
        "the first 5 losses.",
        "",
        "| variant | setting | B/A CPU time | (wall) | A ms | B ms | B first step s "
        "| loss diff B vs A |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for v in variants:
        runs = [r for r in records if r["variant"] == v and r.get("ok")]
        if not runs:
            err = next((r.get("error", "?") for r in records if r["variant"] == v), "?")
            lines.append(f"| {v} | {VARIANTS[v][0]} | failed: {err[:100]} ||||||")
            continue
        cpu = [ratio(r, "cpu") for r in runs]
        wall = [ratio(r, "wall") for r in runs]
        diff = max(
            max(abs(x - y) for x, y in zip(r["losses_a"][:5], r["losses_b"][:5], strict=True))
            for r in runs
        )
        lines.append(
            f"| {v} | {VARIANTS[v][0]} | {common.median(cpu):.3f} ({min(cpu):.2f}-{max(cpu):.2f}) "
            f"| {common.median(wall):.3f} "
            f"| {1e3 * common.median([common.median(r['cpu_a'][w:]) for r in runs]):.0f} "
            f"| {1e3 * common.median([common.median(r['cpu_b'][w:]) for r in runs]):.0f} "
            f"| {common.median([r['first_b_s'] for r in runs]):.2f} | {diff:.1e} |"
        )
    text = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(text)
    print()
    print(text)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="gpt2-4x256")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"from: {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pin", type=int, nargs="?", const=0, default=None)
    p.add_argument(
        "--paired",
        action="store_true",
        help="run each variant in one process with the ortfx baseline, steps interleaved "
        "(robust to a noisy machine); the eager variant then pairs eager with ortfx",
    )
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
    if ns.paired:
        variants = [v for v in variants if v != "baseline"]
        return paired_parent(ns, argv, variants)
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
                st = r["step_times_s"][ns.warmup :]
                cpu = r["step_cpu_s"][ns.warmup :]
                print(f"round {rnd} {v:17s} step {1e3 * common.median(st):7.1f} ms  cpu "
                      f"{1e3 * common.median(cpu):7.1f} ms  first "
                      f"{r['first_step_s']:5.2f} s  rss {r['peak_rss_mb']:5.0f} MB  "
                      f"wall {time.perf_counter() - t:5.1f} s", flush=True)  # fmt: skip
            else:
                print(f"round {rnd} {v:17s} FAILED {r['error'][:300]}", flush=True)

    def med_step(r: dict[str, Any], key: str = "step_cpu_s") -> float:
        return common.median(r[key][ns.warmup :])

    lines = [
        f"# ORT session settings for ortfx on {ns.model} ({mach['date'][:10]})",
        "",
        f"Machine: {common.describe(mach)}",
        "",
        f"Command: `python -m bench.session_settings {' '.join(argv)}`",
        "",
        f"{ns.rounds} rounds x {ns.steps} AdamW steps ({ns.warmup} warm-up left out), "
        f"{ns.threads} thread(s), fresh process per run, order rotated. Ratios use the "
        "process's CPU time per step (robust to descheduling on a shared machine) against the "
        "same round's eager and the same round's ortfx baseline; median (min-max) over rounds. "
        "Wall ms is the median wall-clock step for reference.",
        "",
        "| variant | setting | wall ms | CPU ms | CPU / eager | CPU / baseline | first step s "
        "| peak RSS MB | loss diff vs eager |",
        "|---|---|---:|---:|---|---|---:|---:|---:|",
    ]
    by = {(r["variant"], r["round"]): r for r in records if r["ok"]}
    for v in variants:
        runs = [r for r in records if r["variant"] == v and r["ok"]]
        if not runs:
            err = next((r["error"] for r in records if r["variant"] == v), "?")
            lines.append(f"| {v} | {VARIANTS[v][0]} | failed: {err[:100]} |||||||")
            continue
        re, rb, ld = [], [], []
        for r in runs:
            e, b = by.get(("eager", r["round"])), by.get(("baseline", r["round"]))
            if e:
                re.append(med_step(r) / med_step(e))
                ld.append(
                    max(abs(a - c) for a, c in zip(r["losses"][:5], e["losses"][:5], strict=False))
                )
            if b:
                rb.append(med_step(r) / med_step(b))

        def fmt(xs: list[float]) -> str:
            return f"{common.median(xs):.3f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"

        lines.append(
            f"| {v} | {VARIANTS[v][0]} "
            f"| {1e3 * common.median([med_step(r, 'step_times_s') for r in runs]):.1f} "
            f"| {1e3 * common.median([med_step(r) for r in runs]):.1f} | "
            f"{fmt(re)} | {fmt(rb)} | {common.median([r['first_step_s'] for r in runs]):.2f} | "
            f"{common.median([r['peak_rss_mb'] for r in runs]):.0f} "
            f"| {max(ld) if ld else float('nan'):.1e} |"
        )
    text = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(text)
    print()
    print(text)


if __name__ == "__main__":
    main()
