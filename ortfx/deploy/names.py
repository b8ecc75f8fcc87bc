"""Graph names for a call's and a result's tensor leaves, and the structure as JSON metadata.

Names come from the leaves' paths (:mod:`ortfx.io` flattening): ``kwargs['input_ids']`` is
``input_ids``, ``args[0]`` is ``input_0``, ``output.logits`` is ``logits``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from ortfx.model_info import Update
from ortfx.schema import ModelSchema, StaticSpec, TensorSpec


def _name(accessor: Any, *, call: bool) -> str:
    """A graph name from a leaf's path: ``kwargs['input_ids']`` -> ``input_ids``,
    ``args[0]`` -> ``input_0``, ``output.logits`` -> ``logits``, ``output[1]`` -> ``output_1``,
    ``output.past_key_values.layers[0].keys`` -> ``past_key_values.layers.0.keys``."""
    entries = [e.entry for e in accessor]
    if call:
        head, entries = ("input" if entries[0] == 0 else None), entries[1:]
    else:
        head = "output"
    if not entries:
        return head or "input"
    first, rest = entries[0], entries[1:]
    text = f"{head}_{first}" if isinstance(first, int) and head else str(first)
    return re.sub(r"[^0-9A-Za-z_.]+", "_", ".".join([text, *map(str, rest)]))


def _unique(name: str, taken: set[str]) -> str:
    unique, n = name, 1
    while unique in taken:
        unique, n = f"{name}_{n}", n + 1
    taken.add(unique)
    return unique


def tensor_names(schema: ModelSchema) -> tuple[str, ...]:
    """The graph name of each tensor leaf of the call, in flat order."""
    accessors = schema.treespec.accessors()
    taken: set[str] = set()
    return tuple(_unique(_name(accessors[i], call=True), taken) for i in schema.tensor_indices())


def output_names(
    output_schema: ModelSchema, updates: Sequence[Update], schema: ModelSchema
) -> tuple[str, ...]:
    """The graph name of each output: the result's tensors (one named like an input, a cache
    returned updated, is ``present.<name>``), then ``updated.<input or buffer>`` for each
    tensor the forward changed in place."""
    inputs = tensor_names(schema)
    taken = set(inputs)
    accessors = output_schema.treespec.accessors()
    names = []
    for i in output_schema.tensor_indices():
        name = _name(accessors[i], call=False)
        names.append(_unique(f"present.{name}" if name in inputs else name, taken))
    positions = schema.tensor_indices()
    for u in updates:
        source = inputs[positions.index(int(u.target))] if u.kind == "input" else str(u.target)
        names.append(_unique(f"updated.{source}", taken))
    return tuple(names)


def dynamic_axes(
    schema: ModelSchema,
    leaves: Sequence[Any],
    outputs: tuple[str, ...],
    expected: Sequence[np.ndarray[Any, Any]],
) -> dict[str, dict[int, str]]:
    """Every dim of every input and output dynamic, each its own symbol."""
    ranks = [leaves[i].dim() for i in schema.tensor_indices()] + [a.ndim for a in expected]
    names = [*tensor_names(schema), *outputs]
    return {n: {d: f"{n}_dim{d}" for d in range(r)} for n, r in zip(names, ranks, strict=True)}


def metadata(
    present: set[str],
    schema: ModelSchema,
    output_schema: ModelSchema,
    outputs: tuple[str, ...],
) -> str:
    """The call's and the result's structure, as JSON: each graph input (of ``present``) and
    output with its path, dtype and rank, and the Python values the graph holds as constants
    (a call must pass the same)."""
    count = len(output_schema.tensor_indices())

    def listed(s: ModelSchema, names: Sequence[str], keep: set[str] | None) -> Any:
        tensors = [(p, spec) for p, spec in zip(s.paths, s.leaves, strict=True)]
        pairs = [(p, spec) for p, spec in tensors if isinstance(spec, TensorSpec)]
        return [
            {
                "name": n,
                "path": p,
                "dtype": str(spec.dtype).removeprefix("torch."),
                "rank": spec.rank,
            }
            for n, (p, spec) in zip(names, pairs, strict=True)
            if keep is None or n in keep
        ]

    def statics(s: ModelSchema) -> Any:
        return [
            {"path": p, "value": spec.value}
            for p, spec in zip(s.paths, s.leaves, strict=True)
            if isinstance(spec, StaticSpec)
        ]

    data = {
        "inputs": listed(schema, tensor_names(schema), present),
        "static_inputs": statics(schema),
        "outputs": listed(output_schema, outputs[:count], None),
        "updated": list(outputs[count:]),
        "static_outputs": statics(output_schema),
    }
    return json.dumps(data)
