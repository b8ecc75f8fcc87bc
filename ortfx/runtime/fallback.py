"""When a call runs in PyTorch instead: the policy's flags, the fallback state, the eager run."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import attrs
import torch

from ortfx.errors import (
    OrtfxDeviceError,
    OrtfxError,
    OrtfxExportError,
    OrtfxGraphBuildError,
    OrtfxIOError,
    OrtfxRuntimeError,
    OrtfxTorchModelError,
)
from ortfx.options import FallbackPolicy
from ortfx.runtime import logs
from ortfx.runtime.guards import fallback_key
from ortfx.runtime.records import CallFailed, Shell
from ortfx.transitions import (
    start_fallback,
)

# ---- fallback ----------------------------------------------------------------------------------

# The fallback key of failures that no later call can fix (unsupported module, no ORT).
ALWAYS = "every call"

# Which policy flag allows falling back from which error (first match wins).
_FALLBACK_FLAGS: tuple[tuple[type[OrtfxError], FallbackPolicy], ...] = (
    (OrtfxIOError, FallbackPolicy.UNSUPPORTED_DATA),
    (OrtfxDeviceError, FallbackPolicy.UNSUPPORTED_DEVICE),
    (OrtfxTorchModelError, FallbackPolicy.UNSUPPORTED_TORCH_MODEL),
    (OrtfxExportError, FallbackPolicy.UNSUPPORTED_ONNX_MODEL),
    # ORT cannot build or open this graph (gradient build, session): the graph's property,
    # unlike the other init errors (ORT missing, ZeRO-3 not configured), which no call fixes.
    (OrtfxGraphBuildError, FallbackPolicy.UNSUPPORTED_ONNX_MODEL),
    (OrtfxRuntimeError, FallbackPolicy.UNSUPPORTED_ONNX_MODEL),
    (OrtfxError, FallbackPolicy.BAD_INITIALIZATION),
)


def fall_back(
    shell: Shell, error: OrtfxError, *, key: Hashable, retry: bool = True, during_call: bool = True
) -> Shell:
    """Calls like this one run in PyTorch from now on, if the policy allows; else re-raise."""
    flag = next(f for t, f in _FALLBACK_FLAGS if isinstance(error, t))
    options = shell.options
    if not options.fallback_policy.allows(flag):
        raise error
    reason = f"{type(error).__name__}: {str(error).rstrip('.')}"
    later = (
        "a call with a new input schema will try ONNX Runtime again"
        if retry and options.fallback_retry
        else "every later call runs in PyTorch"
    )
    logs.fallback(shell.log, flag, reason, later=later)
    state = start_fallback(shell.state, key, reason, during_call=during_call)
    return attrs.evolve(shell, state=state, fast=None)


def fallback_reason(
    shell: Shell, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    state = shell.state
    key = ALWAYS if state.fallbacks[0][0] is ALWAYS else fallback_key(args, kwargs, module)
    reason = state.fallback_reason(key)
    if reason is None and not shell.options.fallback_retry:
        reason = state.fallbacks[-1][1]
    return reason


def in_torch(
    shell: Shell, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Shell]:
    try:
        result = module(*args, **kwargs)
    except BaseException as error:
        raise CallFailed(error, attributes_seen(shell)) from None
    return result, attributes_seen(shell)


def attributes_seen(shell: Shell) -> Shell:
    """The shell after the forward ran in eager inside this call: the module's attribute
    writes there are its own (as in eager), not a change behind a graph."""
    if shell.tracked is None:
        return shell
    return attrs.evolve(shell, tracked=shell.tracked.with_fresh_attributes().with_fresh_outside())
