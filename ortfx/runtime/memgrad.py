"""Memory-efficient gradient management: each parameter's gradient goes to torch as ORT makes it.

With ``Options(enable_mem_efficient_grad_management=True)`` the session pipeline
(:func:`ortfx.passes.feed_parameters`) turns every parameter that requires grad into the output
of a PythonOp running :class:`FeedParameter`, fed by a trigger input (a fresh 0-dim leaf per
call that requires grad, so torch runs ORT's backward even when only parameters require grad).
The parameters reach the autograd bridge (``RunORT``) as one tuple argument, which autograd does
not look into: they are no inputs of its node, so torch accumulates nothing for them there (a
``None`` returned for an input would still run that input's hooks, with ``None``).

* ORT's forward: :func:`feeding` makes the call's parameters visible to ``FeedParameter.forward``,
  which hands parameter ``index`` to ORT without a copy.
* ORT's backward (inside :func:`accumulating`): ORT runs ``FeedParameter.backward`` the moment
  it has a parameter's gradient, which calls ``torch.autograd.backward(param, grad)``: torch's
  own ``AccumulateGrad`` runs, with tensor hooks, post-accumulate-grad hooks and DDP's reducer,
  while ORT goes on with the earlier layers. ``loss.backward()`` returns after ORT's backward,
  so every gradient is accumulated by then, each exactly once.
* A hook may change the parameter in place (an optimizer stepped in backward) while ORT still
  holds its buffer: the gradient model is edited so that ORT has run every backward node that
  reads the parameter before that gradient node (:func:`ortfx.passes.feeds_after_readers`).
* A parameter changed in place between the forward and its backward raises, as torch would.
* Torch keeps ORT's gradient buffer as ``.grad`` instead of copying it when ORT's session gives
  that gradient a buffer of its own (:func:`ortfx.passes.owned_gradients`): the gradient reaches
  ``AccumulateGrad`` through a view of the parameter, so that only the engine holds it and
  torch steals it. Otherwise (a gradient that is a view of another ORT value, e.g. a bias
  gradient out of a ``Reshape``) torch copies it, as ORT may reuse that buffer.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import attrs
import torch

from ortfx import _torch
from ortfx.function_names import function_graph_name

# .params: the parameters of the ORT forward running on this thread; .accumulating: True while
# an ortfx backward runs ORT's backward on this thread.
_LOCAL = threading.local()

NOT_RUNNING = (
    "ortfx: a parameter-feeding PythonOp ran outside an ortfx {phase}; the graph that holds it "
    "can only run through the ORTModule that built it."
)
CHANGED_IN_PLACE = (
    "one of the variables needed for gradient computation has been modified by an inplace "
    "operation: the parameter of shape {shape} was at version {seen} in the forward and is at "
    "version {now} now (e.g. optimizer.step() between forward and backward). Run the forward "
    "again after changing parameters."
)


class Fetcher(Protocol):
    """Where a parameter's full value comes from when it is not simply the parameter (ZeRO-3
    layer-wise gathering, :mod:`ortfx.hooks.zero3`)."""

    def fetch(self, param: torch.Tensor, *, backward: bool) -> torch.Tensor:
        """The full value for one node: a forward feed (``backward=False``), or a re-gather
        for the backward nodes that read the parameter."""
        ...

    def accumulate(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Hand ``grad`` to torch's ``AccumulateGrad`` of ``param``."""
        ...


# id(parameter) -> (the parameter, weakly; its Fetcher), registered by whoever partitions it.
# By id: tensors compare elementwise, so they cannot be dictionary keys themselves.
_FETCHERS: dict[int, tuple[weakref.ref[torch.Tensor], Fetcher]] = {}


def fetch_through(param: torch.Tensor, fetcher: Fetcher | None) -> None:
    """Feed ``param`` through ``fetcher`` from now on (``None``: feed it as it is again)."""
    key = id(param)
    if fetcher is None:
        _FETCHERS.pop(key, None)
        return
    _FETCHERS[key] = (weakref.ref(param, lambda _: _FETCHERS.pop(key, None)), fetcher)


