"""Merge the activation summaries of a PyTorch run and an ortfx run, and find the first divergence.

    python -m ortfx.hooks.merge_activation_summary --pt_dir A --ort_dir B --output_dir C \\
        [--overwrite] [--rtol 1e-4] [--atol 1e-6]

Writes into ``C``:

* ``merge_pt/step_<n>_.txt`` and ``merge_ort/step_<n>_.txt``: each step's summaries concatenated
  in the order of the PyTorch run's ``order.txt`` for that step, so the two files line up in a
  side-by-side diff;
* ``divergence.txt``: the first step, and in it the first activation in PyTorch's execution
  order, whose summaries differ beyond the tolerance, with both values;
* ``divergence.png``: the relative difference per activation (rows, execution order) per step
  (columns).
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs

from ortfx.errors import OUTPUT_DIR_EXISTS, OrtfxError, OrtfxOutputExistsError
from ortfx.hooks.summary import (
    FLOAT_FIELDS,
    Summary,
    differences,
    parse,
    relative_difference,
)

DEFAULT_RTOL = 1e-4
DEFAULT_ATOL = 1e-6

NO_STEPS = (
    "{path} holds no step_<n> folders written by a StatisticsSubscriber. Check the path; if it "
    "is the output_dir of an ortfx run, the run recorded nothing: the steps were outside "
    "[start_step, end_step), or this ortfx cannot run autograd Functions inside the ORT graph "
    "(the PythonOp bridge), so the in-graph statistics never ran."
)

_STEP = re.compile(r"step_(\d+)")


class OrtfxSummaryError(OrtfxError, ValueError):
    """A summary directory is missing or malformed."""


@attrs.frozen
class Run:
    """One run's summaries: step -> (names in execution order, name -> summary text)."""

    steps: dict[int, tuple[tuple[str, ...], dict[str, str]]]

    @classmethod
    def load(cls, path: Path) -> Run:
        if not path.is_dir():
            raise OrtfxSummaryError(f"{path} is not a directory")
        steps: dict[int, tuple[tuple[str, ...], dict[str, str]]] = {}
        for folder in path.iterdir():
            match = _STEP.fullmatch(folder.name)
            if not (match and folder.is_dir()):
                continue
            order_file = folder / "order.txt"
            order = (
                tuple(order_file.read_text(encoding="utf-8").split()) if order_file.exists() else ()
            )
            texts = {
                n: (folder / n).read_text(encoding="utf-8") for n in order if (folder / n).exists()
            }
            steps[int(match.group(1))] = (order, texts)
        if not steps:
            raise OrtfxSummaryError(NO_STEPS.format(path=path))
        return cls(dict(sorted(steps.items())))


@attrs.frozen
class Divergence:
    """The first activation whose summaries differ beyond the tolerance."""

    step: int
    name: str
    fields: tuple[str, ...]
    pytorch: Summary
    ortfx: Summary


@attrs.frozen
class Comparison:
    """Everything the merge found: the divergence (or None), what was compared and missing."""

    divergence: Divergence | None
    steps: tuple[int, ...]  # compared: present in both runs
    names: tuple[str, ...]  # every activation, in first-seen PyTorch execution order
    relative: dict[tuple[int, str], float]  # (step, name) -> relative difference
    missing_in_ortfx: tuple[tuple[int, str], ...]
    only_in_ortfx: tuple[tuple[int, str], ...]
    steps_only_in_one: tuple[int, ...]
    rtol: float
    atol: float


def compare(pt: Run, ort: Run, /, *, rtol: float, atol: float) -> Comparison:
    """Compare the runs step by step in PyTorch's execution order; pure."""
    steps = tuple(s for s in pt.steps if s in ort.steps)
    names: dict[str, None] = {}
    relative: dict[tuple[int, str], float] = {}
    missing: list[tuple[int, str]] = []
    extra: list[tuple[int, str]] = []
    first: Divergence | None = None
    for step in steps:
        order, pt_texts = pt.steps[step]
        ort_order, ort_texts = ort.steps[step]
        extra += [(step, n) for n in ort_order if n not in pt_texts]
        for name in order:
            names.setdefault(name)
            if name not in ort_texts:
                missing.append((step, name))
                continue
            a, b = parse(pt_texts[name]), parse(ort_texts[name])
            relative[(step, name)] = relative_difference(a, b)
            fields = differences(a, b, rtol=rtol, atol=atol)
            if fields and first is None:
                first = Divergence(step, name, fields, a, b)
    one_sided = tuple(sorted(set(pt.steps) ^ set(ort.steps)))
    return Comparison(
        first, steps, tuple(names), relative, tuple(missing), tuple(extra), one_sided, rtol, atol
    )


