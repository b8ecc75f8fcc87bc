"""One CPU arena for all of ortfx's ORT sessions in a process.

By default each ORT session owns an arena that keeps its high-water mark: a loop that validates
between training steps keeps two, the training session's and the eval graph's. ortfx registers
one CPU arena in ORT's environment (ORT's default arena settings) and points each CPU session at
it (``session.use_env_allocators``), so an eval run reuses the blocks a training run freed
(performance.md, 2026-11-26). A CPU allocator the user's code registered first serves instead;
one registered after ortfx's is refused by ORT ("already been registered"), and the user's own
sessions that ask for the environment's allocators get ortfx's arena (ORT's default settings).

An arena in ORT's environment lives as long as the process and returns nothing by itself. So
that deleting the models still gives their memory back, as a session's own arena did, ortfx
counts the sessions using it and, once the last one is collected, shrinks it from a short-lived
thread: a one-node session on the same arena runs once with ORT's
``memory.enable_memory_arena_shrinkage`` run option, which frees every region with no live block.

``ort`` is the ``onnxruntime`` module as :mod:`ortfx.runtime.session` imported it.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from typing import Any

from ortfx.errors import OrtfxWarning
from ortfx.runtime import events

USE_ENV_ALLOCATORS = "session.use_env_allocators"
SHRINK = "memory.enable_memory_arena_shrinkage"
SHRINK_DELAY = 0.2  # seconds after the last session is collected
_STEP = 0.01
REGISTER_FAILED = (
    "ortfx could not register one CPU arena for its ONNX Runtime sessions ({error}); each "
    "session keeps an arena of its own (more memory when training and evaluating in turn)"
)

# Re-entrant: a collection inside a locked block may run ``_released`` on the same thread.
_lock = threading.RLock()
_registered = False
_failed = False
_live = 0  # sessions on the shared arena not yet collected
_shrinker: list[Any] = []  # [session, run options, feed], made on the first shrink


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) starts with no lock held, no session of its own to
    count, and no shrinker: the parent's may be mid-run or hold threads that did not fork."""
    global _lock, _live
    _lock = threading.RLock()
    _live = 0
    _shrinker.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def use(so: Any, ort: Any) -> None:
    """Point the session options ``so`` at the shared arena, registering it on first use. If
    ORT refuses to register one, each session keeps its own (one WARNING)."""
    global _registered, _failed
    with _lock:
        if _failed:
            return
        if not _registered:
            info = ort.OrtMemoryInfo(
                "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
            )
            try:
                ort.create_and_register_allocator(info, ort.OrtArenaCfg({}))
            except Exception as e:
                if "already been registered" not in str(e):  # else: the user's serves
                    _failed = True
                    warnings.warn(REGISTER_FAILED.format(error=e), OrtfxWarning, stacklevel=2)
                    return
            _registered = True
    so.add_session_config_entry(USE_ENV_ALLOCATORS, "1")


def track(session: Any, so: Any, ort: Any) -> None:
    """Count ``session`` (made from ``so``) while it lives, if it uses the shared arena."""
    global _live
    try:
        if so.get_session_config_entry(USE_ENV_ALLOCATORS) != "1":
            return
    except RuntimeError:  # no such entry
        return
    with _lock:
        _live += 1
    done = weakref.finalize(session, _released, ort)
    done.atexit = False  # at exit the memory goes back anyway


def _released(ort: Any) -> None:
    global _live
    with _lock:
        _live -= 1
        if _live:
            return
    # The callback runs before the session's C++ object is destroyed, and the model's other ORT
    # tensors (its gradients) may go later in the same collection: shrinking here kept 35 of
    # 145 MB (measured). A thread shrinks a moment later instead. Not a daemon: a daemon thread
    # still inside ORT when the interpreter exits is killed mid-call, and ORT's teardown then
    # aborted the process ("terminate called without an active exception", about 1 exit in
    # 10). The interpreter waits for it; it gives up as soon as the main thread has ended.
    threading.Thread(target=_shrink_if_unused, args=(ort,), name="ortfx-arena-shrink").start()


def _exiting() -> bool:
    return not threading.main_thread().is_alive()


def _shrink_if_unused(ort: Any) -> None:
    waited = 0.0
    while waited < SHRINK_DELAY:  # short steps: an exit never waits for the whole delay
        if _exiting():
            return
        time.sleep(_STEP)
        waited += _STEP
    with _lock:
        if _exiting():
            return
        if _live:  # a new session came first: it uses the arena
            return
        try:
            _shrink(ort)
        except Exception:  # a failed shrink keeps the memory, as an arena per session did
            return
    events.emit("arena_shrunk")


def _shrink(ort: Any) -> None:
    if not _shrinker:
        import numpy as np
        import onnx
        from onnx import TensorProto, helper

        spec = [1]
        graph = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "ortfx_arena_shrink",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, spec)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, spec)],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = 8  # ORT 1.19 reads up to IR 10; onnx writes its newest
        onnx.checker.check_model(model)
        so = ort.SessionOptions()
        so.add_session_config_entry(USE_ENV_ALLOCATORS, "1")
        so.log_severity_level = 3
        so.intra_op_num_threads = 1  # one Identity node: no thread pool kept for the process
        session = ort.InferenceSession(
            model.SerializeToString(), so, providers=["CPUExecutionProvider"]
        )
        run = ort.RunOptions()
        run.add_run_config_entry(SHRINK, "cpu:0")
        _shrinker.extend([session, run, {"x": np.zeros(spec, np.float32)}])
    session, run, feed = _shrinker
    session.run(None, feed, run)
