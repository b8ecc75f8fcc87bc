"""Flattening of calls and outputs with optree, in ortfx's private ``"ortfx"`` namespace.

Containers optree knows natively (tuple, list, dict, OrderedDict, defaultdict, deque, namedtuple)
need nothing; dataclasses, attrs classes, ``Mapping`` subclasses (transformers' ``ModelOutput``)
and ``torch.Size`` are registered in our namespace the first time they are seen, so the user's
global optree registry is never touched. ``None`` is a leaf: a ``None`` that becomes a tensor is
a leaf change that explanations can name, not an anonymous change of tree structure.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs
import optree
import torch

from ortfx.errors import UNSUPPORTED_LAYOUT, UNSUPPORTED_LEAF, OrtfxIOError

NAMESPACE: Final = "ortfx"

# Leaves that are carried as they are: tensors go to the graph, the rest are static values.
STATIC_TYPES: Final[tuple[type, ...]] = (bool, int, float, str, type(None))
_PLAIN_LEAF_TYPES: Final[frozenset[type]] = frozenset(
    (torch.Tensor, torch.nn.Parameter, *STATIC_TYPES)
)

_registered: set[type] = set()

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


def _register_node_type(cls: type) -> bool:
    """Register ``cls`` as a node in our namespace if it is a container we support."""
    if cls in _registered:
        return False
    flatten: Callable[[Any], Any]
    unflatten: Callable[[Any, Any], Any]
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


def _is_plain_leaf(leaf: Any) -> bool:
    return type(leaf) in _PLAIN_LEAF_TYPES or isinstance(leaf, torch.Tensor)


def flatten(tree: Any, /) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` into leaves and a treespec, registering new container types on the way."""
    while True:
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)
        # A leaf of an unregistered container type is registered and the tree flattened again;
        # the loop ends because each pass registers at least one new type or returns.
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
            raise OrtfxIOError(
                UNSUPPORTED_LEAF.format(where=where, path=path, type_name=type(leaf).__qualname__)
            )
        if isinstance(leaf, torch.Tensor) and leaf.layout is not torch.strided:
            path = leaf_paths(spec, root=root)[i]
            raise OrtfxIOError(
                UNSUPPORTED_LAYOUT.format(where=where, path=path, layout=leaf.layout)
            )
