"""Hypothesis strategies for nested call trees of every supported container and leaf type."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import attrs
import torch
from hypothesis import strategies as st

Pair = collections.namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class DataBox:
    a: Any
    b: Any = None


@attrs.define
class AttrsBox:
    x: Any
    _y: Any = None  # private attribute: its __init__ alias is "y"


class ModelOutputLike(collections.OrderedDict[str, Any]):
    """A Mapping subclass in the style of transformers' ModelOutput."""


DTYPES = (torch.float32, torch.float64, torch.int64, torch.bool, torch.float16)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    t = torch.zeros(shape, dtype=dtype)
    if dtype.is_floating_point and draw(st.booleans()):
        t.requires_grad_(True)
    return t


statics = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
)

leaves = st.one_of(tensors(), statics)
keys = st.text(alphabet="abcdefgh_", min_size=1, max_size=4)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
        st.dictionaries(keys, children, max_size=3).map(collections.OrderedDict),
        st.tuples(children, children).map(lambda t: Pair(*t)),
        st.tuples(children, children).map(lambda t: DataBox(*t)),
        st.tuples(children, children).map(lambda t: AttrsBox(*t)),
        st.dictionaries(keys, children, max_size=3).map(ModelOutputLike),
    )


trees = st.recursive(leaves, _containers, max_leaves=12)

calls = st.tuples(
    st.lists(trees, max_size=3).map(tuple),
    st.dictionaries(st.sampled_from(["x", "mask", "labels", "flag"]), trees, max_size=3),
)


def same_tree(a: Any, b: Any) -> bool:
    """Exact equality: same container types, same keys in the same order, identical tensors."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a is b
    if isinstance(a, float):
        return repr(a) == repr(b)
    if isinstance(a, dict):
        return list(a.keys()) == list(b.keys()) and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, DataBox):
        return same_tree(a.a, b.a) and same_tree(a.b, b.b)
    if isinstance(a, AttrsBox):
        return same_tree(a.x, b.x) and same_tree(a._y, b._y)
    return bool(a == b)
