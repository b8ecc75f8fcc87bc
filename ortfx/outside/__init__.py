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

from ortfx.outside.code import MAX_ITEMS, Ran, Scan, Unguardable, scan, static, users_code
from ortfx.outside.collect import GENERATORS, collect, drew, generator_name, refusal, streams
from ortfx.outside.record import Outside

__all__ = [
    "GENERATORS",
    "MAX_ITEMS",
    "Outside",
    "Ran",
    "Scan",
    "Unguardable",
    "collect",
    "drew",
    "generator_name",
    "refusal",
    "scan",
    "static",
    "streams",
    "users_code",
]
