"""What a module tree holds besides parameters, buffers and submodules: its public attributes.

A forward may branch on them (``self.use_gate``, ``self.act``), and torch has no hook for
attribute writes. ortfx compares instead of intercepting: a snapshot of the values, taken when a
graph is traced, against the values now (no ``nn.Module.__setattr__`` is replaced).
"""

from __future__ import annotations

import collections
import contextlib
import operator
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Final, TypeAlias

import attrs
import torch

# Values whose equality is their identity for the graph: plain Python scalars and strings.
PLAIN: Final[tuple[type, ...]] = (bool, int, float, str, type(None))


def _public(name: str) -> bool:
    # ``training`` is in every export key already; ``_x`` names are frameworks' bookkeeping.
    return not name.startswith("_") and name != "training"


# Marks a value ortfx itself puts on a module for the length of one of its calls (the routed
# ``forward`` of a user method called through the wrapper): no change behind a graph.
ROUTED = "_ortfx_routed"


def _ours(value: Any) -> bool:
    return getattr(value, ROUTED, False) is True


def attributes(modules: Iterable[torch.nn.Module]) -> dict[tuple[int, str], Any]:
    """Every public attribute stored on the modules themselves, by (module id, name)."""
    return {
        (id(m), name): value for m in modules for name, value in vars(m).items() if _public(name)
    }


def written(
    before: dict[tuple[int, str], Any], modules: Iterable[torch.nn.Module]
) -> tuple[tuple[torch.nn.Module, str], ...]:
    """The public attributes set (to another object) since ``before``: (module, name)."""
    found: dict[tuple[int, str], tuple[torch.nn.Module, str]] = {}
    for m in modules:
        for name, value in vars(m).items():
            if _public(name) and before.get((id(m), name), _MISSING) is not value:
                found[(id(m), name)] = (m, name)
    return tuple(found.values())


# Containers a forward may fill (``self.acts.append(h)``, ``self.stats["mean"] = m``): changed
# in place, so neither :func:`written` nor a shallow :func:`snapshot` sees them.
_CONTAINERS: Final = (list, dict, set, bytearray, collections.deque)
# torch's own bookkeeping on every module (hook tables, _parameters, ...): not the forward's.
_TORCH_OWN: Final = frozenset(vars(torch.nn.Module()))

# (owner module, or None for a call's argument; name; the container; its copy)
Contents: TypeAlias = tuple[tuple[Any, str, Any, Any], ...]


def contents(modules: Iterable[torch.nn.Module]) -> Contents:
    """A shallow copy of every container the modules hold as attributes: (module, name, the
    container, its copy), to find and undo what a traced forward put in them."""
    return tuple(
        (m, name, value, _copied(value))
        for m in modules
        for name, value in vars(m).items()
        if name not in _TORCH_OWN and isinstance(value, _CONTAINERS)
    )


def arguments(values: Iterable[Any]) -> Contents:
    """:func:`contents` of the containers among a call's arguments (lists, dicts, sets the
    forward may fill, such as a list it appends features to)."""
    return tuple(
        (None, "", value, _copied(value)) for value in values if isinstance(value, _CONTAINERS)
    )


def _copied(value: Any) -> Any:
    """A plain shallow copy (of a subclass too: ``class Names(List[str])``)."""
    if isinstance(value, dict):
        return dict(value)
    for kind in (list, set, bytearray, collections.deque):
        if isinstance(value, kind):
            return kind(value)
    return value


def filled(before: Contents) -> tuple[tuple[torch.nn.Module, str], ...]:
    """The containers of ``before`` whose contents changed since: (module, name)."""
    return tuple((m, name) for m, name, value, copy in before if _differs(value, copy))


def _differs(value: Any, copy: Any) -> bool:
    if len(value) != len(copy):
        return True
    if isinstance(value, dict):
        return any(k not in value or value[k] is not v for k, v in copy.items())
    if isinstance(value, set | bytearray):
        return bool(value != copy)
    return any(a is not b for a, b in zip(value, copy, strict=True))


def refill(before: Contents) -> None:
    """Put the contents of ``before``'s containers back."""
    for _, _, value, copy in before:
        if not _differs(value, copy):
            continue
        value.clear()
        if isinstance(value, dict | set):
            value.update(copy)
        else:
            value.extend(copy)


# id(buffer) -> (the buffer, weakly; its lock): by id, since tensors compare elementwise.
_BUFFER_LOCKS: dict[int, tuple[weakref.ref[torch.Tensor], threading.RLock]] = {}
_BUFFER_LOCKS_GUARD = threading.Lock()


def _lock_of(tensor: torch.Tensor) -> threading.RLock:
    key = id(tensor)
    entry = _BUFFER_LOCKS.get(key)
    if entry is None or entry[0]() is not tensor:
        ref = weakref.ref(tensor, lambda _: _BUFFER_LOCKS.pop(key, None))
        entry = _BUFFER_LOCKS[key] = (ref, threading.RLock())
    return entry[1]


