"""torch's idle OpenMP threads, released while ORT runs.

torch's CPU builds run their parallel ops on OpenMP (GNU libgomp on Linux). After each parallel
op the runtime's worker threads spin, by default for milliseconds (measured here: about 8 ms of
CPU after one op), waiting for the next. ORT's own intra-op threads then share their cores with
spinning threads that have nothing to do: on 2 cores the MLP trained 20 % slower than eager
(docs/performance.md). Eager does not suffer, since its next op reuses the spinners.

Before each ORT run, and after each torch callback inside one (ATen nodes, PythonOps), ortfx
asks the OpenMP runtime to release the calling thread's workers (OpenMP 5.0's
``omp_pause_resource_all(omp_pause_soft)``; about 35 µs). torch creates them again at its next
parallel op (about 50 µs). Nothing else changes: values, thread counts and torch's settings stay
as they were. ``Options(release_torch_threads=False)`` turns it off.

The runtime is found through torch's own CPU library (``libtorch_cpu``), so the symbol belongs to
the copy torch uses, not to another OpenMP library in the process. Not found (no OpenMP backend,
a runtime older than OpenMP 5.0, another platform): nothing is released and the feature table
says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ortfx.options import Options

_PAUSE_SOFT = 1  # omp_pause_soft in omp.h (OpenMP 5.0)

_LOCAL = threading.local()
RELEASED = "released while ORT runs"  # the feature table's value when runs release them


@functools.cache
def _pause_function() -> Callable[[int], int] | None:
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None  # torch's own thread pool sleeps on a condition variable: nothing spins
    no_load = getattr(os, "RTLD_NOLOAD", None)
    if no_load is None:
        return None
    for library in sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*")):
        try:
            handle = ctypes.CDLL(str(library), mode=no_load)
        except OSError:
            continue
        # dlsym on torch's library resolves through its dependencies: torch's OpenMP runtime.
        pause = getattr(handle, "omp_pause_resource_all", None)
        if pause is not None:
            pause.argtypes = [ctypes.c_int]
            pause.restype = ctypes.c_int
            return pause  # type: ignore[no-any-return]
    return None


def available() -> bool:
    """Whether torch's OpenMP runtime can release its threads (OpenMP 5.0 pause found)."""
    return _pause_function() is not None


def passive() -> bool:
    """``OMP_WAIT_POLICY=PASSIVE``: torch's workers sleep at once, there is nothing to release."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def wanted(options: Options, ort_threads: int) -> bool:
    """Whether runs of a session with ``ort_threads`` intra-op threads release torch's threads.

    With one ORT thread, spinning workers only take cores ORT does not use, so the release
    (and torch's re-creation of its workers) would be pure cost.
    """
    return describe(options, ort_threads) == RELEASED


def describe(options: Options, ort_threads: int) -> str:
    """The feature table's value for this setting."""
    if not options.release_torch_threads:
        return "spinning (release off)"
    if passive():
        return "sleeping (OMP_WAIT_POLICY=PASSIVE)"
    if not available():
        return "spinning (no OpenMP 5.0 runtime found to release them)"
    if ort_threads <= 1 or torch.get_num_threads() <= 1:
        return "spinning (one thread: nothing to release)"
    return RELEASED


@contextlib.contextmanager
def released() -> Iterator[None]:
    """Release torch's idle workers now, and after each torch callback until the run ends."""
    pause = _pause_function()
    assert pause is not None, "released() needs available()"
    previous = getattr(_LOCAL, "running", False)
    # -1 means "inside a parallel region": nothing was released, which is harmless.
    pause(_PAUSE_SOFT)
    _LOCAL.running = True
    try:
        yield
    finally:
        _LOCAL.running = previous


def after_callback() -> None:
    """Called by torch code that ORT runs (ATen nodes, PythonOps): the workers that code woke
    would spin through the rest of ORT's run."""
    if getattr(_LOCAL, "running", False):
        pause = _pause_function()
        if pause is not None:
            pause(_PAUSE_SOFT)
