"""Checkpoint keys of a wrapper inside a parent module, named as the user's ``state_dict()`` does.

The wrapper keeps the user's module in ``_modules["_original_module"]``; its ``state_dict()``
leaves that name out, so checkpoints (from ortfx or plain PyTorch) say ``child.0.weight``. A
parent's ``load_state_dict`` walks ``_modules`` and would look for
``child._original_module.0.weight``. Torch's own walk stays in charge (per-module hooks, class
overrides, ``assign``, ``strict``): :func:`nest` renames the wrapper's keys on the way in and
:func:`unnest` names what was reported (missing, unexpected, error messages) back.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import attrs

from ortfx.runtime.watch import Watcher

INNER = "_original_module"
ASSIGNED = "load_state_dict(assign=True) replaced the parameters"


@attrs.frozen
class _Loading:
    """One wrapper's part of a load in progress, from :func:`nest` to :func:`unnest`."""

    wrapper: weakref.ref[Any]  # weak: a load that raised leaves its entries behind
    prefix: str
    assign: bool
    missing: list[str]
    errors: list[str]
    errors_before: int


_LOCAL = threading.local()


def _stack() -> list[_Loading]:
    stack: list[_Loading] | None = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def nest(
    wrapper: Watcher,
    state_dict: dict[str, Any],
    prefix: str,
    *,
    assign: bool,
    missing: list[str],
    errors: list[str],
) -> None:
    """Rename ``prefix + k`` to ``prefix + "_original_module." + k`` in ``state_dict`` (the copy
    torch hands to ``_load_from_state_dict``, never the user's), keeping the order."""
    items = [
        (prefix + INNER + "." + k[len(prefix) :] if k.startswith(prefix) else k, v)
        for k, v in state_dict.items()
    ]
    state_dict.clear()
    state_dict.update(items)
    stack = _stack()
    if stack and stack[-1].missing is not missing:
        # Left by a load that raised midway in this thread: it will never be unnested. (A load
        # started inside another one's hooks would clear the outer's too: its reports would
        # keep the "_original_module." names, its values would still load.)
        stack.clear()
    stack.append(_Loading(weakref.ref(wrapper), prefix, assign, missing, errors, len(errors)))


def _user_name(key: str, nested: str, prefix: str) -> str:
    return prefix + key[len(nested) :] if key.startswith(nested) else key


def unnest(wrapper: Watcher, incompatible: Any) -> None:
    """Load post-hook of the wrapper: report keys as the user's ``state_dict()`` names them."""
    stack = _stack()
    if not stack or stack[-1].wrapper() is not wrapper:
        return  # not reached through nest (a load_state_dict that raised cleared the stack)
    loading = stack.pop()
    if loading.assign:
        # The registration hooks already invalidated once per tensor; say why in one cause.
        wrapper._ortfx_invalidate(ASSIGNED)
    prefix = loading.prefix
    nested = prefix + INNER + "."
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [_user_name(k, nested, prefix) for k in keys]
    errors = loading.errors
    errors[loading.errors_before :] = [
        e.replace(nested, prefix) for e in errors[loading.errors_before :]
    ]
