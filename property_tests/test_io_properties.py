"""Properties of flattening and schemas over arbitrary nested calls."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings

from ortfx import io
from ortfx.schema import ModelSchema, TensorSpec
from property_tests.strategies import calls, same_tree, trees

settings.register_profile("ortfx", max_examples=150, deadline=None)
settings.load_profile("ortfx")


@given(calls)
def test_flatten_unflatten_is_identity(call: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
    """unflatten(flatten(call)) rebuilds the call: same container types, keys, order, leaves."""
    leaves, spec = io.flatten(io.call_tree(*call))
    rebuilt = io.unflatten(spec, leaves)
    assert same_tree(rebuilt, io.call_tree(*call))


@given(trees)
def test_output_trees_round_trip(tree: Any) -> None:
    """Outputs use the same machinery: any supported tree survives a round trip."""
    leaves, spec = io.flatten(tree)
    assert same_tree(io.unflatten(spec, leaves), tree)


@given(calls)
def test_one_path_per_leaf_and_paths_are_unique(
    call: tuple[tuple[Any, ...], dict[str, Any]],
) -> None:
    """Every leaf gets a distinct readable path rooted at args or kwargs."""
    schema = ModelSchema.from_call(*call)
    assert len(schema.paths) == len(schema.leaves)
    assert len(set(schema.paths)) == len(schema.paths)
    assert all(p.startswith(("args", "kwargs")) for p in schema.paths)


@given(calls)
def test_schema_ignores_values_of_tensors_but_not_of_statics(
    call: tuple[tuple[Any, ...], dict[str, Any]],
) -> None:
    """Rebuilding the call with fresh tensors of other sizes keeps the schema equal."""
    leaves, spec = io.flatten(io.call_tree(*call))
    fresh = [x.new_ones([s + 1 for s in x.shape]) if hasattr(x, "new_ones") else x for x in leaves]
    assert ModelSchema.from_flat(fresh, spec) == ModelSchema.from_flat(leaves, spec)
    tensor_specs = [
        s for s in ModelSchema.from_flat(leaves, spec).leaves if isinstance(s, TensorSpec)
    ]
    assert all(s.rank >= 0 for s in tensor_specs)