@contextlib.contextmanager
def buffers_locked(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Hold the lock of each of these buffers: runs that write buffers back and exports (whose
    trace changes them and puts them back) take them, so that two threads' calls lose no
    update (eager's in-place updates lose none), also when two wrappers share a module (a
    nested wrapper, a shared backbone). Taken in one global order: no two callers wait on
    each other."""
    with _BUFFER_LOCKS_GUARD:
        locks = [_lock_of(t) for t in sorted({id(t): t for t in tensors}.values(), key=id)]
    with contextlib.ExitStack() as stack:
        for lock in locks:
            stack.enter_context(lock)
        yield


def described(writes: Iterable[tuple[torch.nn.Module, str]]) -> tuple[str, ...]:
    """``'name' of Type`` for each write, for the log."""
    return tuple(dict.fromkeys(f"{name!r} of {type(m).__name__}" for m, name in writes))


_MISSING = object()

# A change that deleted the attribute.
GONE: Final = object()

Snapshot: TypeAlias = tuple[tuple[torch.nn.Module, dict[str, Any]], ...]
Changes: TypeAlias = tuple[tuple[torch.nn.Module, str, Any], ...]


def snapshot(modules: Iterable[torch.nn.Module]) -> Snapshot:
    """Every attribute each module holds (its ``__dict__``, shallow: an object changed in
    place is not seen), to put back with :func:`restore`."""
    return tuple((m, dict(vars(m))) for m in modules)


def changes(before: Snapshot) -> Changes:
    """What was set or deleted since ``before``: (module, name, new value or :data:`GONE`)."""
    found: list[tuple[torch.nn.Module, str, Any]] = []
    for m, old in before:
        now = vars(m)
        found += [(m, n, v) for n, v in now.items() if old.get(n, _MISSING) is not v]
        found += [(m, n, GONE) for n in old.keys() - now.keys()]
    return tuple(found)


def restore(before: Snapshot) -> None:
    """Put every attribute back as ``before`` holds it (added ones deleted)."""
    for m, old in before:
        now = vars(m)
        for name in [n for n in now if n not in old]:
            del now[name]
        for name, value in old.items():
            if now.get(name, _MISSING) is not value:
                now[name] = value


def apply(done: Changes) -> None:
    """Make ``done`` (from :func:`changes`) again."""
    for m, name, value in done:
        if value is GONE:
            vars(m).pop(name, None)
        else:
            vars(m)[name] = value


@attrs.frozen(eq=False)
class Attributes:
    """The public attributes of a module tree, as a graph was traced with them, except those
    the traced forward set itself (``skip``: warned at export, ORT cannot follow them).

    A value counts as changed when the attribute holds another object, except a plain scalar
    or string equal to the old one and of the same type (``1`` and ``1.0`` and ``True`` are
    equal but trace as different constants): ``model.block.act = torch.tanh``, a new tuple or
    enum member, another tensor all change what the forward traced. An object changed in place
    (a list appended to) is not seen. :meth:`changed` is two C-level maps (identities, and the
    sizes of the modules' dicts, which see an attribute added or deleted)."""

    modules: tuple[torch.nn.Module, ...]
    module_dicts: tuple[dict[str, Any], ...]
    sizes: list[int]
    dicts: tuple[dict[str, Any], ...]  # each module's __dict__, once per attribute
    names: tuple[str, ...]
    values: list[Any]
    owners: tuple[torch.nn.Module, ...]
    skip: frozenset[tuple[int, str]] = frozenset()

    @classmethod
    def of(
        cls, modules: Iterable[torch.nn.Module], skip: frozenset[tuple[int, str]] = frozenset()
    ) -> Attributes:
        tree = tuple(modules)
        dicts: list[dict[str, Any]] = []
        names: list[str] = []
        values: list[Any] = []
        owners: list[torch.nn.Module] = []
        for m in tree:
            d = vars(m)
            for n, v in d.items():
                if _public(n) and (id(m), n) not in skip and not _ours(v):
                    dicts.append(d)
                    names.append(n)
                    values.append(v)
                    owners.append(m)
        module_dicts = tuple(vars(m) for m in tree)
        return cls(
            tree,
            module_dicts,
            list(map(len, module_dicts)),
            tuple(dicts),
            tuple(names),
            values,
            tuple(owners),
            skip,
        )

    def changed(self) -> bool:
        """Whether an attribute may hold another value now, or one was added or deleted (a
        forward may read a new one with ``getattr(self, name, default)``); :meth:`cause` then
        says whether it really does."""
        if list(map(len, self.module_dicts)) != self.sizes:
            return True
        return not all(map(operator.is_, map(dict.get, self.dicts, self.names), self.values))

    def cause(self) -> str | None:
        """Which public attribute changed, for the log; None when none did (an equal scalar
        set again, a private name added: :meth:`refreshed` then)."""
        for d, name, value, owner in zip(
            self.dicts, self.names, self.values, self.owners, strict=True
        ):
            now = d.get(name, _MISSING)
            if now is not value and not _same_scalar(now, value):
                return f"attribute {name!r} of {type(owner).__name__} set outside the wrapper"
        known = set(zip(map(id, self.dicts), self.names, strict=True))
        for m, d in zip(self.modules, self.module_dicts, strict=True):
            for n, v in d.items():
                if (
                    _public(n)
                    and (id(d), n) not in known
                    and (id(m), n) not in self.skip
                    and not _ours(v)
                ):
                    return f"attribute {n!r} of {type(m).__name__} set outside the wrapper"
        return None

    def refreshed(self, skip: Iterable[tuple[int, str]] = ()) -> Attributes:
        """The same tree's attributes as they are now (``skip`` grown by ``skip``)."""
        return Attributes.of(self.modules, self.skip | frozenset(skip))


def _same_scalar(now: Any, before: Any) -> bool:
    """An equal plain value of the same type, or a tuple of such (``m.hint = (4,)`` set again):
    the same constant for a trace."""
    if type(now) is not type(before):
        return False
    if type(now) is tuple:
        return len(now) == len(before) and all(map(_same_scalar, now, before))
    return type(now) in PLAIN and bool(now == before)
