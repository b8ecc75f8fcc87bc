"""What a module tree holds besides parameters, buffers and submodules: its public attributes.

A forward may branch on them (``self.use_gate``), and torch has no hook for plain attribute
writes. ortfx compares instead of intercepting: a snapshot of the values, taken when a graph is
traced, against the values now (no ``nn.Module.__setattr__`` is replaced).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import attrs
import torch

# Values whose equality is their identity for the graph: plain Python scalars and strings.
PLAIN: Final[tuple[type, ...]] = (bool, int, float, str, type(None))


def _public(name: str) -> bool:
    # ``training`` is in every export key already; ``_x`` names are frameworks' bookkeeping.
    return not name.startswith("_") and name != "training"


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


def described(writes: Iterable[tuple[torch.nn.Module, str]]) -> tuple[str, ...]:
    """``'name' of Type`` for each write, for the log."""
    return tuple(dict.fromkeys(f"{name!r} of {type(m).__name__}" for m, name in writes))


_MISSING = object()


@attrs.frozen(eq=False)
class PlainAttributes:
    """The plain public attributes of a module tree, as a graph was traced with them, except
    those the traced forward set itself (``skip``: warned at export, ORT cannot follow them).

    :meth:`changed` costs two C-level maps over the attribute dicts and a map over the
    modules' dict sizes (which sees attributes added or removed): about 8 µs for a 4-layer
    GPT-2 (60 modules, 144 attributes), well under 1 µs for a few layers."""

    modules: tuple[torch.nn.Module, ...]
    module_dicts: tuple[dict[str, Any], ...]
    sizes: list[int]
    dicts: tuple[dict[str, Any], ...]  # each module's __dict__, once per attribute
    names: tuple[str, ...]
    values: list[Any]
    types: list[type]  # 1 and 1.0 and True are equal, but trace as different constants
    owners: tuple[torch.nn.Module, ...]
    skip: frozenset[tuple[int, str]] = frozenset()

    @classmethod
    def of(
        cls, modules: Iterable[torch.nn.Module], skip: frozenset[tuple[int, str]] = frozenset()
    ) -> PlainAttributes:
        tree = tuple(modules)
        dicts: list[dict[str, Any]] = []
        names: list[str] = []
        values: list[Any] = []
        owners: list[torch.nn.Module] = []
        for m in tree:
            d = vars(m)
            for n, v in d.items():
                if _public(n) and type(v) in PLAIN and (id(m), n) not in skip:
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
            list(map(type, values)),
            tuple(owners),
            skip,
        )

    def changed(self) -> bool:
        """Whether an attribute holds another value now, or one was added or deleted (a
        forward may read a new one with ``getattr(self, name, default)``)."""
        if list(map(len, self.module_dicts)) != self.sizes:
            return True
        now = list(map(dict.get, self.dicts, self.names))
        return now != self.values or list(map(type, now)) != self.types

    def cause(self) -> str | None:
        """Which public plain attribute changed, for the log; None when only other entries of
        the modules' dicts did (private names, tensors, objects: :meth:`refreshed` then)."""
        for d, name, value, owner in zip(
            self.dicts, self.names, self.values, self.owners, strict=True
        ):
            now = d.get(name, _MISSING)
            if now is _MISSING or type(now) is not type(value) or now != value:
                return f"attribute {name!r} of {type(owner).__name__} set outside the wrapper"
        known = set(zip(map(id, self.dicts), self.names, strict=True))
        for m, d in zip(self.modules, self.module_dicts, strict=True):
            for n, v in d.items():
                if (
                    _public(n)
                    and type(v) in PLAIN
                    and (id(d), n) not in known
                    and (id(m), n) not in self.skip
                ):
                    return f"attribute {n!r} of {type(m).__name__} set outside the wrapper"
        return None

    def refreshed(self, skip: Iterable[tuple[int, str]] = ()) -> PlainAttributes:
        """The same tree's attributes as they are now (``skip`` grown by ``skip``)."""
        return PlainAttributes.of(self.modules, self.skip | frozenset(skip))
