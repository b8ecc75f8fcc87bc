"""The one table of torch's global state a call depends on, and the three keys read from it.

Each :class:`Global` is a name and a reader (of the module's device). Every call reads the whole
table once, and the same values make

- the fast path's signature (:func:`signature_of`): every entry it needs (``fast``: all the
  keyed ones, so equal signatures mean equal keys), as read;
- the export and session keys' context (:func:`context_of`): the entries that can change the
  graph or its session (``keyed``), under their ``CallContext`` field names;
- the fallback key (:func:`fallback_key`): every entry (a call under ``torch.autocast``, vmap,
  ``inference_mode`` or ``no_grad`` that fell back says nothing about a plain training call).

So nothing can be in one key and missing from another, as PyTorch's Dynamo guards drive both
the check and the reason from one list. ``property_tests/test_signature_properties.py`` draws
every entry of the table.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import attrs
import onnx
import optree
import torch

from ortfx import io
from ortfx._torch import any_autocast, in_functorch_transform
from ortfx.io import STATIC_TYPES
from ortfx.runtime.records import Compiled, Shell
from ortfx.runtime.session import session_settings
from ortfx.runtime.watch import Tracked
from ortfx.schema import leaf_spec
from ortfx.transitions import CallContext, ExportState, signature

VERSIONS = (torch.__version__, onnx.__version__)


def autocast(device: torch.device) -> str | None:
    """The dtype torch.autocast runs ``device``'s ops in, or None when it is off there."""
    if not any_autocast():  # one cheap question on every steady-state call
        return None
    kind = device.type
    try:
        if not torch.is_autocast_enabled(kind):
            return None
    except RuntimeError:  # a device type autocast does not know ('meta'): no autocast there
        return None
    return str(torch.get_autocast_dtype(kind)).removeprefix("torch.")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _same(value: Any) -> Any:
    return value


@attrs.frozen
class Global:
    """One piece of torch's global (process- or thread-wide) state a call depends on."""

    name: str  # its CallContext field, when keyed
    # The question, asked with no argument, or with the module's device (``device=True``).
    read: Callable[..., Hashable]
    keyed: bool  # it can change the exported graph or its session
    # From the value read (cheap to compare on every call) to the key's form.
    as_key: Callable[[Any], Hashable] = _same
    # Read by the fast path's signature: every keyed entry (equal signatures must mean equal
    # keys); an unkeyed one only where it decides something the fast path would skip.
    fast: bool = True
    device: bool = False

    def __attrs_post_init__(self) -> None:
        if self.keyed and not self.fast:
            raise ValueError(f"guard {self.name!r} is keyed, so the fast path must read it")


GLOBALS: tuple[Global, ...] = (
    Global("grad_enabled", torch.is_grad_enabled, keyed=True),
    Global("deterministic", torch.are_deterministic_algorithms_enabled, keyed=True),
    Global("autocast", autocast, keyed=True, device=True),
    # The dtype object itself: equal exactly when the name in the key is.
    Global("default_dtype", torch.get_default_dtype, keyed=True, as_key=_dtype_name),
    # The graph serves calls under inference_mode as any no-grad call, and a call inside a
    # torch.func transform never reaches the fast path (it is refused first): in the fallback
    # key only.
    Global("inference_mode", torch.is_inference_mode_enabled, keyed=False, fast=False),
    Global("functorch_transform", in_functorch_transform, keyed=False, fast=False),
)
FAST: tuple[Global, ...] = tuple(g for g in GLOBALS if g.fast)


def _reader(table: tuple[Global, ...]) -> Callable[[torch.device], tuple[Hashable, ...]]:
    """One function that reads every entry of ``table`` into a tuple: the calls written out
    (as ``namedtuple`` and attrs write their methods), since the fast path runs it on every
    call and a loop over the readers cost about twice as much."""
    names = {f"read_{i}": g.read for i, g in enumerate(table)}
    body = ", ".join(
        f"{name}(device)" if g.device else f"{name}()" for name, g in zip(names, table, strict=True)
    )
    made: Callable[[torch.device], tuple[Hashable, ...]] = eval(f"lambda device: ({body},)", names)
    return made


_READ_ALL = _reader(GLOBALS)
_READ_FAST = _reader(FAST)


def read(device: torch.device, *, fast: bool = False) -> tuple[Hashable, ...]:
    """The entries of :data:`GLOBALS` (only those the fast path reads, with ``fast``), in
    order, as they are now."""
    return (_READ_FAST if fast else _READ_ALL)(device)


def keyed(values: Sequence[Hashable], *, fast: bool = False) -> dict[str, Any]:
    """The keyed entries of ``values`` (from :func:`read` with the same ``fast``) by field
    name, in the key's form."""
    table = FAST if fast else GLOBALS
    return {g.name: g.as_key(v) for g, v in zip(table, values, strict=True) if g.keyed}


def signature_of(
    leaves: list[Any],
    spec: optree.PyTreeSpec,
    module: torch.nn.Module,
    state: ExportState[Compiled],
    tracked: Tracked,
) -> tuple[Any, ...]:
    """The fast path's signature of a call (see :func:`ortfx.transitions.signature`)."""
    return signature(
        leaves,
        spec,
        module.training,
        state.module_version.number,
        tracked.requires_grad(),
        tracked.device,
        tracked.modes(),
        read(tracked.device, fast=True),
    )


def context_of(shell: Shell, module: torch.nn.Module, tracked: Tracked) -> CallContext:
    """What the call's keys depend on besides its arguments (the keyed globals included)."""
    options = shell.options
    return CallContext(
        # The user module's own flag: model.module.eval() must take effect too.
        training=module.training,
        module_version=shell.state.module_version,
        export_options=options.export_options(shell.exporter),
        versions=VERSIONS,
        param_names=tracked.param_names,
        params_requiring_grad=tracked.requires_grad(),
        memory=(options.memory_opt_level, options.memory_opt_config),
        device=str(tracked.device),
        settings=session_settings(options),
        mem_efficient_grad=options.enable_mem_efficient_grad_management,
        other_mode=tracked.other_mode(module.training),
        **keyed(read(tracked.device, fast=True), fast=True),
    )


def fallback_key(
    args: tuple[Any, ...], kwargs: dict[str, Any], module: torch.nn.Module | None = None
) -> Hashable:
    """What makes a call "the same" for fallback: structure, static values, tensor kinds
    (dtype, rank, requires_grad, device, layout, tensor class), every global of
    :data:`GLOBALS` and the module's train/eval mode."""
    leaves, spec = io.flatten(io.call_tree(args, kwargs))
    # Whatever a call's failure may depend on: one input on 'meta', one sparse input or one
    # that requires grad must not send later dense CPU calls to PyTorch.
    kinds = tuple(
        (leaf_spec(x), x.requires_grad, x.device.type, x.layout, type(x))
        if isinstance(x, torch.Tensor)
        else leaf_spec(x)
        if isinstance(x, STATIC_TYPES)
        else type(x)
        for x in leaves
    )
    first = None if module is None else next(module.parameters(), None)
    device = torch.device("cpu") if first is None else first.device
    return (spec, kinds, read(device), None if module is None else module.training)
