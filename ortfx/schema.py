"""The schema of a call: tree structure plus one spec per leaf. Sizes are never part of it.

A ``TensorSpec`` compares and hashes on what the exported graph depends on (dtype and rank).
``requires_grad`` and the device type ride along for the re-processing and session decisions but
are deliberately left out of equality, so a schema can serve directly as part of the export key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import attrs
import optree
import torch

from ortfx import io

StaticValue: TypeAlias = bool | int | float | str | None


def _static_identity(value: StaticValue) -> tuple[str, str]:
    # Python says True == 1 == 1.0 and nan != nan; a graph traced with one is not valid for the
    # other, and a nan argument must still hit the cache. Compare type name and repr instead.
    return (type(value).__name__, repr(value))


def _dtype_short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@attrs.frozen
class TensorSpec:
    """A tensor leaf: dtype and rank (all dims are dynamic)."""

    dtype: torch.dtype
    rank: int
    requires_grad: bool = attrs.field(default=False, eq=False)
    device_type: str = attrs.field(default="cpu", eq=False)

    @property
    def kind(self) -> str:
        return "tensor"

    def render(self) -> str:
        """``float32[?, ?]``: the dtype and one ``?`` per (dynamic) dim."""
        return f"{_dtype_short(self.dtype)}[{', '.join('?' * self.rank)}]"


@attrs.frozen
class StaticSpec:
    """A Python scalar, str or None leaf: its value is baked into the exported graph."""

    value: StaticValue = attrs.field(eq=_static_identity)

    @property
    def kind(self) -> str:
        return "none" if self.value is None else type(self.value).__name__

    def render(self) -> str:
        return repr(self.value)


LeafSpec: TypeAlias = TensorSpec | StaticSpec


def leaf_spec(leaf: Any, /) -> LeafSpec:
    """The spec of one flat leaf (already checked to be a tensor or a static value)."""
    if isinstance(leaf, torch.Tensor):
        return TensorSpec(leaf.dtype, leaf.dim(), leaf.requires_grad, leaf.device.type)
    return StaticSpec(leaf)


@attrs.frozen
class ModelSchema:
    """Tree structure of a call (or of outputs) and a spec per leaf."""

    treespec: optree.PyTreeSpec
    leaves: tuple[LeafSpec, ...]
    root: str = attrs.field(default="call", eq=False)

    @classmethod
    def from_flat(
        cls, leaves: Sequence[Any], treespec: optree.PyTreeSpec, /, *, root: str = "call"
    ) -> ModelSchema:
        """Schema of already flattened leaves (see :func:`ortfx.io.flatten`)."""
        return cls(treespec, tuple(leaf_spec(x) for x in leaves), root)

    @classmethod
    def from_call(cls, args: Sequence[Any], kwargs: dict[str, Any], /) -> ModelSchema:
        """Schema of ``module(*args, **kwargs)``; raises ``OrtfxIOError`` on unsupported leaves."""
        leaves, spec = io.flatten(io.call_tree(args, kwargs))
        io.check_leaves(leaves, spec, root="call", where="input")
        return cls.from_flat(leaves, spec)

    @property
    def paths(self) -> tuple[str, ...]:
        """Readable path of every leaf, e.g. ``args[1]['mask']``."""
        return io.leaf_paths(self.treespec, root=self.root)

    @property
    def requires_grad(self) -> tuple[bool, ...]:
        """Per leaf, whether it is a tensor that requires grad."""
        return tuple(isinstance(s, TensorSpec) and s.requires_grad for s in self.leaves)

    def tensor_indices(self) -> tuple[int, ...]:
        """Indices of the tensor leaves, in flat order."""
        return tuple(i for i, s in enumerate(self.leaves) if isinstance(s, TensorSpec))


def tensorize_scalars(
    leaves: Sequence[Any], treespec: optree.PyTreeSpec, /, *, paths: frozenset[str]
) -> list[Any]:
    """Feed chosen Python scalars to the graph as 0-dim tensors instead of baking them in.

    ``paths`` holds leaf paths (``"args[1]"``) or ``"*"`` for every int and float leaf.
    """
    if not paths:
        return list(leaves)
    names = io.leaf_paths(treespec, root="call")
    out = list(leaves)
    for i, (name, leaf) in enumerate(zip(names, leaves, strict=True)):
        selected = name in paths or ("*" in paths and type(leaf) in (int, float))
        if selected and type(leaf) in (bool, int, float):
            out[i] = torch.tensor(leaf)
    return out
