"""Why a call does not match a cache entry: pure comparisons of keys that give
``Reason(path, seen, given, why)`` records, in a fixed order (JAX's explanation of a tracing
cache miss), and the entry closest to a call."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs

from ortfx import io
from ortfx.keys import Call, Entry, ExportKey, GradState, P, Reason, SessionKey
from ortfx.options import ExportOptions
from ortfx.schema import LeafSpec, ModelSchema, StaticSpec, TensorSpec

# ---- explanations -------------------------------------------------------------------------


def _leaf_reason(path: str, seen: LeafSpec, given: LeafSpec) -> Reason:
    why = "the leaf changed"
    if isinstance(seen, StaticSpec) and isinstance(given, StaticSpec):
        if type(seen.value) is type(given.value):
            why = f"a static {seen.kind} value changed"
        else:
            why = "a static value changed type"
    elif isinstance(seen, TensorSpec) and isinstance(given, TensorSpec):
        changed = [n for n in ("dtype", "rank") if getattr(seen, n) != getattr(given, n)]
        why = f"a tensor's {' and '.join(changed)} changed"
    elif isinstance(seen, StaticSpec):
        why = "None became a tensor" if seen.value is None else "a static value became a tensor"
    elif isinstance(given, StaticSpec):
        why = "a tensor became None" if given.value is None else "a tensor became a static value"
    return Reason(path, seen.render(), given.render(), why)


def _structure_reasons(seen: ModelSchema, given: ModelSchema) -> Iterator[Reason]:
    old, new = seen.paths, given.paths
    for path in old:
        if path not in new:
            yield Reason(path, "present", "absent", "the input structure changed")
    for path in new:
        if path not in old:
            yield Reason(path, "absent", "present", "the input structure changed")
    if set(old) == set(new):
        old_chains = dict(zip(old, io.containers(seen.treespec, root=seen.root), strict=True))
        for path, chain in zip(new, io.containers(given.treespec, root=given.root), strict=True):
            for (where, was), (_, now) in zip(old_chains[path], chain, strict=False):
                if was != now:
                    yield Reason(where, f"a {was}", f"a {now}", "a container type changed")
                    return
        yield Reason("inputs", str(seen.treespec), str(given.treespec), "the tree changed")


def explain_key(seen: ExportKey, given: ExportKey) -> tuple[Reason, ...]:
    """Why ``given`` misses an entry built for ``seen``, in a fixed order (JAX-style).

    Module version, mode, options and library versions first, then tree structure, then leaves.
    """
    reasons: list[Reason] = []
    if seen.module_version != given.module_version:
        reasons.append(
            Reason(
                "module",
                f"version {seen.module_version.number}",
                f"version {given.module_version.number}",
                given.module_version.cause or "the module changed",
            )
        )
    if seen.training != given.training:
        mode = {True: "train", False: "eval"}
        reasons.append(
            Reason("mode", mode[seen.training], mode[given.training], "train/eval mode changed")
        )
    if seen.other_mode != given.other_mode:
        reasons.append(
            Reason(
                "submodule modes",
                _other_mode_text(seen),
                _other_mode_text(given),
                "a submodule's train/eval mode differs from the module's",
            )
        )
    if seen.autocast != given.autocast:
        reasons.append(
            Reason(
                "autocast",
                seen.autocast or "off",
                given.autocast or "off",
                "torch.autocast changes the dtypes the forward computes in",
            )
        )
    if seen.default_dtype != given.default_dtype:
        reasons.append(
            Reason(
                "default dtype",
                seen.default_dtype,
                given.default_dtype,
                "torch.set_default_dtype changes the tensors the forward creates",
            )
        )
    if None not in (seen.grad_flags, given.grad_flags) and seen.grad_flags != given.grad_flags:
        reasons.append(
            Reason(
                "requires_grad flags",
                _flag_text(seen.grad_flags),
                _flag_text(given.grad_flags),
                "the forward reads requires_grad of its inputs or parameters",
            )
        )
    if None not in (seen.baked, given.baked) and seen.baked != given.baked:
        reasons.append(
            Reason(
                "values baked in",
                _baked_text(seen.baked, given.baked),
                _baked_text(given.baked, seen.baked),
                "a Python value the trace took from a tensor changed",
            )
        )
    if None not in (seen.grad_mode, given.grad_mode) and seen.grad_mode != given.grad_mode:
        grad = {True: "enabled", False: "disabled"}
        reasons.append(
            Reason(
                "grad mode",
                grad[bool(seen.grad_mode)],
                grad[bool(given.grad_mode)],
                "the module reads torch.is_grad_enabled()",
            )
        )
    for field in attrs.fields(ExportOptions):
        a, b = getattr(seen.options, field.name), getattr(given.options, field.name)
        if a != b:
            reasons.append(
                Reason(f"option {field.name}", repr(a), repr(b), "an export option changed")
            )
    for name, a, b in zip(("torch", "onnx"), seen.versions, given.versions, strict=True):
        if a != b:
            reasons.append(Reason(f"{name} version", a, b, "a library version changed"))
    if seen.schema.treespec != given.schema.treespec:
        reasons.extend(_structure_reasons(seen.schema, given.schema))
    else:
        for path, a, b in zip(
            given.schema.paths, seen.schema.leaves, given.schema.leaves, strict=True
        ):
            if a != b:
                reasons.append(_leaf_reason(path, a, b))
    return tuple(reasons)


def _other_mode_text(key: ExportKey) -> str:
    if not key.other_mode:
        return "all as the module"
    mode = "eval" if key.training else "train"
    return ", ".join(f"{name!r} {mode}" for name in key.other_mode)


def _flag(value: bool) -> str:
    return f"requires_grad={value}"


def explain_grad(seen: GradState, given: GradState, paths: tuple[str, ...]) -> tuple[Reason, ...]:
    reasons = [
        Reason(path, _flag(a), _flag(b), "an input's requires_grad changed")
        for path, a, b in zip(paths, seen.inputs, given.inputs, strict=True)
        if a != b
    ]
    if seen.param_names != given.param_names:
        reasons.append(Reason("parameters", "another set", "this set", "the parameters changed"))
    else:
        reasons.extend(
            Reason(f"parameter '{name}'", _flag(a), _flag(b), "a parameter's requires_grad changed")
            for name, a, b in zip(given.param_names, seen.params, given.params, strict=True)
            if a != b
        )
    for name, a, b in zip(
        ("memory_opt_level", "memory_opt_config"), seen.memory, given.memory, strict=True
    ):
        if a != b:
            reasons.append(
                Reason(f"option {name}", repr(a), repr(b), "a memory optimizer option changed")
            )
    if seen.mem_efficient_grad != given.mem_efficient_grad:
        reasons.append(
            Reason(
                "option enable_mem_efficient_grad_management",
                repr(seen.mem_efficient_grad),
                repr(given.mem_efficient_grad),
                "parameters enter the graph another way",
            )
        )
    return tuple(reasons)


def explain_session(seen: SessionKey, given: SessionKey) -> tuple[Reason, ...]:
    reasons = []
    before = dict(seen.settings)
    for name, value in given.settings:
        if name in before and before[name] != value:
            reasons.append(
                Reason(
                    f"option {name}", repr(before[name]), repr(value), "a session setting changed"
                )
            )
    if seen.device != given.device:
        reasons.append(Reason("device", seen.device, given.device, "the module changed device"))
    if seen.deterministic != given.deterministic:
        on = {True: "on", False: "off"}
        reasons.append(
            Reason(
                "deterministic algorithms",
                on[seen.deterministic],
                on[given.deterministic],
                "torch.use_deterministic_algorithms changed",
            )
        )
    return tuple(reasons)


def _flag_text(flags: tuple[tuple[bool, ...], tuple[bool, ...]] | None) -> str:
    """Which inputs and parameters require grad, in order (1 = requires grad); counts when long."""
    inputs, params = flags or ((), ())

    def bits(values: tuple[bool, ...]) -> str:
        if len(values) > 32:
            return f"{sum(values)} of {len(values)}"
        return "".join("1" if v else "0" for v in values) or "none"

    return f"inputs {bits(inputs)}, parameters {bits(params)}"


def as_seen_by(entry: ExportKey, call: Call) -> ExportKey:
    """The call's key as an entry traced for one grad mode, or for given requires_grad flags,
    compares it."""
    key = call.key
    if entry.grad_mode is not None:
        key = attrs.evolve(key, grad_mode=call.grad_enabled)
    if entry.grad_flags is not None:
        key = attrs.evolve(key, grad_flags=flags(call))
    return key


def _baked_text(these: Any, others: Any) -> str:
    """The baked values of ``these`` that differ from ``others`` at the same position (guards
    come in trace order; the shorter one is a run's values up to the first difference):
    ``where = value``."""
    shown = [
        f"{where} = {value[1]}"
        for (where, value), other in zip(these, others, strict=False)
        if (where, value) != other
    ]
    return ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")


def flags(call: Call) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    return (call.grad.inputs, call.grad.params)


def closest_entry(entries: tuple[Entry[P], ...], call: Call) -> Entry[P] | None:
    # The entry with the fewest differences; ties go to the most recently used one.
    best: Entry[P] | None = None
    best_count = -1
    for entry in reversed(entries):
        count = len(explain_key(entry.key, as_seen_by(entry.key, call)))
        if best is None or count < best_count:
            best, best_count = entry, count
    return best
