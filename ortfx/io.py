"""Flattening of calls and outputs with optree, in ortfx's private ``"ortfx"`` namespace.

Containers optree knows natively (tuple, list, dict, OrderedDict, defaultdict, deque, namedtuple)
need nothing; dataclasses, attrs classes, ``Mapping`` subclasses (transformers' ``ModelOutput``)
and ``torch.Size`` are registered in our namespace the first time they are seen, so the user's
global optree registry is never touched. ``None`` is a leaf: a ``None`` that becomes a tensor is
a leaf change that explanations can name, not an anonymous change of tree structure.
"""

from __future__ import annotations

import collections.abc
import contextlib
import contextvars
import dataclasses
import functools
import importlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import attrs
import optree
import torch

from ortfx.errors import UNSUPPORTED_CACHE, UNSUPPORTED_LAYOUT, UNSUPPORTED_LEAF, OrtfxIOError

NAMESPACE: Final = "ortfx"

# Leaves that are carried as they are: tensors go to the graph, the rest are static values.
STATIC_TYPES: Final[tuple[type, ...]] = (bool, int, float, str, type(None))
_PLAIN_LEAF_TYPES: Final[frozenset[type]] = frozenset(
    (torch.Tensor, torch.nn.Parameter, *STATIC_TYPES)
)

_registered: set[type] = set()
# Re-entrant: registering a state type flattens nothing, but a subclass check may import.
_REGISTERING = threading.RLock()

CallTree = tuple[tuple[Any, ...], dict[str, Any]]


def _flatten_fields(attributes: tuple[str, ...], keys: tuple[str, ...]) -> Callable[[Any], Any]:
    """Children are the ``attributes``; metadata and path entries are the ``__init__`` ``keys``."""

    def flatten(obj: Any) -> tuple[list[Any], tuple[str, ...], tuple[str, ...]]:
        return [getattr(obj, n) for n in attributes], keys, keys

    return flatten


def _unflatten_kwargs(cls: type) -> Callable[[Any, Any], Any]:
    def unflatten(names: tuple[str, ...], children: Any) -> Any:
        return cls(**dict(zip(names, children, strict=True)))

    return unflatten


def _flatten_mapping(obj: collections.abc.Mapping[Any, Any]) -> tuple[list[Any], Any, Any]:
    keys = tuple(obj.keys())  # insertion order: ModelOutput's field order is meaningful
    return [obj[k] for k in keys], keys, keys


def _unflatten_mapping(cls: type) -> Callable[[Any, Any], Any]:
    def unflatten(keys: tuple[Any, ...], children: Any) -> Any:
        pairs = dict(zip(keys, children, strict=True))
        if all(isinstance(k, str) for k in keys):
            return cls(**pairs)
        return cls(pairs)

    return unflatten


# ---- mutable state objects (transformers' key/value caches) ------------------------------------
#
# A cache is passed in, changed in place by the forward and returned (``past_key_values``). It
# flattens to its attributes: tensors, static values and nested states are children, and
# dtype/device/class attributes are metadata. Rebuilt without ``__init__`` (the state is its
# attributes). So that the caller sees PyTorch's in-place semantics, an output state that was an
# input state while exported carries that input's position (``source``); restored inside
# :func:`originals`, it is the caller's own object with the new attributes written into it.

# transformers' cache base classes: (module, class name); imported only if the user did.
_STATE_BASES: Final = (
    ("transformers.cache_utils", "Cache"),
    ("transformers.cache_utils", "CacheLayerMixin"),
    ("transformers.cache_utils", "LinearAttentionCacheLayerMixin"),
    ("transformers.cache_utils", "DummyLayer"),
)
_METADATA_TYPES: Final = (torch.dtype, torch.device, type)
# Attributes that are Python ints in PyTorch but come out of a trace as 0-dim tensors (a size
# read while traced is a tensor): given back as ints, so the next call keys on their value.
_INT_ATTRIBUTES: Final = frozenset({"cumulative_length"})

