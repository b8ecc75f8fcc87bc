"""Test seams by design (JAX's ``test_event``): the shell announces what it does, and tests and
benchmarks listen, instead of patching private names. Without a listener an event costs one
list check; none is emitted on the steady-state fast path.

Events: ``("decide", call, decision)`` for every call that took the slow path,
``("export", info)`` with the processed graph of every export, and
``("session", kind, runner)`` for every ORT session opened (``kind`` is "training" or
"inference").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

_listeners: list[Callable[..., None]] = []

# Adjustment seams for benchmarks (measuring a setting or a pass without changing ortfx): each
# edit gets every ORT SessionOptions ortfx makes, with whether it is for training; each pass is
# appended to the session pipeline (``ortfx.passes.for_session``). Empty in normal use.
session_option_edits: list[Callable[[Any, bool], None]] = []
session_passes: list[Callable[[Any], Any]] = []


def emit(name: str, *args: Any) -> None:
    if _listeners:
        for listener in tuple(_listeners):
            listener(name, *args)


def listen(listener: Callable[..., None]) -> None:
    """Call ``listener(name, *args)`` for every event from now on (benchmarks)."""
    _listeners.append(listener)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, tuple[Any, ...]]]]:
    """Collect ``(name, args)`` of every event emitted inside the block."""
    seen: list[tuple[str, tuple[Any, ...]]] = []

    def listener(name: str, *args: Any) -> None:
        seen.append((name, args))

    _listeners.append(listener)
    try:
        yield seen
    finally:
        _listeners.remove(listener)
