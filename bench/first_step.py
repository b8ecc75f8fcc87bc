"""First-step latency with the persistent export cache: cold (empty ``cache_dir``) against warm.

    python -m bench.first_step --model gpt2-4x256 --rounds 4 --threads 1
    python -m bench.first_step --against /tmp/before   # another checkout, interleaved

Each run is a fresh process (what a user restarting a training script pays): it builds the
model, wraps it with ``Options(cache_dir=...)`` and times the first training step (forward,
loss, backward, AdamW) and the next ``--steps`` steps. Per round: one cold run on a new empty
directory, then one warm run on the directory the cold run filled; eager runs in the same
round for reference. ``setup`` = first step - median of the later steps: what the export (the
trace, the passes or their cache entry), the gradient build (or its entry) and the session
creation add to the first step. With ``--against DIR``, each round also runs the cold and warm
pair of that checkout (its own ``bench.first_step`` worker and cache directory), the two trees'
order alternating from round to round.

Results go to ``bench/results/first_step-<stamp>.{jsonl,md}``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench import common


def worker(ns: argparse.Namespace) -> dict[str, Any]:
    import torch

    from bench.models import build

    torch.set_num_threads(ns.threads)
    model, make_batch, loss_fn = build(ns.model, ns.seed)
    seen: list[str] = []
    grads: list[str] = []
    t_wrap = time.perf_counter()
    if ns.backend == "ortfx":
        import ortfx
        from ortfx.runtime import events

        events.listen(lambda name, *args: seen.append(args[0]) if name == "disk_cache" else None)
        events.listen(
            lambda name, *args: grads.append(args[0]) if name == "gradient_cache" else None
        )
        wrapped = ortfx.ORTModule(
            model, options=ortfx.Options(intra_op_threads=ns.threads, cache_dir=ns.cache_dir)
        )
    else:
        wrapped = model
    wrap_s = time.perf_counter() - t_wrap
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(1 + ns.steps):
        args, kwargs = make_batch(step)
        t0 = time.perf_counter()
        loss = loss_fn(wrapped(*args, **kwargs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())
        times.append(time.perf_counter() - t0)
    return {
        "backend": ns.backend,
        "wrap_s": wrap_s,
        "first_step_s": times[0],
        "step_s": common.median(times[1:]),
        "disk_cache": seen,
        "gradient_cache": grads,
    }


def run(
    ns: argparse.Namespace, backend: str, cache_dir: str, tree: str | None = None
) -> dict[str, Any]:
    """One fresh worker process, of this checkout or of ``tree``."""
    root = common.ROOT if tree is None else tree
    env = common.thread_env(ns.threads)
    if tree is not None:  # the other checkout's ortfx and bench, not this one's
        env["PYTHONPATH"] = tree
    cmd = [
        sys.executable, "-m", "bench.first_step", "--worker", "--backend", backend,
        "--model", ns.model, "--threads", str(ns.threads), "--steps", str(ns.steps),
        "--seed", str(ns.seed), "--cache-dir", cache_dir,
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, env=env, cwd=root, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"worker failed ({backend}, {root}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t0
    return result


def _one(
    ns: argparse.Namespace,
    f: Any,
    kind: str,
    backend: str,
    cache_dir: str | None,
    tree: str | None,
    rnd: int,
) -> dict[str, Any]:
    """One run, written to ``f`` and printed."""
    directory = cache_dir or tempfile.gettempdir()  # eager never looks at it
    r = {**run(ns, backend, directory, tree), "kind": kind, "round": rnd}
    f.write(json.dumps(r) + "\n")
    print(
        f"round {rnd} {kind:15s} first {r['first_step_s']:.3f} s  step {r['step_s']:.3f} s  "
        f"wrap {r['wrap_s']:.3f} s  cache {r['disk_cache']} {r.get('gradient_cache', '')}",
        flush=True,
    )
    return r


def parent(ns: argparse.Namespace) -> None:
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    stem = common.RESULTS / f"first_step-{ns.tag or common.stamp()}"
    mach = common.machine()
    print(common.describe(mach), flush=True)
    rows: list[dict[str, Any]] = []
    with stem.with_suffix(".jsonl").open("w") as f:
        f.write(json.dumps({"machine": mach, "argv": ns.argv}) + "\n")
        for rnd in range(ns.rounds):
            trees: list[tuple[str, str | None]] = [("", None)]
            if ns.against:
                trees.append((" (against)", ns.against))
                trees = trees if rnd % 2 == 0 else trees[::-1]
            rows.append(_one(ns, f, "eager", "eager", None, None, rnd))
            for suffix, tree in trees:
                cache_dir = tempfile.mkdtemp(prefix="ortfx-first-step-")
                try:
                    for kind in ("cold", "warm"):
                        rows.append(_one(ns, f, kind + suffix, "ortfx", cache_dir, tree, rnd))
                finally:
                    shutil.rmtree(cache_dir, ignore_errors=True)
    lines = [
        f"# First step with the persistent export cache ({mach['date'][:10]})",
        "",
        f"Machine: {common.describe(mach)}",
        "",
        f"Command: `python -m bench.first_step {' '.join(ns.argv)}`",
        "",
        f"Model {ns.model}, {ns.threads} thread(s), AdamW; a fresh process per run; per round "
        "eager, then ortfx cold (empty cache_dir), then warm (the same directory). setup = "
        f"first step - median of the next {ns.steps} steps. Medians (min-max) over {ns.rounds} "
        "rounds.",
        "",
        "| run | first step s | later step s | setup s | import ortfx + wrap s | disk cache |",
        "|---|---|---|---|---|---|",
    ]
    kinds = ["eager", "cold", "warm"]
    if ns.against:
        kinds += ["cold (against)", "warm (against)"]
        lines[4:4] = [f"Against: {ns.against}", ""]
    for kind in kinds:
        rs = [r for r in rows if r["kind"] == kind]

        def stat(vals: list[float]) -> str:
            return f"{common.median(vals):.3f} ({min(vals):.2f}-{max(vals):.2f})"

        lines.append(
            f"| {kind} | {stat([r['first_step_s'] for r in rs])} "
            f"| {stat([r['step_s'] for r in rs])} "
            f"| {stat([r['first_step_s'] - r['step_s'] for r in rs])} "
            f"| {stat([r['wrap_s'] for r in rs])} "
            f"| {rs[0]['disk_cache']} {rs[0].get('gradient_cache', '')} |"
        )
    for suffix in ("", " (against)") if ns.against else ("",):
        saved = [
            cold["first_step_s"] - warm["first_step_s"]
            for cold, warm in zip(
                (r for r in rows if r["kind"] == "cold" + suffix),
                (r for r in rows if r["kind"] == "warm" + suffix),
                strict=True,
            )
        ]
        lines.append(
            f"\nPer round, cold - warm first step{suffix}: "
            f"{', '.join(f'{d:.3f}' for d in saved)} s (median {common.median(saved):.3f} s)."
        )
    table = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(table)
    print()
    print(table)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="gpt2-4x256")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="later steps timed after the first")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="results file stem (default: date and time)")
    p.add_argument("--against", help="another checkout of ortfx, measured in the same rounds")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    ns.argv = argv
    if ns.worker:
        common.quiet()
        print(json.dumps(worker(ns)))
    else:
        parent(ns)


if __name__ == "__main__":
    main()