def report(comparison: Comparison, /) -> str:
    """The text of ``divergence.txt``."""
    c = comparison
    tolerance = f"rtol={c.rtol:g}, atol={c.atol:g}"
    lines = []
    d = c.divergence
    if d is None:
        lines.append(
            f"no divergence beyond {tolerance}: {len(c.steps)} steps, {len(c.relative)} "
            "summaries compared"
        )
    else:
        lines += [
            f"first divergence: step {d.step}, activation {d.name}",
            f"differing: {', '.join(d.fields)} (beyond {tolerance})",
            "",
            f"{'field':<8}{'pytorch':>26}{'ortfx':>26}{'abs diff':>14}",
        ]
        for field in attrs.fields(Summary):
            a, b = getattr(d.pytorch, field.name), getattr(d.ortfx, field.name)
            diff = f"{abs(a - b):.3g}" if field.name in FLOAT_FIELDS else ""
            mark = " <" if field.name in d.fields else ""
            lines.append(f"{field.name:<8}{a!s:>26}{b!s:>26}{diff:>14}{mark}")
    lines.append("")
    lines.append(f"steps compared: {_ranges(c.steps)}")
    if c.steps_only_in_one:
        lines.append(f"steps in only one run (not compared): {_ranges(c.steps_only_in_one)}")
    for title, items in (
        (
            "in PyTorch, missing in ortfx (pruned from the graph, or not recorded)",
            c.missing_in_ortfx,
        ),
        ("in ortfx only (not compared)", c.only_in_ortfx),
    ):
        if items:
            lines.append(f"{title}: {len(items)}")
            lines += [f"  step {s}: {n}" for s, n in items[:20]]
            if len(items) > 20:
                lines.append(f"  ... and {len(items) - 20} more")
    return "\n".join(lines) + "\n"


def _ranges(steps: Sequence[int]) -> str:
    if not steps:
        return "none"
    return f"{len(steps)} ({steps[0]}..{steps[-1]})"


def merged_text(run: Run, step: int, order: Sequence[str]) -> str:
    """One step's summaries in ``order``, each followed by a blank line; absent ones skipped."""
    texts = run.steps[step][1]
    return "".join(texts[name] + "\n" for name in order if name in texts)


def plot(comparison: Comparison, path: Path, /) -> None:
    """Relative difference per activation (rows) per step (columns), log scale, first divergence
    boxed; missing summaries grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    c = comparison
    grid = np.full((max(len(c.names), 1), max(len(c.steps), 1)), np.nan)
    row = {n: i for i, n in enumerate(c.names)}
    col = {s: j for j, s in enumerate(c.steps)}
    floor = 1e-9
    for (step, name), value in c.relative.items():
        grid[row[name], col[step]] = math.log10(max(min(value, 1e3), floor))
    height = min(2 + 0.18 * len(c.names), 40)
    fig, ax = plt.subplots(figsize=(min(4 + 0.3 * len(c.steps), 30), height))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="lightgrey")
    image = ax.imshow(
        grid, aspect="auto", cmap=cmap, vmin=math.log10(floor), vmax=0.0, interpolation="nearest"
    )
    fig.colorbar(image, ax=ax, label="log10 relative difference (min, max, mean, std)")
    ax.set_xlabel("step")
    ax.set_ylabel("activation (PyTorch execution order)")
    ax.set_xticks(
        range(len(c.steps)), [str(s) for s in c.steps], rotation=90 if len(c.steps) > 20 else 0
    )
    if len(c.names) <= 80:
        ax.set_yticks(range(len(c.names)), list(c.names), fontsize=6)
    d = c.divergence
    if d is not None:
        y, x = row[d.name], col[d.step]
        ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", lw=2))
        ax.set_title(f"first divergence: step {d.step}, {d.name}", fontsize=9)
    else:
        ax.set_title(f"no divergence beyond rtol={c.rtol:g}, atol={c.atol:g}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def merge(
    pt_dir: Path | str,
    ort_dir: Path | str,
    output_dir: Path | str,
    *,
    overwrite: bool = False,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
) -> Comparison:
    """Write the merged files, ``divergence.txt`` and ``divergence.png``; return the comparison."""
    out = Path(output_dir)
    if out.exists():
        if not overwrite:
            raise OrtfxOutputExistsError(OUTPUT_DIR_EXISTS.format(path=out, fix="pass --overwrite"))
        shutil.rmtree(out)
    pt, ort = Run.load(Path(pt_dir)), Run.load(Path(ort_dir))
    comparison = compare(pt, ort, rtol=rtol, atol=atol)
    for label, run in (("merge_pt", pt), ("merge_ort", ort)):
        folder = out / label
        folder.mkdir(parents=True)
        for step in run.steps:
            # PyTorch's order for this step; a step PyTorch did not record keeps its own.
            order = pt.steps[step][0] if step in pt.steps else run.steps[step][0]
            (folder / f"step_{step}_.txt").write_text(
                merged_text(run, step, order), encoding="utf-8"
            )
    (out / "divergence.txt").write_text(report(comparison), encoding="utf-8")
    plot(comparison, out / "divergence.png")
    return comparison


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ortfx.hooks.merge_activation_summary",
        description="Merge the StatisticsSubscriber summaries of a PyTorch and an ortfx run and "
        "name the first step and activation where they diverge.",
    )
    parser.add_argument("--pt_dir", required=True, help="output_dir of the PyTorch run")
    parser.add_argument("--ort_dir", required=True, help="output_dir of the ortfx run")
    parser.add_argument("--output_dir", required=True, help="where to write (must not exist)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output_dir")
    parser.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="relative tolerance")
    parser.add_argument("--atol", type=float, default=DEFAULT_ATOL, help="absolute tolerance")
    args = parser.parse_args(argv)
    try:
        comparison = merge(
            args.pt_dir,
            args.ort_dir,
            args.output_dir,
            overwrite=args.overwrite,
            rtol=args.rtol,
            atol=args.atol,
        )
    except OrtfxError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(report(comparison).splitlines()[0])
    out = Path(args.output_dir)
    print(f"written: {out / 'divergence.txt'}, divergence.png, merge_pt/, merge_ort/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
