"""The :class:`Outside` record of what a trace read, and how each call compares it."""

from __future__ import annotations

import operator
import os
import sys
import types
from collections.abc import Iterable
from typing import Any, Final

import attrs
import numpy as np
import torch

from ortfx import _torch
from ortfx.outside.code import (
    _LIBRARIES,
    _MISSING,
    _NOT_GUARDED,
    _PLAIN,
    _STDLIB,
    MAX_ITEMS,
    Unguardable,
)


@attrs.frozen(eq=False)
class Outside:
    """The values a graph's trace read outside its inputs, parameters and buffers.

    :meth:`changed` is C-level maps over the identity entries (``dict.get`` on module,
    instance and object dicts; ``mappingproxy.get`` on class dicts) and short loops over the
    copied containers, tensors and environment variables; :meth:`cause` names the first real
    change (a plain value set equal again is none: :meth:`refreshed` then)."""

    dicts: tuple[dict[str, Any], ...] = ()  # module globals, instance and object dicts
    names: tuple[str, ...] = ()
    values: tuple[Any, ...] = ()  # dict.get's answer (None for an absent name)
    where: tuple[str, ...] = ()  # for the log: "global 'SCALE' of m"
    proxies: tuple[types.MappingProxyType[str, Any], ...] = ()  # class dicts
    classes: tuple[type, ...] = ()  # whose dicts they are
    proxy_names: tuple[str, ...] = ()
    proxy_values: tuple[Any, ...] = ()
    proxy_where: tuple[str, ...] = ()
    copies: tuple[tuple[int, Any], ...] = ()  # index in dicts -> copy of a container's contents
    cells: tuple[types.CellType, ...] = ()
    cell_values: tuple[Any, ...] = ()
    cell_where: tuple[str, ...] = ()
    tensors: tuple[tuple[torch.Tensor, int, str], ...] = ()  # plain tensor attributes
    environ: tuple[tuple[str, str | None], ...] = ()
    # Functions reached (a class's forward, a global helper) with their code and defaults:
    # a notebook's autoreload replaces ``__code__`` in place, keeping the function object.
    functions: tuple[types.FunctionType, ...] = ()
    function_codes: tuple[types.CodeType, ...] = ()
    function_defaults: tuple[Any, ...] = ()
    function_where: tuple[str, ...] = ()
    # The tree's modules and their classes (``module.__class__ = Other`` swaps the forward).
    instances: tuple[Any, ...] = ()
    instance_types: tuple[type, ...] = ()
    # Copies of class-level containers, by index in ``proxies``.
    proxy_copies: tuple[tuple[int, Any], ...] = ()
    # What the traced forward set itself (for the export's WARNING; not compared).
    writes: tuple[str, ...] = ()

    def __len__(self) -> int:
        return (
            len(self.names)
            + len(self.proxy_names)
            + len(self.cells)
            + len(self.environ)
            + len(self.functions)
        )

    def changed(self) -> bool:
        if not all(map(operator.is_, map(dict.get, self.dicts, self.names), self.values)):
            return True
        if not all(
            map(operator.is_, map(_PROXY_GET, self.proxies, self.proxy_names), self.proxy_values)
        ):
            return True
        try:
            if self.cells and not all(
                map(operator.is_, map(_CELL_CONTENTS, self.cells), self.cell_values)
            ):
                return True
        except ValueError:  # a cell emptied
            return True
        if self.functions and not (
            all(map(operator.is_, map(_CODE, self.functions), self.function_codes))
            and all(map(operator.is_, map(_DEFAULTS, self.functions), self.function_defaults))
        ):
            return True
        if self.copies and any(
            not _same_contents(self.values[k], copied) for k, copied in self.copies
        ):
            return True
        if self.proxy_copies and any(
            not _same_contents(self.proxy_values[k], copied) for k, copied in self.proxy_copies
        ):
            return True
        if not all(map(operator.is_, map(type, self.instances), self.instance_types)):
            return True
        if self.tensors and any(_torch.version(t) != v for t, v, _ in self.tensors):
            return True
        return bool(self.environ) and any(
            os.environ.get(key) != value for key, value in self.environ
        )

    def cause(self) -> str | None:
        """What changed, for the log; None when nothing the trace read holds another value."""
        entries = [
            *zip(map(dict.get, self.dicts, self.names), self.values, self.where, strict=True),
            *zip(
                map(_PROXY_GET, self.proxies, self.proxy_names),
                self.proxy_values,
                self.proxy_where,
                strict=True,
            ),
            *zip(map(_contents, self.cells), self.cell_values, self.cell_where, strict=True),
        ]
        for now, value, where in entries:
            if now is not value and not _same_plain(now, value):
                return f"{where} changed outside the wrapper"
        for k, copied in self.copies:
            if not _same_contents(self.values[k], copied):
                return f"{self.where[k]} changed in place outside the wrapper"
        for k, copied in self.proxy_copies:
            if not _same_contents(self.proxy_values[k], copied):
                return f"{self.proxy_where[k]} changed in place outside the wrapper"
        for instance, kind in zip(self.instances, self.instance_types, strict=True):
            if type(instance) is not kind:
                return (
                    f"the class of a {kind.__name__} module changed to "
                    f"{type(instance).__name__} outside the wrapper"
                )
        for function, code, defaults, where in self.function_entries():
            if function.__code__ is not code or function.__defaults__ is not defaults:
                return f"the code of {where} changed (reloaded)"
        for t, v, where in self.tensors:
            if _torch.version(t) != v:
                return f"{where} changed in place outside the wrapper"
        for key, value in self.environ:
            if os.environ.get(key) != value:
                return f"environment variable {key!r} changed"
        return None

    def function_entries(self) -> Iterable[tuple[types.FunctionType, types.CodeType, Any, str]]:
        return zip(
            self.functions,
            self.function_codes,
            self.function_defaults,
            self.function_where,
            strict=True,
        )

    def refreshed(self) -> Outside:
        """The same reads with the values of now (after a change :meth:`cause` found none)."""
        return attrs.evolve(
            self,
            values=tuple(map(dict.get, self.dicts, self.names)),
            proxy_values=tuple(map(_PROXY_GET, self.proxies, self.proxy_names)),
            cell_values=tuple(map(_contents, self.cells)),
            function_codes=tuple(map(_CODE, self.functions)),
            function_defaults=tuple(map(_DEFAULTS, self.functions)),
            tensors=tuple((t, _torch.version(t), w) for t, _, w in self.tensors),
            environ=tuple((k, os.environ.get(k)) for k, _ in self.environ),
        )

    def merged(self, other: Outside) -> Outside:
        """Both graphs' reads (a wrapper's graphs of several calls), each entry once."""
        if not len(other):
            return self
        if not len(self):
            return other
        from ortfx.outside.collect import Builder  # the builder makes records: no cycle at import

        build = Builder(())
        build.absorb(self)
        build.absorb(other)
        return build.build(())


