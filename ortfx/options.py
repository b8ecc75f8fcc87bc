"""Every setting of ortfx in one frozen record; the export-relevant subset feeds the export key."""

from __future__ import annotations

import enum
from typing import Literal, TypeAlias

import attrs

Exporter: TypeAlias = Literal["auto", "torchscript", "dynamo"]


class LogLevel(enum.IntEnum):
    """Upstream's levels, mapped onto the standard ``logging`` levels."""

    VERBOSE = 5
    DEVINFO = 15
    INFO = 20
    WARNING = 30
    ERROR = 40
    FATAL = 50


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"'{attribute.name}' must be a positive int (got {value!r}).")


def _opset(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or not 14 <= value <= 20:
        raise ValueError(
            f"'{attribute.name}' must be an int from 14 to 20, the opsets ORT 1.19 trains "
            f"(got {value!r})."
        )


def _exporter(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in ("auto", "torchscript", "dynamo"):
        raise ValueError(
            f"'{attribute.name}' must be 'auto', 'torchscript' or 'dynamo' (got {value!r})."
        )


def _str_tuple(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (tuple, list, set, frozenset)) or not all(
        isinstance(v, str) for v in value
    ):
        raise TypeError(
            "'dynamic_scalars' must be a tuple of leaf paths such as ('args[1]',) or ('*',) "
            f"(got {value!r})."
        )
    return tuple(sorted(value))


@attrs.frozen
class ExportOptions:
    """The options that change the exported graph; part of the export key."""

    exporter: str
    opset_version: int


@attrs.frozen(kw_only=True)
class Options:
    """All ortfx settings. Construct directly or with :meth:`from_env`; change with ``evolve``."""

    exporter: Exporter = attrs.field(default="auto", validator=_exporter)
    opset_version: int = attrs.field(default=17, validator=_opset)
    # Python scalars at these leaf paths ("args[1]", "kwargs['scale']", or "*" for every int and
    # float) are fed to the graph as 0-dim tensors instead of being baked in as constants.
    dynamic_scalars: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    cache_size: int = attrs.field(default=8, validator=_positive)
    # None follows torch.get_num_threads() at session creation.
    intra_op_threads: int | None = None
    # ORT's spinning thread pool burns cores while idle; on shared machines it hurts badly.
    allow_spinning: bool = False

    def export_options(self, resolved_exporter: str) -> ExportOptions:
        """The export-relevant subset, with ``"auto"`` already resolved to a real exporter."""
        return ExportOptions(resolved_exporter, self.opset_version)
