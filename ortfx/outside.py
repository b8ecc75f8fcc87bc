"""State a traced forward read that is not an argument, parameter or buffer, and its guards.

The tracer runs Python once and keeps only the tensor ops: every value the forward read from
elsewhere (a module global, a helper module's function, a class attribute or a class's
``forward``, a closure cell, a private attribute, an environment variable, a config object's
field) is baked into the graph. ortfx records which code ran during the trace (a profile
hook, :mod:`ortfx.export.reads`), reads each code object's loads from its bytecode (globals
and the attribute chains on them, attribute chains on ``self``) and, after the trace, takes
the values those loads reach: :class:`Outside`. Each later call compares them (identity;
plain scalars and strings by value; lists, dicts, sets and NumPy arrays by a copy of their
contents; tensors by identity and version): a change re-exports, with the change named in the
log. What cannot be compared cheaply (a container of more than :data:`MAX_ITEMS` items) is
refused when traced (:class:`Unguardable`).

Only persistent state is guarded: module globals, the module tree's own attributes and the
objects reached from them, the classes of the tree. Objects a call creates (its inputs, a cache
object) are never held. Library code (installed packages) is guarded by identity only: its
registries may grow in place without changing what the forward computes. The standard library
and torch's, ortfx's and the exporters' own code are not guarded.
"""

from __future__ import annotations

import dis
import gc
import operator
import os
import sys
import sysconfig
import types
from collections.abc import Iterable
from typing import Any, Final

import attrs
import numpy as np
import torch

from ortfx import _torch

# A container with more items than this is not copied on every trace and compared on every
# call: the forward reading one is refused (keep such tables in a buffer).
MAX_ITEMS: Final = 10_000

_MISSING = object()
# Names every nn.Module holds in its instance dict: torch's bookkeeping, compared elsewhere.
_MODULE_OWN: Final = frozenset(vars(torch.nn.Module())) | {"forward"}
_LOADS_ATTR: Final = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_CONTAINERS: Final = (list, dict, set, bytearray, np.ndarray)
_PLAIN: Final = (bool, int, float, complex, str, bytes, type(None))
# Code under these module names is bookkeeping (torch's, ortfx's, the exporters'): not guarded.
_NOT_GUARDED: Final = ("torch.", "ortfx.", "onnx.", "onnxscript.", "onnxruntime.", "optree.")
_STDLIB: Final = tuple(
    os.path.realpath(p) + os.sep
    for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
)
_LIBRARIES: Final = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


class Unguardable(Exception):
    """The forward read state ortfx cannot compare cheaply on every call."""


@attrs.frozen
class Scan:
    """What one code object loads: global names with the attribute chains read on them, and
    attribute chains on its first argument (``self``)."""

    globals: tuple[tuple[str, ...], ...]
    self_chains: tuple[tuple[str, ...], ...]
    # Attribute names the code sets (on any object: ``self.calls += 1`` among them). The
    # forward's own writes are Python state the graph cannot follow (warned at export for
    # public names); a value it writes is no change behind the graph when eager runs it.
    stores: frozenset[str] = frozenset()
    global_stores: frozenset[str] = frozenset()  # ``global STEP; STEP += 1``


_SCANS: dict[types.CodeType, Scan | None] = {}


def scan(code: types.CodeType) -> Scan | None:
    """The loads of ``code`` (cached per code object), or None for code that is not guarded."""
    try:
        return _SCANS[code]
    except KeyError:
        pass
    found = _scan(code) if _guarded_file(code.co_filename) else None
    if len(_SCANS) >= 20_000:
        _SCANS.clear()
    _SCANS[code] = found
    return found


def _guarded_file(filename: str) -> bool:
    if filename.startswith("<frozen"):
        return False
    real = os.path.realpath(filename)
    return not real.startswith(_STDLIB) or any(lib in real for lib in _LIBRARIES)


# Methods that change their object in place: called on a chain the forward reads, the
# object is the forward's own state (a log dict it fills, a buffer-like tensor it updates).
_MUTATORS: Final = frozenset(
    {
        "append", "extend", "insert", "update", "clear", "pop", "popitem", "add",
        "setdefault", "remove", "discard", "__setitem__", "__delitem__", "sort", "reverse",
    }
)  # fmt: skip
_SUBSCRIPT_STORES: Final = frozenset({"STORE_SUBSCR", "DELETE_SUBSCR"})


