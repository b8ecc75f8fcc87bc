"""Layer-wise recompute: memory-optimizer plans, their configuration, selection and report.

Pure: parsing, choosing plans per level and evaluating ORT's saving estimates need no ORT.

A plan string is ``cluster:type:count``: the cluster id ORT reports (``Gelu+``,
``FusedMatMul+Add+``), the recompute type (0 off, 1 recompute, 2 recompute with compromise:
recompute that also costs precision or more compute), and how many occurrences to apply (-1 all).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs

PLAN_FORM = "'cluster:type:count', e.g. 'Gelu+:1:-1'"

MALFORMED_PLAN = (
    "memory optimizer config entry {entry!r} is not a plan: expected " + PLAN_FORM + " where "
    "type is 0, 1 or 2 and count is -1 (all) or a non-negative int{where}."
)


@attrs.frozen
class Plan:
    """One recompute plan: a cluster of nodes, a recompute type, and how many to apply."""

    cluster: str
    recompute_type: int
    count: int

    def __str__(self) -> str:
        return f"{self.cluster}:{self.recompute_type}:{self.count}"

    @classmethod
    def parse(cls, entry: str, *, where: str = "") -> Plan:
        # Exactly three fields, as ORT splits them; cluster ids never hold a colon.
        parts = [p.strip() for p in entry.split(":")]
        try:
            cluster, kind, count = parts[0], int(parts[1]), int(parts[2])
        except (IndexError, ValueError):
            raise ValueError(MALFORMED_PLAN.format(entry=entry, where=where)) from None
        if len(parts) != 3 or not cluster or kind not in (0, 1, 2) or count < -1:
            raise ValueError(MALFORMED_PLAN.format(entry=entry, where=where))
        return cls(cluster, kind, count)


def parse_config(config: str) -> tuple[Plan, ...]:
    """Plans from either form users have: a path to a JSON list of plan strings (upstream
    1.19.2) or an inline comma-separated string (the earlier documented form)."""
    config = config.strip()
    if not config:
        return ()
    if os.path.isfile(config):
        where = f" (in {config})"
        try:
            with open(config) as f:
                entries = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"memory optimizer config file {config!r} is not JSON ({e}); expected a JSON "
                f'list of plan strings such as ["Gelu+:1:-1"].'
            ) from None
        if not isinstance(entries, list):
            raise ValueError(
                f"memory optimizer config file {config!r} must hold a JSON list of plan strings "
                f'such as ["Gelu+:1:-1"], got a JSON {type(entries).__name__}.'
            )
        for i, entry in enumerate(entries):
            if not isinstance(entry, str):
                raise ValueError(
                    f"memory optimizer config file {config!r}: entry {i} ({entry!r}) is a "
                    f"{type(entry).__name__}, not a plan string; expected {PLAN_FORM}."
                )
    elif config.endswith(".json"):
        raise ValueError(
            f"memory optimizer config file {config!r} does not exist; pass an existing JSON "
            "file or inline plans such as 'Gelu+:1:-1,FusedMatMul+:1:12'."
        )
    else:
        where, entries = "", [config]
    # A JSON entry may itself combine several plans with commas, as ORT reports them.
    return tuple(
        Plan.parse(part, where=where) for entry in entries for part in entry.split(",") if part
    )


@attrs.frozen
class MemoryPlan:
    """One discovered recompute opportunity, as ``ortfx.memory_report(model)`` returns it."""

    cluster_id: str  # as ORT reports it, e.g. "Gelu+:1:-1"
    enabled: bool
    config: str  # the plan string that turns it on
    frequency: int  # how many times the pattern occurs in the graph
    saving_bytes: int | None  # estimated activation bytes saved per step at the current sizes
    saving_expression: str  # ORT's symbolic estimate


def _plan_types(cluster_id: str) -> list[tuple[str, int]]:
    found = []
    for part in cluster_id.split(","):
        plan = Plan.parse(part)
        found.append((str(plan), plan.recompute_type))
    return found


def select(
    discovered: Mapping[str, tuple[str, int]], level: int, plans: tuple[Plan, ...]
) -> tuple[str, ...]:
    """The plan strings to hand ORT: per level, or the user's plans at level 0."""
    if level == 0:
        return tuple(str(p) for p in plans)
    wanted = (1,) if level == 1 else (1, 2)
    chosen: list[str] = []
    for cluster_id in discovered:
        chosen.extend(s for s, t in _plan_types(cluster_id) if t in wanted)
    return tuple(chosen)


def report(
    discovered: Mapping[str, tuple[str, int]],
    enabled: tuple[str, ...],
    dims: Mapping[str, int],
) -> tuple[MemoryPlan, ...]:
    """Frozen report rows, largest estimated saving first."""
    on_clusters = {s.rsplit(":", 2)[0] for s in enabled}
    rows = []
    for cluster_id, (expression, frequency) in discovered.items():
        cluster = cluster_id.split(",")[0].rsplit(":", 2)[0]
        saving = evaluate(expression, dims)
        rows.append(
            MemoryPlan(
                cluster_id=cluster_id,
                enabled=cluster in on_clusters,
                config=cluster_id,
                frequency=frequency,
                saving_bytes=None if saving is None else int(saving),
                saving_expression=expression,
            )
        )
    return tuple(sorted(rows, key=lambda r: -(r.saving_bytes or 0)))


def render(rows: tuple[MemoryPlan, ...], level: int) -> str:
    """The INFO table of plans."""
    if not rows:
        return "memory optimizer: no recompute opportunity found in this graph"
    head = f"memory optimizer (level {level}): plans found in this graph"
    lines = [head, f"  {'plan':<48} {'status':<6} {'freq':>4} {'saved/step':>12}"]
    for r in rows:
        saved = "?" if r.saving_bytes is None else _bytes(r.saving_bytes)
        status = "ON" if r.enabled else "OFF"
        lines.append(f"  {r.config:<48} {status:<6} {r.frequency:>4} {saved:>12}")
    lines.append(
        "  turn a plan on with ORTMODULE_MEMORY_OPT_CONFIG='<plan>' (level 0), or all "
        "layer-wise plans with ORTMODULE_MEMORY_OPT_LEVEL=1"
    )
    return "\n".join(lines)


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} GiB"


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "floor": math.floor,
    "ceiling": math.ceil,
    "ceil": math.ceil,
    "Max": max,
    "Min": min,
    "max": max,
    "min": min,
}


def evaluate(expression: str, dims: Mapping[str, int]) -> float | None:
    """Evaluate ORT's symbolic saving at concrete sizes; None if a symbol is unknown.

    Only arithmetic, a few functions and the names in ``dims`` are allowed (no ``eval``).
    """

    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in dims:
                raise KeyError(node.id)
            return dims[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCTIONS
        ):
            return _FUNCTIONS[node.func.id](*(walk(a) for a in node.args))
        raise ValueError(ast.dump(node))

    try:
        return float(walk(ast.parse(expression, mode="eval")))
    except (KeyError, ValueError, SyntaxError, ZeroDivisionError, TypeError):
        return None