# id of an input state object -> its position among the call's states (set while exporting)
_SOURCES: contextvars.ContextVar[dict[int, int] | None] = contextvars.ContextVar(
    "ortfx_state_sources", default=None
)
# The caller's state objects, in flatten order (set around a call of the wrapper)
_ORIGINALS: contextvars.ContextVar[tuple[Any, ...] | None] = contextvars.ContextVar(
    "ortfx_state_originals", default=None
)


def is_state_type(cls: type) -> bool:
    """Whether ``cls`` is a mutable state (a transformers cache or cache layer) we flatten."""
    for module_name, name in _STATE_BASES:
        base = getattr(sys.modules.get(module_name), name, None)
        if isinstance(base, type) and issubclass(cls, base):
            return True
    return False


def _flatten_state(obj: Any) -> tuple[list[Any], Any, tuple[str, ...]]:
    data = vars(obj)
    names = tuple(k for k, v in data.items() if not isinstance(v, _METADATA_TYPES))
    static = tuple((k, v) for k, v in data.items() if isinstance(v, _METADATA_TYPES))
    sources = _SOURCES.get()
    source = None if sources is None else sources.get(id(obj))
    ints = ()
    if sources is not None and torch.jit.is_tracing():  # type: ignore[attr-defined,no-untyped-call]
        ints = tuple(
            k
            for k in names
            if k in _INT_ATTRIBUTES
            and _traced_size(data[k])
            and not _tensor_attribute(type(obj), k)
        )
    children = [data[k] for k in names]
    window = _window_full(obj, data)
    if window is not None:
        # The token count goes to the graph as a tensor; the key keeps only what transformers
        # branches on (see _WINDOWED_LAYERS), so decoding needs a bounded number of graphs.
        position = names.index(_WINDOW_COUNTER)
        children[position] = torch.tensor(children[position], dtype=torch.int64)
    return children, (names, static, source, ints, window), names


# Sliding-window cache layers count the tokens seen in a Python int, and the forward branches
# on it in one place only: whether the window is full (``get_mask_sizes``: ``cumulative_length
# >= sliding_window``, and ``max(cumulative_length - sliding_window + 1, 0)``, the same test).
# Keyed on that count, every decode step would be a new graph. So the count is fed as a
# tensor, and the key holds "window full" instead. Only for these classes with these methods
# as transformers defines them: a subclass that overrides one may branch on something else,
# and keeps the exact count in its key. (module, class name, methods that read the count)
_WINDOWED_LAYERS: Final = (
    ("transformers.cache_utils", "DynamicSlidingWindowLayer", ("update", "get_mask_sizes")),
)
_WINDOW_COUNTER: Final = "cumulative_length"


def _window_full(obj: Any, data: dict[str, Any]) -> bool | None:
    """For a known sliding-window layer with a Python-int token count: whether its window is
    full (what the traced graph depends on); else None."""
    count, window = data.get(_WINDOW_COUNTER), data.get("sliding_window")
    if type(count) is not int or type(window) is not int:
        return None
    cls = type(obj)
    for module_name, name, methods in _WINDOWED_LAYERS:
        base = getattr(sys.modules.get(module_name), name, None)
        if (
            isinstance(base, type)
            and issubclass(cls, base)
            and all(getattr(cls, m, None) is getattr(base, m) for m in methods)
        ):
            return count >= window
    return None


def _tensor_attribute(cls: type, name: str) -> bool:
    """Whether ``cls`` annotates ``name`` as a tensor (StaticLayer's cumulative_length)."""
    return any(
        str(vars(klass).get("__annotations__", {}).get(name, ""))
        in ("torch.Tensor", str(torch.Tensor))
        for klass in cls.__mro__
    )