def _scan(code: types.CodeType) -> Scan:
    """Read ``code``'s loads (see :class:`Scan`): chains of LOAD_ATTR/LOAD_METHOD after a
    LOAD_GLOBAL or a load of the first argument, or of a local assigned such a chain
    (``cfg = self.cfg`` then ``cfg.scale``). A straight read of the bytecode, ignoring
    control flow: what it finds is what the code can load."""
    first = code.co_varnames[0] if code.co_argcount and code.co_varnames else None
    chains: list[tuple[str, ...]] = []
    selfs: list[tuple[str, ...]] = []
    stores: set[str] = set()
    global_stores: set[str] = set()
    aliases: dict[str, tuple[str, ...]] = {}
    current: list[str] | None = None
    target: list[tuple[str, ...]] | None = None
    last: tuple[str, ...] | None = None  # the self chain closed last, for a store after it
    since = 0  # instructions since it closed

    def close() -> tuple[str, ...] | None:
        if current is not None and target is not None and current:
            chain = tuple(current)
            target.append(chain)
            mutates = len(chain) > 1 and (chain[-1] in _MUTATORS or chain[-1].endswith("_"))
            if target is selfs:
                if mutates:
                    stores.add(chain[0])  # self.log.append(...), self.table.fill_(...)
                return chain
            if mutates:
                global_stores.add(chain[0])  # LOG.append(...): the forward's own state
        return None

    for ins in dis.get_instructions(code):
        name = ins.opname
        if name == "STORE_ATTR":
            stores.add(str(ins.argval))
        elif name == "STORE_GLOBAL":
            global_stores.add(str(ins.argval))
        if name in _LOADS_ATTR and current is not None:
            current.append(str(ins.argval))
            continue
        closed = close()
        if closed is not None:
            last, since = closed, 0
        since += 1
        if name in _SUBSCRIPT_STORES and last is not None and since <= 3:
            stores.add(last[0])  # self.log["mean"] = ..., del self.cache[k]
        if name == "STORE_FAST" and closed is not None:
            aliases[str(ins.argval)] = closed  # cfg = self.cfg
        current = target = None
        if name == "LOAD_GLOBAL":
            current, target = [str(ins.argval)], chains
        elif name in ("LOAD_FAST", "LOAD_DEREF") and first is not None and ins.argval == first:
            current, target = [], selfs
        elif name == "LOAD_FAST" and str(ins.argval) in aliases:
            current, target = list(aliases[str(ins.argval)]), selfs
    close()
    return Scan(
        tuple(dict.fromkeys(chains)),
        tuple(dict.fromkeys(selfs)),
        frozenset(stores),
        frozenset(global_stores),
    )


@attrs.define
class Ran:
    """What ran during one trace (filled by the profile hook): each guarded code object with
    its globals, the tree's objects it ran on as ``self``, and the environment variables read."""

    code: dict[types.CodeType, dict[str, Any]] = attrs.Factory(dict)
    selves: dict[types.CodeType, dict[int, Any]] = attrs.Factory(dict)
    environ: dict[str, None] = attrs.Factory(dict)
    # Frames of custom autograd Functions' apply being run: their bodies run again at every
    # call (ORT calls them), reading what they read then; not guarded.
    applying: set[int] = attrs.Factory(set)
    # The garbage collector's callbacks (a test framework's timers, a profiler's): they run
    # on this thread whenever a collection happens, and are not the forward's.
    foreign: frozenset[types.CodeType] = attrs.Factory(
        lambda: frozenset(c.__code__ for c in gc.callbacks if isinstance(c, types.FunctionType))
    )

    def called(self, frame: types.FrameType) -> None:
        """A profile hook's ``call`` event."""
        code = frame.f_code
        if code is _torch.FUNCTION_APPLY_CODE:
            self.applying.add(id(frame))
            return
        if self.applying or code in self.foreign:
            return
        if code is _ENVIRON_GET:
            key = frame.f_locals.get("key")
            if isinstance(key, str):
                self.environ[key] = None
            return
        if frame.f_globals.get("__name__", "").startswith(_NOT_GUARDED):
            return
        found = scan(code)
        if found is None:
            return
        self.code.setdefault(code, frame.f_globals)
        if found.self_chains:
            me = frame.f_locals.get(code.co_varnames[0], _MISSING)
            if me is not _MISSING:
                self.selves.setdefault(code, {}).setdefault(id(me), me)

    def returned(self, frame: types.FrameType) -> None:
        """A profile hook's ``return`` event."""
        if self.applying and frame.f_code is _torch.FUNCTION_APPLY_CODE:
            self.applying.discard(id(frame))