def _fetcher(param: torch.Tensor) -> Fetcher | None:
    entry = _FETCHERS.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def take(index: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Parameter ``index`` of the running ORT forward: ``(param, value for ORT, fetched)``;
    ``fetched`` says the value came from a :class:`Fetcher` and is ORT's alone."""
    params: Sequence[torch.Tensor] | None = getattr(_LOCAL, "params", None)
    if params is None:
        raise RuntimeError(NOT_RUNNING.format(phase="forward"))
    param = params[index]
    fetcher = _fetcher(param)
    if fetcher is None:
        return param, param.detach(), False
    backward = bool(getattr(_LOCAL, "accumulating", False))
    return param, fetcher.fetch(param, backward=backward), True


def give(param: torch.Tensor, index: int, version: int, grad: torch.Tensor) -> None:
    """Hand ``grad``, ORT's gradient of ``param`` (fed at ``version``), to torch's
    ``AccumulateGrad`` now, with every hook."""
    if not getattr(_LOCAL, "accumulating", False):
        raise RuntimeError(NOT_RUNNING.format(phase="backward"))
    fetcher = _fetcher(param)
    if fetcher is not None:
        # A partitioned parameter's data is swapped by its gathers: no version to check.
        fetcher.accumulate(param, grad)
        return
    if _torch.version(param) != version:
        raise RuntimeError(
            CHANGED_IN_PLACE.format(
                shape=list(param.shape), seen=version, now=_torch.version(param)
            )
        )
    # torch's engine (re-entered on this thread): AccumulateGrad with every hook, now.
    if index in _LOCAL.owned:
        # Through a fresh view node, the gradient AccumulateGrad gets is referenced by the
        # engine only, and it keeps ORT's buffer (which ORT owns no more) without a copy.
        with torch.enable_grad():
            view = param.view_as(param)
        torch.autograd.backward(view, grad)
    else:
        torch.autograd.backward(param, grad)


@attrs.frozen(eq=False)
class Fed:
    """The context of one ``FeedParameter`` node's run on the PythonOp bridge's direct path
    (:mod:`ortfx.runtime.pythonop`): what its backward needs, without an autograd node."""

    param: torch.Tensor
    index: int
    version: int  # the parameter's version when ORT read it
    token: int  # its key in the bridge's kept contexts


class FeedParameter(torch.autograd.Function):
    """``apply(trigger, index)``: parameter ``index`` of the running call, as a PythonOp.

    The bridge runs these nodes directly (:class:`Fed`: 45 instead of 78 µs per parameter and
    step, forward and backward); the Function is what the graph names, and what runs if it is
    called any other way."""

    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor, index: int) -> torch.Tensor:
        param, value, fetched = take(index)
        ctx.param = param
        ctx.index = index
        ctx.version = _torch.version(param)
        if fetched:
            # The value is ORT's alone: the bridge keeps no reference to it until backward.
            ctx.ortfx_drop_outputs = True
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        give(ctx.param, ctx.index, ctx.version, grad)
        # The trigger's gradient: ORT wants one; the bridge drops it.
        return torch.zeros((), dtype=torch.float32, device=grad.device), None


FUNCTION_NAME = function_graph_name(FeedParameter)


@contextlib.contextmanager
def feeding(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """ORT's forward runs with these parameters behind its ``FeedParameter`` nodes."""
    before = getattr(_LOCAL, "params", None)
    _LOCAL.params = params
    try:
        yield
    finally:
        _LOCAL.params = before


@contextlib.contextmanager
def accumulating(owned: frozenset[int] = frozenset()) -> Iterator[None]:
    """ORT's backward runs: ``FeedParameter`` nodes hand their gradients to torch; torch keeps
    the buffers of parameters ``owned`` (indices, :func:`ortfx.passes.owned_gradients`)."""
    before: tuple[bool, frozenset[int]] = (
        getattr(_LOCAL, "accumulating", False),
        getattr(_LOCAL, "owned", frozenset()),
    )
    _LOCAL.accumulating, _LOCAL.owned = True, owned
    try:
        yield
    finally:
        _LOCAL.accumulating, _LOCAL.owned = before