_PROXY_GET: Final = types.MappingProxyType.get
# Only filled cells are kept; one emptied since (``del`` of a nonlocal) then raises ValueError.
_CELL_CONTENTS: Final = operator.attrgetter("cell_contents")
_CODE: Final = operator.attrgetter("__code__")
_DEFAULTS: Final = operator.attrgetter("__defaults__")


def _filled(cell: types.CellType) -> bool:
    return _contents(cell) is not _MISSING


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _MISSING


def _same_plain(now: Any, before: Any) -> bool:
    """An equal plain value of the same type, or a tuple of such: the same constant for a
    trace."""
    if type(now) is not type(before):
        return False
    if type(now) is tuple:
        return len(now) == len(before) and all(map(_same_plain, now, before))
    return isinstance(now, _PLAIN) and bool(now == before)


@attrs.frozen(eq=False)
class _Tensor:
    """A tensor inside a snapshot: the same object, unchanged in place."""

    tensor: torch.Tensor
    version: int


@attrs.frozen(eq=False)
class _Object:
    """A config-like object inside a snapshot (``self.cfgs[0]``): the same object, with
    its fields as they were (a forward reading ``self.cfgs[0].scale`` reads them)."""

    obj: Any
    fields: dict[str, Any]


def _config_like(value: Any) -> bool:
    return (
        type(getattr(value, "__dict__", None)) is dict
        and not isinstance(value, torch.Tensor | torch.nn.Module | type | types.ModuleType)
        and not callable(value)
    )


