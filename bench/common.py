"""Helpers shared by the bench scripts: machine description, threads, memory, statistics."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import resource
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent


def quiet() -> None:
    """Silence deprecation noise from torch.onnx / transformers in the bench output."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*TorchScript.*")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except Exception:  # pragma: no cover - transformers is optional for the MLP
        pass


def thread_env(threads: int) -> dict[str, str]:
    """Environment for a worker process: the OpenMP/MKL pools sized before torch imports."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def peak_rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024.0  # kilobytes on Linux


def current_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_isa() -> str:
    """The widest x86 vector extension the CPU reports: the same model name ("AMD EPYC") has
    come with and without AVX-512 here, and MLAS against MKL depends on it (performance.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    names = {"avx512f": "AVX-512", "avx2": "AVX2", "avx": "AVX"}
                    return next((n for f, n in names.items() if f in flags), "no AVX")
    except OSError:
        pass
    return platform.machine() or "unknown"


def git_commit() -> str:
    """The checked-out commit, read from .git without running git."""
    try:
        git = ROOT / ".git"
        common_dir = git
        if git.is_file():  # a worktree: HEAD in its own git dir, refs in the common one
            git = Path(git.read_text().split("gitdir:", 1)[1].strip())
            common_dir = (git / (git / "commondir").read_text().strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            path = common_dir / ref
            if path.exists():
                return path.read_text().strip()[:12]
            packed = common_dir / "packed-refs"
            for line in packed.read_text().splitlines():
                if line.endswith(ref):
                    return line.split()[0][:12]
            return "unknown"
        return head[:12]
    except OSError:
        return "unknown"


def machine() -> dict[str, Any]:
    import onnxruntime
    import torch

    try:
        import transformers

        hf = transformers.__version__
    except Exception:  # pragma: no cover
        hf = "absent"
    try:
        with open("/proc/meminfo") as f:
            mem_kb = int(f.readline().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kb = 0
    return {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "isa": cpu_isa(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gb": round(mem_kb / 1024 / 1024, 1),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "transformers": hf,
        "commit": git_commit(),
    }


def describe(m: dict[str, Any]) -> str:
    return (
        f"{m['date']} | {m['cpu']} ({m.get('isa', '?')}), "
        f"{m['cores']} cores ({m['usable_cores']} usable), "
        f"{m['memory_gb']} GB | load {m['loadavg']} | python {m['python']}, torch {m['torch']}, "
        f"onnxruntime {m['onnxruntime']}, transformers {m['transformers']} | commit {m['commit']}"
    )


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def stamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M")
