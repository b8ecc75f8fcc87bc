"""Logging for the shell: the ``ortfx`` logger, one function per log line, the feature table.

ortfx never redirects the process's stdout or stderr (another thread's output would land in
its log): what ORT and the exporters would print is silenced at the source instead (ORT's log
severity, the dynamo exporter's ``verbose=False``, the types the PythonOp symbolic declares).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ortfx import errors
from ortfx.options import FallbackPolicy, LogLevel, Options
from ortfx.runtime import openmp

logger = logging.getLogger("ortfx")
logging.addLevelName(LogLevel.VERBOSE, "VERBOSE")
logging.addLevelName(LogLevel.DEVINFO, "DEVINFO")


def ensure_handler() -> None:
    """Give the ``ortfx`` logger a stderr handler unless the application configured logging."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("ortfx %(levelname)s: %(message)s"))
        logger.addHandler(handler)


class WrapperLog:
    """One wrapper's view of the ``ortfx`` logger, filtered by its own ``log_level``."""

    def __init__(self, level: LogLevel) -> None:
        self.level = level
        ensure_handler()

    def enabled(self, level: int) -> bool:
        return level >= self.level

    def log(self, level: int, message: str, *args: object) -> None:
        if not self.enabled(level):
            return
        if logger.level == logging.NOTSET:
            # The wrapper's log_level is the filter; an unset logger level would drop INFO.
            # A level the application set on the "ortfx" logger is respected.
            logger.setLevel(LogLevel.VERBOSE)
        logger.log(level, message, *args)


@functools.cache
def wrapper_log(level: LogLevel) -> WrapperLog:
    """The (shared, stateless) log view for one ``log_level``."""
    return WrapperLog(level)


