"""What ran during a trace and what its code loads (read from the bytecode): the inputs of
:mod:`ortfx.outside.collect`."""

from __future__ import annotations

import dis
import gc
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
    # Attribute chains on the other named arguments, headed by the argument's name
    # (``def scale(y, cfg): return y * cfg.scale``: ``("cfg", "scale")``); arguments the
    # code changes (``cfg.log.append``) are left out: their state is the code's own.
    argument_chains: tuple[tuple[str, ...], ...] = ()


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


def users_code(code: types.CodeType) -> bool:
    """Whether ``code`` is the user's own (not the standard library's, nor an installed
    package's: torch's exporters, onnxscript and tempfile draw random names of their own)."""
    return _guarded_file(code.co_filename) and not _library(code)


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
    named = frozenset(code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount])
    chains: list[tuple[str, ...]] = []
    selfs: list[tuple[str, ...]] = []
    others: list[tuple[str, ...]] = []
    changed_arguments: set[str] = set()
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
            if mutates and target is others:
                changed_arguments.add(chain[0])
            elif mutates:
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
        elif name == "LOAD_FAST" and ins.argval in named:
            current, target = [str(ins.argval)], others
        if name in ("STORE_FAST", "DELETE_FAST") and ins.argval in named:
            changed_arguments.add(str(ins.argval))  # rebound: no longer the caller's object
    close()
    return Scan(
        tuple(dict.fromkeys(chains)),
        tuple(dict.fromkeys(selfs)),
        frozenset(stores),
        frozenset(global_stores),
        tuple(c for c in dict.fromkeys(others) if len(c) > 1 and c[0] not in changed_arguments),
    )


@attrs.define
class Ran:
    """What ran during one trace (filled by the profile hook): each guarded code object with
    its globals, the tree's objects it ran on as ``self``, and the environment variables read."""

    code: dict[types.CodeType, dict[str, Any]] = attrs.Factory(dict)
    selves: dict[types.CodeType, dict[int, Any]] = attrs.Factory(dict)
    # The objects passed as the named arguments whose attributes the code reads: code ->
    # (argument name, id) -> object (not tensors: only plain objects are guarded).
    arguments: dict[types.CodeType, dict[tuple[str, int], Any]] = attrs.Factory(dict)
    # Where the user's own code asked whether it is traced (torch.jit.is_tracing,
    # torch.onnx.is_in_onnx_export): True while ortfx exports, False in every eager call.
    tracing_queries: dict[str, None] = attrs.Factory(dict)
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
        if code in _tracing_queries():
            caller = frame.f_back
            if caller is not None and users_code(caller.f_code):
                where = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
                self.tracing_queries[f"{code.co_name}() at {where}"] = None
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
        if found.argument_chains:
            passed = self.arguments.setdefault(code, {})
            for name in {chain[0] for chain in found.argument_chains}:
                value = frame.f_locals.get(name, _MISSING)
                if value is not _MISSING and not isinstance(value, torch.Tensor):
                    passed.setdefault((name, id(value)), value)

    def returned(self, frame: types.FrameType) -> None:
        """A profile hook's ``return`` event."""
        if self.applying and frame.f_code is _torch.FUNCTION_APPLY_CODE:
            self.applying.discard(id(frame))


_ENVIRON_GET: Final = type(os.environ).__getitem__.__code__
_QUERIES: list[frozenset[types.CodeType]] = []


def _tracing_queries() -> frozenset[types.CodeType]:
    """The code of torch's "am I traced?" questions, looked up on first use (``torch.onnx``
    is not imported by ``import ortfx``, and a torch without TorchScript has no exporter)."""
    if not _QUERIES:
        found = [vars(torch.jit).get("is_tracing")]
        onnx = sys.modules.get("torch.onnx")
        if onnx is not None:
            found.append(vars(onnx).get("is_in_onnx_export"))
        queries = frozenset(f.__code__ for f in found if isinstance(f, types.FunctionType))
        if onnx is None:
            return queries  # looked up again once torch.onnx is there
        _QUERIES.append(queries)
    return _QUERIES[0]


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
