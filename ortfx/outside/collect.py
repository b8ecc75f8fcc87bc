"""Building an :class:`~ortfx.outside.record.Outside` from what ran: the guards of one trace."""

from __future__ import annotations

import os
import random
import types
from collections.abc import Iterable
from typing import Any, Final

import numpy as np
import torch

from ortfx import _torch
from ortfx.outside.code import (
    _CONTAINERS,
    _MISSING,
    _MODULE_OWN,
    Ran,
    Unguardable,
    _library,
    scan,
    static,
)
from ortfx.outside.record import Outside, _contents, _filled, _snapshot, _user_module


class Builder:
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
        _refuse_generator(value, where)
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
        _refuse_generator(value, where)
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


# Random number generators of Python and NumPy a forward may hold (``self.rng``): a draw from
# one is a Python number the trace bakes in, and its state moves with every draw, so no
# comparison could tell a graph that holds the first draw from the call's own.
GENERATORS: Final = (
    random.Random,
    np.random.Generator,
    np.random.RandomState,
    np.random.BitGenerator,
)


def generator_name(method: Any) -> str:
    """How the log names the generator a drawing method belongs to."""
    owner = method.__self__
    if owner is getattr(random.random, "__self__", None):
        return "Python's random module"
    if owner is getattr(np.random.rand, "__self__", None):
        return "NumPy's global random state"
    kind = type(owner)
    return f"a {kind.__module__}.{kind.__qualname__} ({method.__name__})"


def _refuse_generator(value: Any, where: str) -> None:
    if isinstance(value, GENERATORS):
        raise Unguardable(
            f"{where} (a {type(value).__name__}, a random number generator: the graph would "
            "hold the numbers it drew while traced, on every call; draw with torch instead)"
        )


def _plain_object(obj: Any) -> bool:
    """A config-like object whose fields a forward reads (a dataclass, a namespace)."""
    return (
        isinstance(getattr(obj, "__dict__", None), dict)
        and not isinstance(obj, torch.Tensor | torch.nn.Module | types.FunctionType)
        and not isinstance(obj, types.MethodType | type | types.ModuleType)
    )


def collect(ran: Ran | None, tree: Iterable[torch.nn.Module]) -> Outside:
    """The guards of what the trace read (after it, as the values are now); ``ran`` None: of
    what the tree's classes could read. Raises :class:`Unguardable` for state that cannot be
    compared on every call."""
    modules = tuple(tree)
    if ran is None:
        ran = static(modules)
    build = Builder(modules)
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
    done: set[tuple[Any, ...]] = set()
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
        # The chains on other arguments, for objects the guards reach (a config the module
        # holds, passed to a helper: ``scale(y, self.cfg)`` reading ``cfg.scale``).
        for code, passed in ran.arguments.items():
            found = scan(code)
            if found is None:
                continue
            for (name, key), value in passed.items():
                if (code, key, name) in done or not (
                    key in build.tree
                    or (isinstance(value, type) and key in classes)
                    or (key in reached and _plain_object(value))
                ):
                    continue
                done.add((code, key, name))
                where = f" (argument {name!r} of {code.co_name})"
                for chain in found.argument_chains:
                    if chain[0] == name:
                        build.chain(value, chain[1:], where, contents=True)
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