def _copy(value: Any, depth: int = 0) -> Any:
    """A snapshot of a container's contents: plain values copied, NumPy arrays copied,
    tensors by identity and version, config-like objects by identity and a copy of their
    fields (two levels down), other objects by identity."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, torch.Tensor):
        return _Tensor(value, _torch.version(value))
    if isinstance(value, list | tuple):
        if type(value) not in (list, tuple):
            return value
        return type(value)(_copy(v, depth) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _copy(v, depth) for k, v in value.items()}
    if isinstance(value, set | bytearray) and type(value) in (set, bytearray):
        return type(value)(value)
    if depth < 2 and _config_like(value):
        return _Object(value, {k: _copy(v, depth + 1) for k, v in vars(value).items()})
    return value


def _same_contents(value: Any, copied: Any) -> bool:
    """Whether ``value`` still holds what :func:`_copy` took."""
    if isinstance(copied, _Tensor):
        return value is copied.tensor and _torch.version(value) == copied.version
    if isinstance(copied, _Object):
        return value is copied.obj and _same_contents(vars(value), copied.fields)
    if isinstance(value, np.ndarray):
        return (
            isinstance(copied, np.ndarray)
            and value.shape == copied.shape
            and value.dtype == copied.dtype
            and bool(np.array_equal(value, copied, equal_nan=value.dtype.kind in "fc"))
        )
    if type(value) is not type(copied):
        return False
    if type(value) in (list, tuple):
        return len(value) == len(copied) and all(map(_same_contents, value, copied))
    if type(value) is dict:
        return value.keys() == copied.keys() and all(
            _same_contents(v, copied[k]) for k, v in value.items()
        )
    if isinstance(value, float) and value != value:  # NaN: the same constant as NaN
        return isinstance(copied, float) and copied != copied
    if isinstance(value, _PLAIN) or type(value) in (set, bytearray):
        try:
            return bool(value == copied)
        except Exception:  # contents that cannot be compared
            return False
    return value is copied


def _items(value: Any, depth: int = 0) -> int:
    """How many values a snapshot of ``value`` holds (nested containers and the fields of
    config-like objects in them counted through)."""
    if isinstance(value, np.ndarray):
        return int(value.size)
    if depth < 2 and not isinstance(value, _NESTED) and _config_like(value):
        return 1 + sum(_items(v, depth + 1) for v in vars(value).values())
    if type(value) in (list, tuple):
        return len(value) + sum(_items(v, depth) for v in value if _counted(v))
    if type(value) is dict:
        return len(value) + sum(_items(v, depth) for v in value.values() if _counted(v))
    return len(value) if isinstance(value, set | bytearray) else 1


_NESTED: Final = (list, tuple, dict, np.ndarray)


def _counted(value: Any) -> bool:
    return type(value) in _NESTED or isinstance(value, np.ndarray) or _config_like(value)


def _snapshot(value: Any, where: str) -> Any:
    """:func:`_copy` of a container the forward reads; raises :class:`Unguardable` when it is
    too large to compare on every call, or cannot be compared."""
    size = _items(value)
    if size > MAX_ITEMS:
        raise Unguardable(
            f"{where} (a {type(value).__name__} of {size} items: the graph holds its "
            f"contents as constants, and comparing them on every call would cost more "
            f"than the call)"
        )
    copied = _copy(value)
    if not _same_contents(value, copied):
        raise Unguardable(f"{where} (a {type(value).__name__} that cannot be compared)")
    return copied


def _user_module(name: str) -> bool:
    """Whether the module called ``name`` is the user's code (not an installed package's,
    the standard library's, torch's or ortfx's)."""
    if name.startswith(_NOT_GUARDED) or name in ("builtins", "torch", "ortfx"):
        return False
    module = sys.modules.get(name)
    filename = getattr(module, "__file__", None)
    if not filename:
        return name == "__main__"
    real = os.path.realpath(filename)
    return not real.startswith(_STDLIB) and not any(lib in real for lib in _LIBRARIES)
