"""Resident memory of a training loop that validates between steps: ortfx's CPU sessions sharing
one arena in ORT's environment (the default) against an arena per session.

    python -m bench.eval_memory [--model gpt2-4x256] [--rounds 3] [--steps 9] [--eval-every 3]

Each (round, variant) is a fresh process (allocator settings cannot be compared inside one
process: its sessions would share the allocator state), 1 thread. The worker trains ``--steps``
steps (AdamW) and, every ``--eval-every`` steps, runs one batch in eval mode under
``torch.no_grad()`` (ortfx exports the eval graph and opens an inference session for it). It
records VmRSS after the last step (what the loop holds from then on), the peak (VmHWM) over the
whole run, and the peak from the second validation on (the first one includes the eval
export). ``eager`` runs the same loop in plain PyTorch. The ``own`` variant gives every ortfx
session its own arena through the ``events.session_option_edits`` seam
(``session.use_env_allocators = 0``). Results: ``bench/results/eval-memory-<stamp>.{jsonl,md}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from bench import common
from bench.memory import _hwm_mb, _reset_hwm, _rss_mb

VARIANTS = ("eager", "shared", "own")


def worker(ns: argparse.Namespace) -> dict[str, Any]:
    import torch

    from bench.models import build

    torch.set_num_threads(1)
    model, make_batch, loss_fn = build(ns.model, 0)
    wrapped = model
    if ns.variant != "eager":
        import ortfx
        from ortfx.runtime import events

        if ns.variant == "own":
            events.session_option_edits.append(
                lambda so, training: so.add_session_config_entry("session.use_env_allocators", "0")
            )
        wrapped = ortfx.ORTModule(model, options=ortfx.Options(intra_op_threads=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    evals = 0
    later_peak = 0.0
    early_peak = 0.0  # VmHWM before it is reset (the reset also resets getrusage's ru_maxrss)
    for step in range(ns.steps):
        args, kwargs = make_batch(step)
        loss = loss_fn(wrapped(*args, **kwargs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        del loss
        if (step + 1) % ns.eval_every == 0:
            if evals == 1:  # from the second validation on: the eval export is behind us
                early_peak = _hwm_mb()
                _reset_hwm()
            wrapped.eval()
            with torch.no_grad():
                args, kwargs = make_batch(10_000 + step)
                losses.append(float(loss_fn(wrapped(*args, **kwargs))))
            wrapped.train()
            evals += 1
            if evals > 1:
                later_peak = max(later_peak, _hwm_mb())
    return {
        "variant": ns.variant,
        "rss_end_mb": _rss_mb(),
        "peak_mb": max(early_peak, _hwm_mb()),
        "peak_after_first_eval_mb": later_peak,
        "losses": losses,
    }


def run_one(ns: argparse.Namespace, variant: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "bench.eval_memory",
        "--_variant",
        variant,
        "--model",
        ns.model,
        "--steps",
        str(ns.steps),
        "--eval-every",
        str(ns.eval_every),
    ]
    out = subprocess.run(
        cmd,
        env=common.thread_env(1),
        cwd=common.ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{variant} worker failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="gpt2-4x256")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--tag", default="")
    p.add_argument("--_variant", dest="variant", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.variant:
        common.quiet()
        print(json.dumps(worker(ns)))
        return
    mach = common.machine()
    records = []
    for r in range(ns.rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            rec = run_one(ns, variant) | {"round": r}
            records.append(rec)
            print(
                f"round {r} {variant:7s} end {rec['rss_end_mb']:5.0f} MB  "
                f"peak {rec['peak_mb']:6.0f} MB  "
                f"peak after first eval {rec['peak_after_first_eval_mb']:5.0f} MB",
                flush=True,
            )
    stem = f"eval-memory-{ns.tag or common.stamp()}"
    command = "python -m bench.eval_memory " + " ".join(sys.argv[1:])
    lines = [
        f"# Training with validation between steps: resident memory ({mach['date'][:10]})",
        "",
        f"Machine: {common.describe(mach)}",
        "",
        f"Command: `{command}`",
        "",
        f"Model {ns.model}, 1 thread, AdamW, {ns.steps} steps, one eval batch (no_grad) every "
        f"{ns.eval_every}; a fresh process per (round, variant); medians (min-max) over "
        f"{ns.rounds} rounds. shared = ortfx's default (one CPU arena in ORT's environment); "
        "own = an arena per session.",
        "",
        "| variant | RSS at the end MB | peak RSS MB | peak from the 2nd validation on MB |"
        " losses equal to eager |",
        "|---|---|---|---|---|",
    ]
    eager = [rec["losses"] for rec in records if rec["variant"] == "eager"]

    def cell(values: list[float]) -> str:
        return f"{common.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"

    for variant in VARIANTS:
        recs = [rec for rec in records if rec["variant"] == variant]
        diff = max(
            abs(a - b)
            for rec in recs
            for ref in eager[:1]
            for a, b in zip(rec["losses"], ref, strict=True)
        )
        lines.append(
            f"| {variant} | {cell([rec['rss_end_mb'] for rec in recs])} "
            f"| {cell([rec['peak_mb'] for rec in recs])} "
            f"| {cell([rec['peak_after_first_eval_mb'] for rec in recs])} | max diff {diff:.1e} |"
        )
    common.RESULTS.mkdir(exist_ok=True)
    (common.RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    with open(common.RESULTS / f"{stem}.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec | {"machine": mach}) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
