"""Parameters partitioned across ranks (DeepSpeed ZeRO-3), as the call path sees them.

The call path must refuse a partitioned module nobody gathers for it, and let the gathering
protocol bring whole weights in while it exports. The protocol itself (``ortfx.hooks.zero3``)
registers a :class:`Gathering` per wrapped module here, so the runtime never imports the hooks
(which import the runtime), as :class:`ortfx.runtime.memgrad.Fetcher` does for the feeds.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from ortfx.errors import ZERO3_NOT_CONFIGURED, OrtfxInitError


class Gathering(Protocol):
    """What gathers one wrapped module's partitioned parameters."""

    def for_export(self) -> contextlib.AbstractContextManager[Any]:
        """The whole parameters, while ortfx exports the module (released after)."""
        ...


# The wrapped (user) module -> its gathering; weakly, so a dropped model is no entry.
_GATHERINGS: weakref.WeakKeyDictionary[torch.nn.Module, Gathering] = weakref.WeakKeyDictionary()


def register(module: torch.nn.Module, gathering: Gathering) -> None:
    """``gathering`` serves the wrapped ``module`` from now on."""
    _GATHERINGS[module] = gathering


def check(module: torch.nn.Module, named_tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`~ortfx.OrtfxInitError` if ``module``'s parameters are ZeRO-3 partitioned
    (DeepSpeed marks them with ``ds_shape``) but nothing gathers them for it. Cheap; the call
    path runs it before exporting."""
    if module in _GATHERINGS:
        return
    partitioned = [(n, t) for n, t in named_tensors.items() if hasattr(t, "ds_shape")]
    if not partitioned:
        return
    name, first = partitioned[0]
    raise OrtfxInitError(
        ZERO3_NOT_CONFIGURED.format(
            count=len(partitioned),
            name=name,
            full=list(first.ds_shape),
            local=list(first.shape),
        )
    )


def gathered_for_export(module: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    """The registered gathering's export context for ``module``, or nothing."""
    gathering = _GATHERINGS.get(module)
    return contextlib.nullcontext() if gathering is None else gathering.for_export()