_ENVIRON_GET: Final = type(os.environ).__getitem__.__code__


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
        build = _Builder(())
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


def _copy(value: Any) -> Any:
    """A snapshot of a container's contents: plain values copied, NumPy arrays copied,
    tensors by identity and version, other objects by identity."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, torch.Tensor):
        return _Tensor(value, _torch.version(value))
    if isinstance(value, list | tuple):
        return type(value)(map(_copy, value)) if type(value) in (list, tuple) else value
    if isinstance(value, dict) and type(value) is dict:
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, set | bytearray) and type(value) in (set, bytearray):
        return type(value)(value)
    return value


def _same_contents(value: Any, copied: Any) -> bool:
    """Whether ``value`` still holds what :func:`_copy` took."""
    if isinstance(copied, _Tensor):
        return value is copied.tensor and _torch.version(value) == copied.version
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
    if isinstance(value, _PLAIN) or type(value) in (set, bytearray):
        try:
            return bool(value == copied)
        except Exception:  # contents that cannot be compared
            return False
    return value is copied


def _items(value: Any) -> int:
    """How many values a snapshot of ``value`` holds (nested containers counted through)."""
    if isinstance(value, np.ndarray):
        return int(value.size)
    if type(value) in (list, tuple):
        return len(value) + sum(_items(v) for v in value if type(v) in _NESTED)
    if type(value) is dict:
        return len(value) + sum(_items(v) for v in value.values() if type(v) in _NESTED)
    return len(value) if isinstance(value, set | bytearray) else 1


_NESTED: Final = (list, tuple, dict, np.ndarray)


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


class _Builder:
    """Collects the entries of an :class:`Outside` (each (holder, name) once)."""

    def __init__(self, tree: Iterable[torch.nn.Module]) -> None:
        self.tree = {id(m): m for m in tree}
        self.seen: set[tuple[int, str]] = set()
        self.dicts: list[dict[str, Any]] = []
        self.names: list[str] = []
        self.values: list[Any] = []
        self.where: list[str] = []
        self.proxies: list[types.MappingProxyType[str, Any]] = []
        self.classes: list[type] = []
        self.proxy_names: list[str] = []
        self.proxy_values: list[Any] = []
        self.proxy_where: list[str] = []
        self.proxy_copies: list[tuple[int, Any]] = []
        self.copies: list[tuple[int, Any]] = []
        self.cells: dict[int, tuple[types.CellType, Any, str]] = {}
        self.tensors: dict[int, tuple[torch.Tensor, int, str]] = {}
        self.environ: dict[str, str | None] = {}
        self.functions: dict[int, tuple[types.FunctionType, types.CodeType, Any, str]] = {}
        self.instances: dict[int, tuple[Any, type]] = {
            id(m): (m, type(m)) for m in self.tree.values()
        }
        self.writes: list[str] = []

    def entry(self, d: dict[str, Any], name: str, where: str, *, contents: bool) -> Any:
        """Guard ``d[name]`` (absent included); its value, or _MISSING."""
        value = d.get(name, _MISSING)
        key = (id(d), name)
        if key in self.seen:
            return value
        self.seen.add(key)
        if contents and isinstance(value, _CONTAINERS):
            self.copies.append((len(self.names), _snapshot(value, where)))
        self._tensor(value, where)
        self.dicts.append(d)
        self.names.append(name)
        self.values.append(d.get(name))
        self.where.append(where)
        self._closure(value, where)
        return value

    def class_entry(self, klass: type, name: str) -> Any:
        """Guard ``vars(klass)[name]`` (absent included); its value, or _MISSING."""
        proxy = vars(klass)
        value = proxy.get(name, _MISSING)
        key = (id(klass), name)
        if key in self.seen:
            return value
        self.seen.add(key)
        where = f"{name!r} of class {klass.__qualname__}"
        if isinstance(value, _CONTAINERS) and _user_module(klass.__module__):
            self.proxy_copies.append((len(self.proxies), _snapshot(value, where)))
        self._tensor(value, where)
        self.proxies.append(proxy)
        self.classes.append(klass)
        self.proxy_names.append(name)
        self.proxy_values.append(proxy.get(name))
        self.proxy_where.append(where)
        self._closure(value, where)
        return value

    def _tensor(self, value: Any, where: str) -> None:
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            self.tensors.setdefault(id(value), (value, _torch.version(value), where))

    def absorb(self, read: Outside) -> None:
        """Take ``read``'s entries (those not held yet), as they were recorded."""
        for k, (d, name) in enumerate(zip(read.dicts, read.names, strict=True)):
            if (id(d), name) not in self.seen:
                self.seen.add((id(d), name))
                self.dicts.append(d)
                self.names.append(name)
                self.values.append(read.values[k])
                self.where.append(read.where[k])
                self.copies.extend((len(self.names) - 1, c) for j, c in read.copies if j == k)
        for k, (proxy, klass, name, value, where) in enumerate(
            zip(
                read.proxies,
                read.classes,
                read.proxy_names,
                read.proxy_values,
                read.proxy_where,
                strict=True,
            )
        ):
            if (id(klass), name) not in self.seen:
                self.seen.add((id(klass), name))
                self.proxy_copies.extend(
                    (len(self.proxies), c) for j, c in read.proxy_copies if j == k
                )
                self.proxies.append(proxy)
                self.classes.append(klass)
                self.proxy_names.append(name)
                self.proxy_values.append(value)
                self.proxy_where.append(where)
        for cell, value, where in zip(read.cells, read.cell_values, read.cell_where, strict=True):
            self.cells.setdefault(id(cell), (cell, value, where))
        for t, v, where in read.tensors:
            self.tensors.setdefault(id(t), (t, v, where))
        for function, code, defaults, where in read.function_entries():
            self.functions.setdefault(id(function), (function, code, defaults, where))
        for variable, setting in read.environ:
            self.environ.setdefault(variable, setting)
        for instance, kind in zip(read.instances, read.instance_types, strict=True):
            self.instances.setdefault(id(instance), (instance, kind))

    def _closure(self, value: Any, where: str) -> None:
        """A function's code and defaults, and its closure cells: a factory's arguments, a
        decorator's wrapped function."""
        function = value.__func__ if isinstance(value, types.MethodType) else value
        if not isinstance(function, types.FunctionType) or _library(function.__code__):
            return  # an installed package's functions: never reloaded in place, cells never set
        self.functions.setdefault(
            id(function), (function, function.__code__, function.__defaults__, where)
        )
        if not function.__closure__:
            return
        for name, cell in zip(function.__code__.co_freevars, function.__closure__, strict=True):
            if id(cell) not in self.cells and name != "__class__" and _filled(cell):
                self.cells[id(cell)] = (
                    cell,
                    _contents(cell),
                    f"{name!r} in the closure of {where}",
                )

    def attribute(self, obj: Any, name: str, where: str, *, contents: bool) -> Any:
        """Guard what ``obj.name`` reads: the instance's own entry, or the class entries down
        to the one that defines it (a subclass overriding it later changes the read)."""
        own = getattr(obj, "__dict__", None)
        if isinstance(obj, type):
            return self.along_mro(obj, name)
        if isinstance(obj, types.ModuleType):
            return self.entry(vars(obj), name, f"{name!r} of module {obj.__name__}", contents=False)
        if isinstance(obj, torch.Tensor) or not isinstance(own, dict):
            return _MISSING
        if isinstance(obj, torch.nn.Module):
            if name in _MODULE_OWN - {"forward"}:
                return _MISSING  # torch's bookkeeping and flags: compared elsewhere
            child = _torch.own_modules(obj).get(name, _MISSING)
            if child is not _MISSING:
                return child  # a submodule: registration hooks see it replaced
            if name in _torch.own_parameters(obj) or name in _torch.own_buffers(obj):
                return _MISSING  # fed to the graph
        label = f"attribute {name!r} of {type(obj).__name__}{where}"
        if name == "forward" and isinstance(obj, torch.nn.Module):
            # An instance's own forward is a public attribute (module_state compares it, and
            # knows ortfx's routed one); the class entries are this record's.
            self.along_mro(type(obj), name)
            return own.get(name, _MISSING)
        if name in own:
            return self.entry(own, name, label, contents=contents)
        self.entry(own, name, label, contents=False)  # absent: one set later shadows the class's
        return self.along_mro(type(obj), name)

    def along_mro(self, cls: type, name: str) -> Any:
        """The class entries of ``name`` along ``cls``'s MRO: down to the first class defining
        it (a subclass overriding it later changes the read) and, for ``forward``, every
        class defining one (``super().forward`` reads the next)."""
        value: Any = _MISSING
        for klass in cls.__mro__:
            if klass is object:
                break
            if value is not _MISSING and name not in vars(klass):
                continue  # below the definer: only other definers matter
            found = self.class_entry(klass, name)
            if value is _MISSING:
                value = found
            if found is not _MISSING and name != "forward":
                break
        return value

    def chain(self, root: Any, chain: tuple[str, ...], where: str, *, contents: bool) -> None:
        """Guard each link of ``root.a.b...`` that reads persistent state."""
        obj = root
        for name in chain:
            if not (
                isinstance(obj, type | types.ModuleType)
                or id(obj) in self.tree
                or _plain_object(obj)
            ):
                return
            obj = self.attribute(obj, name, where, contents=contents)
            if obj is _MISSING:
                return
            if isinstance(obj, torch.nn.Module) and id(obj) not in self.tree:
                return  # a module outside the tree: not this graph's state

    def build(self, environ: Iterable[str]) -> Outside:
        for key in environ:
            self.environ.setdefault(key, os.environ.get(key))
        cells = list(self.cells.values())
        return Outside(
            dicts=tuple(self.dicts),
            names=tuple(self.names),
            values=tuple(self.values),
            where=tuple(self.where),
            proxies=tuple(self.proxies),
            classes=tuple(self.classes),
            proxy_names=tuple(self.proxy_names),
            proxy_values=tuple(self.proxy_values),
            proxy_where=tuple(self.proxy_where),
            copies=tuple(self.copies),
            cells=tuple(c for c, _, _ in cells),
            cell_values=tuple(v for _, v, _ in cells),
            cell_where=tuple(w for _, _, w in cells),
            tensors=tuple(self.tensors.values()),
            environ=tuple(self.environ.items()),
            functions=tuple(f for f, _, _, _ in self.functions.values()),
            function_codes=tuple(c for _, c, _, _ in self.functions.values()),
            function_defaults=tuple(d for _, _, d, _ in self.functions.values()),
            function_where=tuple(w for _, _, _, w in self.functions.values()),
            instances=tuple(m for m, _ in self.instances.values()),
            instance_types=tuple(k for _, k in self.instances.values()),
            proxy_copies=tuple(self.proxy_copies),
            writes=tuple(dict.fromkeys(self.writes)),
        )


