"""Logging for the shell: the ``ortfx`` logger, captured native output, the feature table."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

import torch

from ortfx.options import FallbackPolicy, LogLevel, Options

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


@contextlib.contextmanager
def captured(log: WrapperLog, what: str) -> Iterator[None]:
    """Capture stdout/stderr, native writes included (ORT and the exporter print from C++).

    The text is logged at VERBOSE, and attached as a note to an exception the block raises.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(1), os.dup(2)
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        text_sink = open(sink.fileno(), "w", closefd=False)  # noqa: SIM115 - closed below
        error: BaseException | None = None
        try:
            with contextlib.redirect_stdout(text_sink), contextlib.redirect_stderr(text_sink):
                yield
        except BaseException as e:
            error = e
            raise
        finally:
            text_sink.close()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sink.seek(0)
            text = sink.read().decode(errors="replace").strip()
            if text:
                log.log(LogLevel.VERBOSE, "output of %s:\n%s", what, text)
                if error is not None:
                    # Shown with the traceback if the error reaches the user; a fallback that
                    # catches it keeps the (often long) dump out of the log.
                    error.add_note(f"output of {what}:\n{text}")


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