def feature_table(options: Options, exporter: str, *, deterministic: bool) -> str:
    """Each feature ON/OFF and how to change it, for the INFO log at session creation."""
    threads = options.intra_op_threads or torch.get_num_threads()
    policy = options.fallback_policy
    rows = [
        ("Exporter", exporter, "Options(exporter=...) or ORTFX_EXPORTER"),
        (
            "Compute optimizer",
            _on(options.enable_compute_optimizer),
            "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=0/1",
        ),
        (
            "Memory optimizer",
            f"level {options.memory_opt_level}"
            + (f", config {options.memory_opt_config!r}" if options.memory_opt_config else ""),
            "ORTMODULE_MEMORY_OPT_LEVEL=0/1/2, ORTMODULE_MEMORY_OPT_CONFIG",
        ),
        (
            "Mem-efficient gradients",
            _on(options.enable_mem_efficient_grad_management),
            "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT=0/1",
        ),
        (
            "Fallback to PyTorch",
            _policy(policy),
            "Options(fallback_policy=...) or ORTMODULE_FALLBACK_POLICY",
        ),
        ("Fallback retry", _on(options.fallback_retry), "ORTMODULE_FALLBACK_RETRY=0/1"),
        (
            "Dynamic scalars",
            ", ".join(options.dynamic_scalars) or "OFF",
            "Options(dynamic_scalars=('args[1]',))",
        ),
        (
            "Save ONNX",
            _on(options.save_onnx),
            "DebugOptions(save_onnx=True, onnx_prefix=...), ORTMODULE_SAVE_ONNX_PATH",
        ),
        ("Deterministic compute", _on(deterministic), "torch.use_deterministic_algorithms(True)"),
        (
            "CPU memory arena",
            _on(options.cpu_mem_arena),
            "ORTFX_CPU_MEM_ARENA=0/1",
        ),
        (
            "Threads",
            f"{threads} intra-op, spinning {_on(options.allow_spinning)}",
            "ORTFX_INTRA_OP_THREADS, ORTFX_ALLOW_SPINNING=1",
        ),
        (
            "torch's OpenMP threads",
            openmp.describe(options, threads),
            # Measured: with several threads, torch's OpenMP workers spin after each torch op
            # and take the cores ORT's threads need (docs/performance.md).
            "Options(release_torch_threads=...), ORTFX_RELEASE_TORCH_THREADS=0/1; "
            "or OMP_WAIT_POLICY=PASSIVE before Python starts",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    lines = [f"  {n:<{width}}  {v:<{value_width}}  ({how})" for n, v, how in rows]
    return "features:\n" + "\n".join(lines)


def _policy(policy: FallbackPolicy) -> str:
    if FallbackPolicy.DISABLE in policy or not policy:
        return "OFF"
    names = [f.name or "" for f in FallbackPolicy if f in policy]
    return ", ".join(n.lower().removeprefix("unsupported_").replace("_", " ") for n in names)


def _on(value: bool) -> str:
    return "ON" if value else "OFF"


# ---- the shell's log lines: one function per kind of line ---------------------------------------


def transition(log: WrapperLog, line: str, cost: str) -> None:
    """``export: module was never exported, now called (first call) [export 0.4 s]``."""
    log.log(logging.INFO, "%s%s", line, f" [{cost}]" if cost else "")


def fallback(log: WrapperLog, flag: FallbackPolicy, reason: str, *, later: str) -> None:
    log.log(logging.WARNING, errors.FALLING_BACK, flag.name, reason, later[0].upper() + later[1:])


def traced_writes(log: WrapperLog, attributes: tuple[str, ...]) -> None:
    log.log(logging.WARNING, errors.TRACED_ATTRIBUTE_WRITES, ", ".join(attributes))


def traced_fills(log: WrapperLog, containers: tuple[str, ...]) -> None:
    log.log(logging.WARNING, errors.TRACED_CONTAINER_WRITES, ", ".join(containers))


def tracing_queries(log: WrapperLog, where: tuple[str, ...]) -> None:
    log.log(logging.WARNING, errors.TRACING_QUERIES, ", ".join(where))


def traced_hooks(log: WrapperLog, modules: tuple[str, ...]) -> None:
    log.log(logging.WARNING, errors.TRACED_FORWARD_HOOKS, ", ".join(modules))


def baked_scalars(log: WrapperLog, paths: Iterable[str]) -> None:
    baked = list(paths)
    one = len(baked) == 1
    it = "it" if one else "them"
    log.log(
        logging.WARNING,
        errors.BAKED_DYNAMIC_SCALARS,
        ", ".join(baked),
        "is" if one else "are",
        it,
        it,
        it,
    )


def guarded(log: WrapperLog, guards: Sequence[Any]) -> None:
    """Warns for values taken from tensor values (a branch on data: a graph per value); values
    taken from sizes only (specializing on shapes, as any tracer does) are said at INFO."""
    guards = sorted(guards, key=lambda g: g.origin != "data")  # stable: trace order kept
    level = logging.WARNING if guards[0].origin == "data" else logging.INFO
    shown = "; ".join(
        f"{g.kind} at {g.where} ({'tensor values' if g.origin == 'data' else 'sizes'}) "
        f"= {g.value[1]}"
        for g in guards[:4]
    )
    more = f"; and {len(guards) - 4} more" if len(guards) > 4 else ""
    log.log(level, errors.GUARDED, len(guards), shown + more)


def sizes_pinned(log: WrapperLog, sizes: tuple[tuple[int, ...], ...]) -> None:
    log.log(logging.WARNING, errors.SIZES_PINNED, list(map(list, sizes)))


def user_modes(log: WrapperLog, reason: str) -> None:
    log.log(logging.WARNING, "%s (said once per set of modes)", reason)


def empty_batch(log: WrapperLog, why: str) -> None:
    log.log(logging.INFO, "%s", why)


def exporter_switch(log: WrapperLog, error: Exception) -> None:
    log.log(logging.WARNING, errors.SWITCHING_TO_DYNAMO, error)


def compute_optimizer_failed(log: WrapperLog, failure: str) -> None:
    log.log(logging.WARNING, errors.COMPUTE_OPTIMIZER_FAILED, failure)


_RANDOM_SAID: list[bool] = []


def random_draws_said() -> bool:
    return bool(_RANDOM_SAID)


def random_draws(log: WrapperLog, ops: tuple[str, ...]) -> None:
    """Once per process: the graph's random nodes draw other values than eager's."""
    if not _RANDOM_SAID:
        _RANDOM_SAID.append(True)
        log.log(logging.WARNING, errors.RANDOM_DRAWS, ", ".join(ops))


def ops_in_torch(log: WrapperLog, ops: tuple[str, ...]) -> None:
    log.log(logging.INFO, errors.OPS_IN_TORCH, ", ".join(ops))


def checkpoint_calls(log: WrapperLog, calls: int, level: int) -> None:
    if level:
        log.log(logging.INFO, errors.CHECKPOINT_RECOMPUTED, calls, level)
    else:
        log.log(logging.WARNING, errors.CHECKPOINT_NOT_RECOMPUTED, calls)


def checkpoint_updates(log: WrapperLog, names: tuple[str, ...]) -> None:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    log.log(logging.WARNING, errors.CHECKPOINT_UPDATES_ONCE, shown)


def grad_mode_traced(log: WrapperLog, enabled: bool) -> None:
    """One line: this graph serves calls in one grad mode only."""
    mode = "enabled" if enabled else "disabled (torch.no_grad)"
    log.log(
        logging.INFO,
        "the module reads torch.is_grad_enabled() while traced: this graph serves calls with "
        "grad %s; a call in the other mode exports its own",
        mode,
    )


def grad_flags_traced(log: WrapperLog) -> None:
    """One line: this graph serves calls with the same requires_grad flags only."""
    log.log(
        logging.INFO,
        "the forward reads requires_grad of its inputs or parameters while traced: this graph "
        "serves calls with the same flags; a call with other flags exports its own",
    )


def memory_plans(
    log: WrapperLog,
    options: Options,
    report: str,
    discovered: Mapping[str, tuple[str, int]],
    plans: Iterable[Any],
    *,
    say_ignored: bool,
) -> None:
    """The recompute plans chosen for a training graph, and what the user's config missed."""
    if say_ignored:
        log.log(
            logging.WARNING,
            errors.MEMORY_CONFIG_IGNORED,
            options.memory_opt_level,
            options.memory_opt_config,
        )
    found = {c.split(",")[0].rsplit(":", 2)[0] for c in discovered}
    for plan in plans:
        if plan.cluster not in found:
            log.log(
                logging.WARNING,
                errors.MEMORY_PLAN_UNMATCHED,
                plan,
                ", ".join(sorted(discovered)) or "none",
            )
    log.log(logging.INFO, "%s", report)


def runner_ready(
    log: WrapperLog, kind: str, timings: str, options: Options, exporter: str, deterministic: bool
) -> None:
    if not log.enabled(logging.INFO):
        return
    log.log(logging.INFO, "%s session ready [one-time cost: %s]", kind, timings)
    log.log(logging.INFO, "%s", feature_table(options, exporter, deterministic=deterministic))


# ---- ONNX files (DebugOptions(save_onnx=True)) --------------------------------------------------


def save_prefix(options: Options) -> str | None:
    """Where this wrapper's ONNX files go (``None``: not saved)."""
    if not options.save_onnx:
        return None
    return os.path.join(options.save_path or os.getcwd(), options.onnx_prefix)


def save_onnx(prefix: str | None, stage: str, mode: str, model: bytes) -> None:
    """Write one stage's graph as ``{prefix}_{stage}_{mode}.onnx``."""
    if prefix:
        with open(f"{prefix}_{stage}_{mode}.onnx", "wb") as f:
            f.write(model)


def version_returned(log: WrapperLog, left: Any, back: Any, cause: str) -> None:
    log.log(
        logging.INFO,
        "module version %d -> %d: %s, and everything the graphs of version %d read is as it "
        "was then; they serve again",
        left.number,
        back.number,
        cause,
        back.number,
    )


def restricted_backwards(log: WrapperLog) -> None:
    """Memory-efficient gradients cannot see a backward restricted to parameters: said with
    each training graph, since no ortfx code runs in such a call to say it then."""
    log.log(
        logging.WARNING,
        "memory-efficient gradients are on: a backward asking only for this module's "
        "parameters (loss.backward(inputs=[p]), torch.autograd.grad(loss, [p], "
        "allow_unused=True)) gives them no gradient, where PyTorch gives one (said once per "
        "training graph); turn Options(enable_mem_efficient_grad_management=False) for such "
        "calls",
    )