def _traced_size(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point()


def _unflatten_state(cls: type) -> Callable[[Any, Any], Any]:
    def unflatten(metadata: Any, children: Any) -> Any:
        names, static, source, ints, _ = metadata
        attributes = {**dict(zip(names, children, strict=True)), **dict(static)}
        attributes.update({k: int(attributes[k]) for k in ints})
        originals = _ORIGINALS.get()
        if source is not None and originals is not None and source < len(originals):
            obj = originals[source]
            if type(obj) is cls:  # the caller's own object, changed in place as in PyTorch
                vars(obj).clear()
                vars(obj).update(attributes)
                return obj
        obj = object.__new__(cls)
        obj.__dict__.update(attributes)
        return obj

    return unflatten


def states(tree: Any, /) -> list[Any]:
    """The state objects in ``tree`` (outer before inner, in flatten order)."""
    found: list[Any] = []

    def note(x: Any) -> bool:
        if is_state_type(type(x)):
            found.append(x)
        return False

    flatten(tree)  # registers every type on the way
    optree.tree_flatten(tree, is_leaf=note, none_is_leaf=True, namespace=NAMESPACE)
    return found


@contextlib.contextmanager
def state_sources(call: Any, /) -> Iterator[None]:
    """While exporting: output states that are states of ``call`` record their position."""
    token = _SOURCES.set({id(s): k for k, s in enumerate(states(call))})
    try:
        yield
    finally:
        _SOURCES.reset(token)


def _may_hold_states(call: CallTree) -> bool:
    """Whether a call can hold state objects at all: not without transformers, nor when every
    argument is a tensor or a plain value (the common call, which then skips the tree walk)."""
    if "transformers.cache_utils" not in sys.modules:
        return False
    args, kwargs = call
    return not all(map(_is_plain_leaf, (*args, *kwargs.values())))


def originals(call: CallTree, /) -> contextlib.AbstractContextManager[None]:
    """Around a call: outputs restored from a graph write into the caller's state objects."""
    found = tuple(states(call)) if _may_hold_states(call) else ()
    if not found and _ORIGINALS.get() is None:
        return _NOTHING  # the common call: nothing to set (and nothing of an outer call's)
    return _originals_set(found or None)


_NOTHING = contextlib.nullcontext()


@contextlib.contextmanager
def _originals_set(found: tuple[Any, ...] | None) -> Iterator[None]:
    token = _ORIGINALS.set(found)
    try:
        yield
    finally:
        _ORIGINALS.reset(token)


def _register_node_type(cls: type) -> bool:
    """Whether ``cls`` is (now) a node in our namespace: a container we support, registered
    here once (two threads flattening a new type at once: one registers it under the lock;
    for the other it is registered too, and its leaves must be flattened again)."""
    if cls in _registered:
        return True
    with _REGISTERING:
        if cls in _registered:  # another thread registered it while this one waited
            return True
        return _register_unlocked(cls)


def _register_unlocked(cls: type) -> bool:
    flatten: Callable[[Any], Any]
    unflatten: Callable[[Any, Any], Any]
    if is_state_type(cls):
        register_state: Any = optree.register_pytree_node
        register_state(
            cls,
            _flatten_state,
            _unflatten_state(cls),
            path_entry_type=optree.GetAttrEntry,
            namespace=NAMESPACE,
        )
        _registered.add(cls)
        return True
    if issubclass(cls, collections.abc.Mapping):
        flatten, unflatten = _flatten_mapping, _unflatten_mapping(cls)
    elif dataclasses.is_dataclass(cls):
        fields = tuple(f.name for f in dataclasses.fields(cls) if f.init)
        flatten, unflatten = _flatten_fields(fields, fields), _unflatten_kwargs(cls)
    elif attrs.has(cls):
        init = [a for a in attrs.fields(cls) if a.init]
        # attrs' __init__ takes the alias (``_y`` is passed as ``y``).
        flatten = _flatten_fields(tuple(a.name for a in init), tuple(a.alias for a in init))
        unflatten = _unflatten_kwargs(cls)
    elif issubclass(cls, torch.Size):
        flatten, unflatten = (lambda s: (list(s), None, None)), (lambda _, c: torch.Size(c))
    else:
        return False
    register: Any = optree.register_pytree_node  # its stub wants Collection subclasses only
    register(cls, flatten, unflatten, namespace=NAMESPACE)
    _registered.add(cls)
    return True


def registered_types() -> tuple[tuple[str, str], ...]:
    """``(module, qualname)`` of every container type registered so far (for pickled specs)."""
    return tuple(sorted((cls.__module__, cls.__qualname__) for cls in _registered))


def register_types(names: Sequence[tuple[str, str]], /) -> None:
    """Import and register the types :func:`registered_types` named in another process, so
    that a treespec pickled there can be loaded here (optree refuses unknown node types)."""
    for module_name, qualname in names:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if not isinstance(obj, type) or not _register_node_type(obj):
            raise TypeError(f"{module_name}.{qualname} is not a container type ortfx registers")


def _is_plain_leaf(leaf: Any) -> bool:
    return type(leaf) in _PLAIN_LEAF_TYPES or isinstance(leaf, torch.Tensor)


def flatten(tree: Any, /) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into leaves and a treespec, registering new container types on the way."""
    while True:
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)
        # A leaf of a container type not registered when optree looked is registered (or found
        # registered by another thread meanwhile) and the tree flattened again; the loop ends
        # because a registered type is never a leaf again.
        if all(_is_plain_leaf(leaf) for leaf in leaves):
            return leaves, spec
        if not any(_register_node_type(type(leaf)) for leaf in leaves if not _is_plain_leaf(leaf)):
            return leaves, spec


def unflatten(spec: optree.PyTreeSpec, leaves: Sequence[Any], /) -> Any:
    """Inverse of :func:`flatten`."""
    return optree.tree_unflatten(spec, leaves)


def call_tree(args: Sequence[Any], kwargs: dict[str, Any], /) -> CallTree:
    """The pytree of a call: ``(args, kwargs)``; kwargs are a dict, so keyword order is moot."""
    return (tuple(args), dict(kwargs))


@functools.lru_cache(maxsize=256)
def leaf_paths(spec: optree.PyTreeSpec, /, *, root: str) -> tuple[str, ...]:
    """Readable path of every leaf, e.g. ``args[1]['mask']`` or ``output.logits``.

    With ``root="call"`` the tree is a call tree and the first level names ``args``/``kwargs``.
    """
    paths = []
    for accessor in spec.accessors():
        if root == "call":
            head = ("args", "kwargs")[accessor[0].entry]
            paths.append(accessor[1:].codify(head) if len(accessor) > 1 else head)
        else:
            paths.append(accessor.codify(root))
    return tuple(paths)


@functools.lru_cache(maxsize=256)
def containers(spec: optree.PyTreeSpec, /, *, root: str) -> tuple[tuple[tuple[str, str], ...], ...]:
    """Per leaf, ``(path, type name)`` of each container on its way (to explain changes)."""
    out = []
    for accessor in spec.accessors():
        start = 1 if root == "call" else 0  # the (args, kwargs) pair is ours, not the user's
        chain = []
        for depth in range(start, len(accessor)):
            if root == "call":
                head = ("args", "kwargs")[accessor[0].entry]
                path = accessor[1:depth].codify(head) if depth > 1 else head
            else:
                path = accessor[:depth].codify(root)
            chain.append((path, accessor[depth].type.__name__))
        out.append(tuple(chain))
    return tuple(out)


def check_leaves(
    leaves: Sequence[Any], spec: optree.PyTreeSpec, /, *, root: str, where: str
) -> None:
    """Raise :class:`OrtfxIOError` naming the first leaf ortfx cannot carry."""
    for i, leaf in enumerate(leaves):
        if not _is_plain_leaf(leaf):
            path = leaf_paths(spec, root=root)[i]
            type_name = type(leaf).__qualname__
            inside = [t for _, t in containers(spec, root=root)[i] if "Cache" in t]
            if "Cache" in type_name or inside:
                what = (
                    f"has type {type_name}, inside the cache object {inside[0]}"
                    if inside
                    else f"is a cache object of type {type_name} that ortfx does not know"
                )
                raise OrtfxIOError(UNSUPPORTED_CACHE.format(where=where, path=path, what=what))
            raise OrtfxIOError(UNSUPPORTED_LEAF.format(where=where, path=path, type_name=type_name))
        if isinstance(leaf, torch.Tensor) and leaf.layout is not torch.strided:
            path = leaf_paths(spec, root=root)[i]
            raise OrtfxIOError(
                UNSUPPORTED_LAYOUT.format(where=where, path=path, layout=leaf.layout)
            )
