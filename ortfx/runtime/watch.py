"""What the graph is built over: the module's parameters and buffers, and who changes them.

:class:`Tracked` is the frozen view of the tensors one call feeds to the graph, with what else
the trace depended on that a later call compares (the tree's plain attributes, its hooks, the
transformers configs it holds); torch's public module registration hooks tell a live wrapper
when a parameter, buffer or submodule anywhere in its module tree is added or replaced, so that
its graphs are rebuilt. Nothing of torch's is replaced: ortfx compares instead of intercepting.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import operator
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, TypeAlias

import attrs
import torch

from ortfx import _torch
from ortfx.errors import PARAMS_ON_SEVERAL_DEVICES, OrtfxDeviceError
from ortfx.module_state import Attributes
from ortfx.outside import Outside

Fingerprint: TypeAlias = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]


def _frozen(data: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    return data if isinstance(data, _Frozen) else _Frozen(data)


class _Frozen(Mapping[str, torch.Tensor]):
    """A read-only name -> tensor map (the tensors themselves are the user's)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, torch.Tensor]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


@attrs.frozen
class Tracked:
    """The module's parameters and buffers as the graph sees them; rebuilt when they change."""

    param_names: tuple[str, ...]
    params: tuple[torch.nn.Parameter, ...]
    named_tensors: Mapping[str, torch.Tensor] = attrs.field(converter=_frozen)
    device: torch.device
    # Every slot of the tree that holds a tracked parameter or buffer: (the owner's own dict,
    # local name, tensor). ``.to('meta')``, ``module._parameters[name] = p`` (accelerate's
    # set_module_tensor_to_device) and ``module._buffers[name] = t`` replace tensors without a
    # registration hook: one identity test per slot and call (about 10 µs for GPT-2's 150).
    slots: tuple[tuple[Mapping[str, Any], str, torch.Tensor, str], ...] = ()  # + full name
    # Every module of the tree (the root first) and its name: the train/eval flags are read
    # from them on each call, since ``model.block.eval()`` changes the trace (BatchNorm,
    # dropout) without touching the root's flag.
    modules: tuple[torch.nn.Module, ...] = ()
    module_names: tuple[str, ...] = ()
    # transformers configs the modules hold (``model.config``), each with a deep copy of its
    # attributes when this view was taken: ``model.config.use_cache = False`` changes the
    # trace, and the config is no module, so no hook sees the write.
    configs: tuple[tuple[str, Any, dict[str, Any]], ...] = ()
    # The module hooks in the tree (and torch's global ones) when this view was taken, and the
    # hook clock then: a hook registered or removed later changes what the forward does.
    hooks: tuple[Any, ...] = ()
    clock: int = -1
    # The hook tables that held hooks, with their sizes: a removal shrinks one (torch numbers
    # each registration, which moves the clock, but counts no removal).
    hook_sizes: tuple[tuple[Mapping[int, Any], int], ...] = ()
    # The buffers, and whether any required grad (the graph differentiates parameters only).
    buffers: tuple[torch.Tensor, ...] = ()
    buffer_grad: bool = False
    # The public plain attributes of every module of the tree (``self.use_gate``), as the graph
    # was traced with them: torch has no hook for their writes, so each call compares.
    attributes: Attributes | None = None
    # What the traced forwards read outside their arguments, parameters and buffers (globals,
    # classes, closures, private attributes, environment variables: ortfx.outside), the union
    # over the graphs traced since the module last changed.
    outside: Outside | None = None

    def unchanged(self) -> bool:
        """Nothing the graph was built over changed behind the wrapper: every parameter and
        buffer slot, the parameters' device, the hook clock and tables, the buffers' flags,
        the public attributes, the configs. The fast path's one check, inline (each test is
        cheap; most are skipped for what the tree does not have)."""
        if self.params and self.params[0].device != self.device:
            return False
        for table, name, tensor, _ in self.slots:
            if table.get(name) is not tensor:
                return False
        if self.clock != _torch.hook_handles_made():
            return False
        if self.hook_sizes and any(len(table) != size for table, size in self.hook_sizes):
            return False
        if self.buffers and any(b.requires_grad for b in self.buffers) != self.buffer_grad:
            return False
        if self.attributes is not None and self.attributes.changed():
            return False
        if self.outside is not None and self.outside.changed():
            return False
        return not (self.configs and any(vars(c) != copied for _, c, copied in self.configs))

    def replaced(self) -> str | None:
        """The name of a parameter or buffer replaced in its slot, if any."""
        return next((full for table, n, t, full in self.slots if table.get(n) is not t), None)

    def buffer_grad_changed(self) -> bool:
        """Whether a buffer's requires_grad flag moved since this view (one pass over them)."""
        return any(b.requires_grad for b in self.buffers) != self.buffer_grad

    def buffer_requiring_grad(self) -> str | None:
        """The name of the first buffer that requires grad, if any."""
        params = set(self.param_names)
        return next(
            (n for n, t in self.named_tensors.items() if n not in params and t.requires_grad),
            None,
        )

    def hooks_removed(self) -> bool:
        """Whether a hook table that held hooks holds fewer now (a handle was removed)."""
        return any(len(table) != size for table, size in self.hook_sizes)

    def attributes_changed(self) -> bool:
        return self.attributes is not None and self.attributes.changed()

    def with_fresh_attributes(self, skip: Iterable[tuple[int, str]] = ()) -> Tracked:
        """This view with the attributes as they are now: after ortfx itself ran the forward
        (an export, a call in PyTorch), whose own writes are not a change behind the graph;
        ``skip``: the (module id, name) of attributes an exported forward sets itself."""
        attributes = self.attributes or Attributes.of(self.modules)
        return attrs.evolve(self, attributes=attributes.refreshed(skip))

    def outside_changed(self) -> bool:
        return self.outside is not None and self.outside.changed()

    def outside_change(self) -> str | None:
        """What changed of the state the traces read outside the call (for the log)."""
        return self.outside.cause() if self.outside is not None else None

    def attribute_change(self) -> str | None:
        """Which public attribute changed (for the log)."""
        return self.attributes.cause() if self.attributes is not None else None

    def with_outside(self, read: Outside) -> Tracked:
        """This view guarding ``read`` too (what a new graph's trace read)."""
        if not len(read):
            return self
        merged = read if self.outside is None else self.outside.merged(read)
        return attrs.evolve(self, outside=merged)

    def with_fresh_outside(self) -> Tracked:
        """This view with the outside values of now: after ortfx itself ran the forward in
        eager (its own writes are no change behind a graph), or a change :meth:`Outside.cause`
        found none in (an equal scalar set again)."""
        if self.outside is None:
            return self
        return attrs.evolve(self, outside=self.outside.refreshed())

    def with_fresh_hooks(self) -> Tracked:
        """This view with the hook clock and table sizes of now (the tree's hooks are the same:
        a hook elsewhere in the process moved the clock)."""
        return attrs.evolve(self, clock=hook_clock(), hook_sizes=hook_sizes(self.modules))

    def moved(self) -> bool:
        """The parameters left the device this view was taken on (``.to()`` in place)."""
        return bool(self.params) and self.params[0].device != self.device

    def fingerprint(self) -> Fingerprint:
        """Name, dtype and shape of every parameter and buffer, as the graph was built for."""
        return tuple((n, t.dtype, tuple(t.shape)) for n, t in self.named_tensors.items())

    def requires_grad(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self.params)

    def hooks_change(self) -> str | None:
        """After the hook clock moved: why the tree's hooks differ from this view's (a cause
        for the log), or None if they do not (a hook elsewhere in the process)."""
        now = module_hooks(self.module_names, self.modules)
        if now == self.hooks:
            return None
        before, after = dict(self.hooks), dict(now)
        for where in [*after, *before]:
            if before.get(where) != after.get(where):
                return f"hooks of {where} changed outside the wrapper"
        return "hooks changed outside the wrapper"  # pragma: no cover - dicts differ above

    def configs_differ(self) -> bool:
        """Whether a config differs from its copy at all: one dict comparison per config and
        call (about 3 µs for GPT-2's)."""
        return bool(self.configs) and any(
            vars(config) != copied for _, config, copied in self.configs
        )

    def config_change(self) -> str | None:
        """Why the configs differ from their copies, for the log; None when only metadata
        changed (``save_pretrained`` records ``architectures`` and ``dtype``)."""
        for where, config, copied in self.configs:
            now = vars(config)
            changed = sorted(
                k
                for k in now.keys() | copied.keys()
                if k not in CONFIG_METADATA and now.get(k, _MISSING) != copied.get(k, _MISSING)
            )
            if changed:
                names = ", ".join(repr(k.removeprefix("_")) for k in changed[:3])
                return f"{where} changed outside the wrapper ({names})"
        return None

    def with_fresh_configs(self) -> Tracked:
        """This view with new copies of the configs (after a metadata-only change)."""
        configs = tuple((w, c, copy.deepcopy(vars(c))) for w, c, _ in self.configs)
        return attrs.evolve(self, configs=configs)

    def modes(self) -> tuple[bool, ...]:
        """Every module's ``training`` flag, in :attr:`modules` order."""
        return tuple(map(_TRAINING, self.modules))

    def other_mode(self, training: bool) -> tuple[str, ...]:
        """The names of the modules whose ``training`` flag is not ``training`` (the root's)."""
        return tuple(
            name
            for name, module in zip(self.module_names, self.modules, strict=True)
            if module.training != training
        )


_TRAINING = operator.attrgetter("training")


def track(module: torch.nn.Module) -> Tracked:
    """Take the view of ``module``'s tensors; all must sit on one device."""
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    named: dict[str, torch.Tensor] = {**params, **buffers}
    devices = {t.device for t in named.values()}
    if len(devices) > 1:
        raise OrtfxDeviceError(
            PARAMS_ON_SEVERAL_DEVICES.format(devices=", ".join(sorted(map(str, devices))))
        )
    device = devices.pop() if devices else torch.device("cpu")
    # The slots by identity (a nested ORTModule's names skip its _original_module level), a
    # tied tensor in each of its slots.
    tracked_ids = {id(t) for t in named.values()}
    slots = tuple(
        (table, n, t, f"{prefix}.{n}" if prefix else n)
        for prefix, m in module.named_modules(remove_duplicate=False)
        for table in (_torch.own_parameters(m), _torch.own_buffers(m))
        for n, t in table.items()
        if t is not None and id(t) in tracked_ids
    )
    modules = dict(module.named_modules())
    tree = tuple(modules.values())
    return Tracked(
        tuple(params),
        tuple(params.values()),
        named,
        device,
        slots,
        tree,
        tuple(modules),
        _configs(modules),
        module_hooks(tuple(modules), tree),
        hook_clock(),
        hook_sizes(tree),
        tuple(buffers.values()),
        any(b.requires_grad for b in buffers.values()),
        Attributes.of(tree),
    )


def hook_clock() -> int:
    """Moves whenever a hook is registered anywhere in the process (torch numbers every
    handle it gives out): one read per call."""
    return _torch.hook_handles_made()


def hook_sizes(
    modules: tuple[torch.nn.Module, ...],
) -> tuple[tuple[Mapping[int, Any], int], ...]:
    """The tree's (and torch's global) hook tables that hold hooks, with their sizes."""
    tables = [t for m in modules for t in _torch.hook_tables(m)]
    tables += _torch.hook_tables(None)
    return tuple((t, len(t)) for t in tables if len(t))


# Libraries whose module hooks are theirs to keep working (ZeRO-3 gathering, ortfx's own
# statistics) and are not the user's code to warn about.
_LIBRARY_HOOKS = ("ortfx", "torch", "deepspeed", "transformers", "accelerate", "peft")


def user_forward_hooks(module: torch.nn.Module) -> tuple[str, ...]:
    """The modules of the tree with forward hooks or pre-hooks of the user's own code, as
    ``'name' (Type)``: the trace runs them once, ORT never again."""
    found = []
    for name, sub in module.named_modules():
        for table in _torch.hook_tables(sub)[:2]:  # forward pre-hooks, forward hooks
            for hook in table.values():
                function = getattr(hook, "func", hook)  # functools.partial
                owner = getattr(function, "__module__", None) or ""
                if owner.split(".")[0] not in _LIBRARY_HOOKS:
                    found.append(repr(name or "the module") + f" ({type(sub).__name__})")
    return tuple(dict.fromkeys(found))


def backward_hooks(module: torch.nn.Module) -> tuple[str, ...]:
    """The modules of the tree with backward hooks or pre-hooks (any code's but ortfx's, and
    torch's global ones, which apply to every module), as ``'name' (Type)``: ORT computes the
    backward of the whole graph, so none of them would ever run."""
    found = []
    named = [*module.named_modules(), ("every module (global hooks)", None)]
    for name, sub in named:
        for table in _torch.hook_tables(sub)[2:]:  # backward pre-hooks, backward hooks
            for hook in table.values():
                function = getattr(hook, "func", hook)  # functools.partial
                if (getattr(function, "__module__", None) or "").startswith("ortfx."):
                    continue
                where = repr(name or "the module") if sub is not None else name
                found.append(where + (f" ({type(sub).__name__})" if sub is not None else ""))
    return tuple(dict.fromkeys(found))


def module_hooks(
    names: tuple[str, ...], modules: tuple[torch.nn.Module, ...]
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Which hook functions the tree's modules and torch's global tables hold, by identity."""
    found = []
    for name, module in zip(names, modules, strict=True):
        ids = tuple(id(hook) for table in _torch.hook_tables(module) for hook in table.values())
        if ids:
            found.append((repr(name or "the module") + f" ({type(module).__name__})", ids))
    ids = tuple(id(hook) for table in _torch.hook_tables(None) for hook in table.values())
    if ids:
        found.append(("every module (global hooks)", ids))
    return tuple(found)


_MISSING = object()

# Config entries that describe the checkpoint, not the computation; the parameters' dtypes
# are tracked on their own (Tracked.fingerprint).
CONFIG_METADATA = frozenset(
    {
        "architectures",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "_name_or_path",
        "_commit_hash",
    }
)


def _configs(modules: Mapping[str, torch.nn.Module]) -> tuple[tuple[str, Any, dict[str, Any]], ...]:
    """Each transformers config held as a public attribute of a module (once per object)."""
    configuration = sys.modules.get("transformers.configuration_utils")
    base = getattr(configuration, "PretrainedConfig", None)
    if base is None:
        return ()
    found: dict[int, tuple[str, Any, dict[str, Any]]] = {}
    for name, module in modules.items():
        for attribute, value in vars(module).items():
            if isinstance(value, base) and id(value) not in found:
                where = f"{name}.{attribute}" if name else attribute
                copied = copy.deepcopy(vars(value))
                try:
                    comparable = bool(vars(value) == copied)
                except Exception:  # e.g. an array in the config: no plain == to watch with
                    comparable = False
                if comparable:
                    found[id(value)] = (where, value, copied)
    return tuple(found.values())


def changed_tensor(built: Fingerprint, now: Fingerprint) -> str | None:
    """A cause for the log if a parameter or buffer changed dtype or shape since the build."""
    before = {name: (dtype, shape) for name, dtype, shape in built}
    for name, dtype, shape in now:
        if name in before and before[name] != (dtype, shape):
            was_dtype, was_shape = before[name]
            return (
                f"{name!r} changed from {str(was_dtype).removeprefix('torch.')}{list(was_shape)} "
                f"to {str(dtype).removeprefix('torch.')}{list(shape)} outside the wrapper"
            )
    if {n for n, _, _ in now} != set(before):
        return "the parameters or buffers changed outside the wrapper"
    return None


def module_ids(module: torch.nn.Module) -> frozenset[int]:
    """The identities of every module in ``module``'s tree (what the hooks watch)."""
    return frozenset(map(id, module.modules()))


# ---- the process-wide registration hooks --------------------------------------------------------


class Watcher(Protocol):
    """A live wrapper, as the hooks see it."""

    @property
    def module(self) -> torch.nn.Module: ...

    def _ortfx_watches(self, module_id: int) -> bool: ...

    def _ortfx_invalidate(self, cause: str) -> None: ...


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_HOOKS: list[Any] = []
_HOOKS_LOCK = threading.Lock()
_MUTED = threading.local()


def _muted() -> dict[int, int]:
    counts: dict[int, int] | None = getattr(_MUTED, "counts", None)
    if counts is None:
        counts = _MUTED.counts = {}
    return counts


@contextlib.contextmanager
def muted(root: torch.nn.Module) -> Iterator[None]:
    """The hooks stay quiet, in this thread, for wrappers of ``root``: the caller bumps the
    version once itself (or the change is the export trace's own, e.g. a forward that
    reassigns a buffer)."""
    counts = _muted()
    counts[id(root)] = counts.get(id(root), 0) + 1
    try:
        yield
    finally:
        counts[id(root)] -= 1
        if not counts[id(root)]:
            del counts[id(root)]


def _on_registration(module: torch.nn.Module, name: str, value: Any) -> None:
    """Invalidate the graphs of every wrapper whose module tree contains ``module``."""
    counts = _muted()
    for wrapper in list(_LIVE):
        if id(wrapper.module) in counts or not wrapper._ortfx_watches(id(module)):
            continue
        kind = type(value).__name__ if value is not None else "None"
        wrapper._ortfx_invalidate(f"{name!r} of {type(module).__name__} set to a {kind}")


# True while a wrapper runs its module (export, fallback, the graph): the module's own calls.
IN_WRAPPER: contextvars.ContextVar[bool] = contextvars.ContextVar("ortfx_in_wrapper", default=False)


def watch(wrapper: Watcher) -> None:
    """Start telling ``wrapper`` about registrations in its module tree (weakly held)."""
    # One set of torch's public global registration hooks for the process, registered once and
    # never removed (removing hooks from a finalizer can run while torch iterates over them);
    # they only read, and do nothing while no wrapper is alive.
    with _HOOKS_LOCK:
        if not _HOOKS:
            from torch.nn.modules import module as torch_module

            _HOOKS.extend(
                (
                    torch_module.register_module_parameter_registration_hook(_on_registration),
                    torch_module.register_module_buffer_registration_hook(_on_registration),
                    torch_module.register_module_module_registration_hook(_on_registration),
                )
            )
    _LIVE.add(wrapper)
