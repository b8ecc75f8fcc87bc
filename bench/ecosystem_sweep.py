"""The libraries around a training loop, each through ortfx against the same script in eager.

    python -m bench.ecosystem_sweep [--only CASE,...] [--steps 6] [--threads 1] [--out DIR]

The cases (``bench/ecosystem_cases.py``; ``--only`` takes their names) each run in a process
of their own, so a crash in one cannot end the sweep: PEFT's LoRA wrapped both ways,
transformers' ``Trainer`` against ``ortfx.hf.ORTTrainer`` and ``ORTSeq2SeqTrainer``,
accelerate, timm and torchvision models, Lightning, and train-then-deploy through
``ortfx.export_for_inference``. ortfx runs with its default options: fallback allowed, so a
call that falls back shows in the row instead of raising.

Per case: where the calls ran (ORT, or PyTorch and why, from ``ortfx.stats`` and the WARNING
ortfx logs; a fallback nobody expected, or one not logged, fails the row), exports, and checks
against eager, each with its tolerance; step times (eager and ortfx alternating in one process,
the median of the steps after the first ``WARMUP``); the wall time of the case's process.
Writes ``<out>/ecosystem_sweep-<date>.md`` and ``.jsonl`` and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib
import importlib.metadata
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench import common
from bench.ecosystem_cases import CASES, NOISE, NOISE_COPIES, NOISE_FACTOR, Probe, tolerance
from bench.hf_sweep import run_one

WARMUP = 2  # steps left out of the step times: the exporting step and the one after it
FALLING_BACK = "falling back to PyTorch"  # ortfx's WARNING (ortfx.errors.FALLING_BACK)


@contextlib.contextmanager
def _ortfx_warnings(into: list[str]) -> Iterator[None]:
    """ortfx's WARNING lines (and worse) while the case runs."""

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            into.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("ortfx")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _where(probe: Probe) -> tuple[str, int]:
    """("ORT (n calls)" or "PyTorch for k/n calls: why", exports), after adding the checks
    that the calls fell back only if expected, and that a fallback was logged."""
    import ortfx

    counters = [ortfx.stats(w) for w in probe.wrappers]
    calls = sum(s.calls for s in counters)
    fell = sum(s.fallback_calls for s in counters)
    said = [w for w in probe.warnings if FALLING_BACK in w]
    if probe.expect_fallback:
        probe.holds("falls back", fell > 0, f"{fell} of {calls} calls in PyTorch")
        probe.holds("one WARNING", len(said) == 1, f"{len(said)} '{FALLING_BACK}'")
    else:
        probe.holds("calls in ORT", calls > 0 and fell == 0, f"{calls - fell}/{calls}")
        if fell:
            probe.holds("fallback logged", bool(said), f"{len(said)} WARNING(s)")
    if fell:
        why = next((s.fallback for s in counters if s.fallback), None) or (said or ["?"])[0]
        return f"PyTorch for {fell}/{calls} calls: {why}", sum(s.exports for s in counters)
    return f"ORT ({calls} calls)", sum(s.exports for s in counters)


def run_case(name: str, steps: int) -> dict[str, Any]:
    """One case in this process: its row (a failure, whatever it is, recorded as FAIL)."""
    library, case = CASES[name]
    probe = Probe()
    start = time.perf_counter()
    row: dict[str, Any] = {"case": name, "library": library, "version": version(library)}
    with _ortfx_warnings(probe.warnings):
        try:
            case(probe, steps)
        except Exception as error:  # the sweep reports every failure
            text = str(error).strip().splitlines()[0] if str(error).strip() else ""
            row["error"] = f"{type(error).__name__}: {text}"[:300]
            row["trace"] = traceback.format_exc()[-2000:]
        row["ran_in"], row["exports"] = _where(probe) if probe.wrappers else ("-", 0)
    row["checks"] = []
    for what, entry in probe.numbers.items():
        tol, by_noise = tolerance(entry)
        row["checks"].append({"what": what, **entry, "tol": tol, "tol_from_noise": by_noise})
    row["facts"], row["notes"], row["warnings"] = probe.facts, probe.notes, probe.warnings
    for side, times in probe.times.items():
        kept = times[WARMUP:] if len(times) > WARMUP else times
        row[f"{side}_ms"] = common.median(kept) * 1e3 if kept else None
        row[f"{side}_steps_timed"] = len(kept)
    row["case_s"] = time.perf_counter() - start
    passed = (
        all(c["diff"] <= c["tol"] for c in row["checks"])
        and all(f["ok"] for f in probe.facts)
        and "error" not in row
    )
    row["result"] = "PASS" if passed else "FAIL"
    return row


def _child(name: str, *, steps: int, threads: int) -> dict[str, Any]:
    """A case in the process ``run_one`` started for it."""
    import torch

    torch.set_num_threads(threads)
    common.quiet()
    return run_case(name, steps)