def _plain_object(obj: Any) -> bool:
    """A config-like object whose fields a forward reads (a dataclass, a namespace)."""
    return (
        isinstance(getattr(obj, "__dict__", None), dict)
        and not isinstance(obj, torch.Tensor | torch.nn.Module | types.FunctionType)
        and not isinstance(obj, types.MethodType | type | types.ModuleType)
    )


def _library(code: types.CodeType) -> bool:
    return any(lib in code.co_filename for lib in _LIBRARIES)


def static(tree: Iterable[torch.nn.Module]) -> Ran:
    """What could run, when no hook watched the trace: every function of the tree's classes
    (and the functions nested in them), on the modules of those classes."""
    ran = Ran()
    for m in tree:
        for klass in type(m).__mro__:
            if klass.__module__.startswith(("torch", "ortfx", "builtins")):
                continue
            for value in vars(klass).values():
                function = getattr(value, "__func__", value)
                if isinstance(function, types.FunctionType):
                    for code in _nested(function.__code__):
                        if scan(code) is not None:
                            ran.code.setdefault(code, function.__globals__)
                            ran.selves.setdefault(code, {})[id(m)] = m
    return ran


def _nested(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def collect(ran: Ran | None, tree: Iterable[torch.nn.Module]) -> Outside:
    """The guards of what the trace read (after it, as the values are now); ``ran`` None: of
    what the tree's classes could read. Raises :class:`Unguardable` for state that cannot be
    compared on every call."""
    modules = tuple(tree)
    if ran is None:
        ran = static(modules)
    build = _Builder(modules)
    for m in modules:  # torch calls every module's forward: its class entries
        build.attribute(m, "forward", "", contents=False)
    for code, globs in ran.code.items():
        found = scan(code)
        if found is None:
            continue
        user = not _library(code)
        module_name = globs.get("__name__", "?")
        if user:  # the forward's own state (a library's globals are its bookkeeping)
            build.writes.extend(
                f"global {n!r} of {module_name}" for n in sorted(found.global_stores)
            )
        for chain in found.globals:
            head = chain[0]
            if head not in globs or head in found.global_stores:
                continue  # a builtin, or a global the forward sets itself
            value = build.entry(globs, head, f"global {head!r} of {module_name}", contents=user)
            if len(chain) > 1 and value is not _MISSING:
                build.chain(value, chain[1:], f" (global {head!r})", contents=user)
    # What each object's code sets on it is its own state, not an input of the graph.
    written: dict[int, set[str]] = {}
    for code, selves in ran.selves.items():
        found = scan(code)
        for key in selves:
            if found is not None:
                written.setdefault(key, set()).update(found.stores)
    # The chains on ``self`` of: the tree's modules, its classes (classmethods), and objects
    # reached from what is guarded (a helper object's __call__, a config's property); twice,
    # for objects reached through those.
    classes = {id(k) for m in modules for k in type(m).__mro__}
    done: set[tuple[types.CodeType, int]] = set()
    for _ in range(2):
        reached = {id(v) for v in (*build.values, *build.proxy_values)}
        for code, selves in ran.selves.items():
            found = scan(code)
            if found is None:
                continue
            for key, me in selves.items():
                if (code, key) in done or not (
                    key in build.tree
                    or (isinstance(me, type) and key in classes)
                    or (key in reached and _plain_object(me))
                ):
                    continue
                done.add((code, key))
                own = written.get(key, set())
                if key in build.tree:
                    build.writes.extend(
                        f"{n!r} of {type(me).__name__}"
                        for n in sorted(own)
                        if n.startswith("_") and n in vars(me) and n not in _MODULE_OWN
                    )
                for chain in found.self_chains:
                    if chain[0] not in own:
                        build.chain(me, chain, "", contents=True)
    return build.build(ran.environ)


def drew(before: tuple[Any, Any], after: tuple[Any, Any]) -> str | None:
    """Which of Python's and NumPy's global random streams moved between two states taken
    by :func:`streams` (the forward drew from it)."""
    if before[0] != after[0]:
        return "Python's random module"
    b, a = before[1], after[1]
    if b[0] != a[0] or not np.array_equal(b[1], a[1]) or b[2:] != a[2:]:
        return "NumPy's global random state"
    return None


def streams() -> tuple[Any, Any]:
    import random

    return random.getstate(), np.random.get_state()


def refusal(module: str, error: Unguardable) -> str:
    return (
        f"the forward of {module} reads {error}. Keep such values in a buffer "
        "(register_buffer) or pass them as arguments, or run the module in PyTorch (the "
        "default fallback policy does)."
    )


__all__ = ["MAX_ITEMS", "Outside", "Ran", "Unguardable", "collect", "scan"]