def version(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:  # onnxruntime-training-cpu, say
        return str(importlib.import_module(library).__version__)


# ---- the table ----------------------------------------------------------------------------------


def _cell(row: dict[str, Any]) -> str:
    parts = []
    for c in row.get("checks", []):
        ok = c["diff"] <= c["tol"]
        text = f"{c['what']} {c['diff']:.1e} {'≤' if ok else '>'} {c['tol']:.1e}"
        if c.get("noise") is not None:
            factor = f"{NOISE_FACTOR:g}×" if c["tol_from_noise"] else ""
            text += f" ({factor}noise {c['noise']:.1e})"
        parts.append(text if ok else f"**{text}**")
    for f in row.get("facts", []):
        text = f"{f['what']}: {f['detail']}" if f["detail"] else f["what"]
        parts.append(text if f["ok"] else f"**{text}: no**")
    if "error" in row:
        parts.append(f"**{row['error']}**")
    parts.extend(row.get("notes", []))
    return "; ".join(parts).replace("|", "/")


def _ran_in(row: dict[str, Any]) -> str:
    text = str(row.get("ran_in", ""))
    return (text if len(text) <= 160 else text[:157] + "...").replace("|", "/")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


COLUMNS = (
    "library", "case", "ran in", "exports", "checks against eager: max abs diff ≤ tolerance",
    "eager ms/step", "ortfx ms/step", "wall s", "result",
)  # fmt: skip


def _cells(row: dict[str, Any]) -> list[str]:
    return [
        f"{row['library']} {row.get('version', '')}", row["case"], _ran_in(row),
        str(row.get("exports", "")), _cell(row), _ms(row.get("eager_ms")),
        _ms(row.get("ortfx_ms")), f"{row.get('wall_s', 0.0):.1f}",
        row["result"] if row["result"] == "PASS" else "**FAIL**",
    ]  # fmt: skip


def render(rows: Sequence[dict[str, Any]]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    return "\n".join([line(COLUMNS), line(["---"] * len(COLUMNS)), *map(line, map(_cells, rows))])


HOW_TO_READ = f"""\
Each case runs in a process of its own, {{steps}} steps, {{threads}} thread(s) for torch and \
ONNX Runtime, ortfx's default options (fallback allowed: a call that falls back shows in "ran \
in"). A check is the largest absolute difference from eager over every element and step, \
against `atol + rtol * max|eager|`. The vision cases also train {NOISE_COPIES} eager copies \
with weights scaled by `1 + {NOISE:g} * N(0, 1)`; "noise" is their largest difference from \
eager (float32's rounding, as that model and its steps amplify it), and a check also passes \
within {NOISE_FACTOR:g}× the noise ("{NOISE_FACTOR:g}×noise" marks the checks where that is \
the tolerance; bench/ecosystem_cases.py says why: a ReLU input within rounding of 0). Step \
times: the median of the {{timed}} steps after the first {WARMUP} (which export), eager and \
ortfx alternating in one process; the models are tiny, so the times are per-step overhead, \
not kernels. Wall: the case's process, imports included."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated cases: " + ", ".join(CASES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    a = parser.parse_args()
    names = [n for n in a.only.split(",") if n] or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    os.environ.update(common.thread_env(a.threads))  # the case processes inherit these
    os.environ["HF_HUB_OFFLINE"] = "1"
    host = common.describe(common.machine())
    print(host, flush=True)
    rows = []
    started = time.perf_counter()
    for name in names:
        start = time.perf_counter()
        row = run_one(name, a.timeout, functools.partial(_child, steps=a.steps, threads=a.threads))
        row = {"case": name, "library": CASES[name][0], "result": "FAIL", **row}
        row["wall_s"] = time.perf_counter() - start
        print(json.dumps({k: row[k] for k in ("case", "result", "wall_s")}), flush=True)
        rows.append(row)
    total = time.perf_counter() - started
    libraries = ("peft", "accelerate", "timm", "torchvision", "lightning")
    passed = sum(r["result"] == "PASS" for r in rows)
    text = "\n".join([
        f"# Libraries around training, through ortfx against eager ({datetime.date.today()})",
        "",
        f"`python -m bench.ecosystem_sweep {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        "",
        f"Host: {host}; " + ", ".join(f"{p} {version(p)}" for p in libraries) + ".",
        "",
        f"{passed}/{len(rows)} cases pass; the sweep took {total:.0f} s.",
        "",
        HOW_TO_READ.format(steps=a.steps, threads=a.threads, timed=max(a.steps - WARMUP, 1)),
        "",
        render(rows),
        "",
    ])  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / f"ecosystem_sweep-{datetime.date.today():%Y%m%d}.md"
    out.write_text(text)
    out.with_suffix(".jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    print(render(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
