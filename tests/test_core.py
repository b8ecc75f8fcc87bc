"""Unit tests of the pure core: every condition and its exact reason phrase."""

from __future__ import annotations

import collections
import dataclasses
import subprocess
import sys
from typing import Any

import pytest
import torch

from ortfx import io
from ortfx.errors import OrtfxIOError
from ortfx.keys import (
    Call,
    ExportKey,
    GradState,
    ModuleVersion,
    NewSession,
    Reexport,
    Reprocess,
    Reuse,
    SessionKey,
)
from ortfx.model_info import InputKind, InputSpec, PostExportProcessedModelInfo
from ortfx.options import ExportOptions
from ortfx.schema import ModelSchema, StaticSpec, TensorSpec, tensorize_scalars
from ortfx.transitions import REPEAT_WARN_AFTER, ExportState, apply, bump_module_version, decide

V0 = ModuleVersion()
OPTS = ExportOptions("torchscript", 17)
VERSIONS = ("2.13.0", "1.17")


def call_of(
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    training: bool = True,
    version: ModuleVersion = V0,
    options: ExportOptions = OPTS,
    params: tuple[bool, ...] = (True,),
    device: str = "cpu",
    deterministic: bool = False,
) -> Call:
    schema = ModelSchema.from_call(args, kwargs or {})
    key = ExportKey(schema, training, version, options, VERSIONS)
    return Call(
        key, GradState(schema.requires_grad, params, ("w",)), SessionKey(device, deterministic)
    )


def after(*calls: Call) -> ExportState[int]:
    state: ExportState[int] = ExportState()
    for c in calls:
        state = apply(state, c, decide(state, c), 0)
    return state


def line(decision: Any) -> str:
    return "; ".join(map(str, decision.reasons))


X = torch.zeros(2, 3)


def test_first_call_exports() -> None:
    assert decide(ExportState(), call_of((X,))) == Reexport(
        (decide(ExportState(), call_of((X,))).reasons[0],)
    )
    assert (
        line(decide(ExportState(), call_of((X,))))
        == "module was never exported, now called (first call)"
    )


def test_same_call_with_other_sizes_reuses() -> None:
    state = after(call_of((X,)))
    assert decide(state, call_of((torch.zeros(7, 3),))) == Reuse()


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (True, False, "args[1] was True, now False (a static bool value changed)"),
        (3, 4, "args[1] was 3, now 4 (a static int value changed)"),
        (0.5, 0.25, "args[1] was 0.5, now 0.25 (a static float value changed)"),
        ("a", "b", "args[1] was 'a', now 'b' (a static str value changed)"),
        (1, True, "args[1] was 1, now True (a static value changed type)"),
        (None, torch.zeros(2), "args[1] was None, now float32[?] (None became a tensor)"),
        (torch.zeros(2), None, "args[1] was float32[?], now None (a tensor became None)"),
        (3, torch.zeros(()), "args[1] was 3, now float32[] (a static value became a tensor)"),
        (
            torch.zeros(2),
            torch.zeros(2, dtype=torch.float64),
            "args[1] was float32[?], now float64[?] (a tensor's dtype changed)",
        ),
        (
            torch.zeros(2),
            torch.zeros(2, 2),
            "args[1] was float32[?], now float32[?, ?] (a tensor's rank changed)",
        ),
        (
            torch.zeros(2),
            torch.zeros(2, 2, dtype=torch.int64),
            "args[1] was float32[?], now int64[?, ?] (a tensor's dtype and rank changed)",
        ),
    ],
)
def test_leaf_changes_reexport_with_exact_reason(old: Any, new: Any, expected: str) -> None:
    state = after(call_of((X, old)))
    decision = decide(state, call_of((X, new)))
    assert isinstance(decision, Reexport)
    assert line(decision) == expected


def test_reason_renders_as_one_log_line_with_kind() -> None:
    state = after(call_of((X, True)))
    new = call_of((X, False))
    state = apply(state, new, decide(state, new), 1)
    assert (
        str(state.history[-1])
        == "re-export: args[1] was True, now False (a static bool value changed)"
    )
    assert str(state.history[0]) == "export: module was never exported, now called (first call)"


def test_structure_changes_name_the_path() -> None:
    state = after(call_of((X,), {}))
    assert line(decide(state, call_of((X,), {"mask": X}))) == (
        "kwargs['mask'] was absent, now present (the input structure changed)"
    )
    state = after(call_of(([X, X],)))
    assert line(decide(state, call_of(((X, X),)))) == (
        "args[0] was a list, now a tuple (a container type changed)"
    )


def test_nested_paths_in_reasons() -> None:
    state = after(call_of((X, {"mask": None})))
    assert line(decide(state, call_of((X, {"mask": X})))) == (
        "args[1]['mask'] was None, now float32[?, ?] (None became a tensor)"
    )


def test_keyword_order_does_not_matter() -> None:
    state = after(call_of((), {"a": X, "b": 1}))
    assert decide(state, call_of((), {"b": 1, "a": X})) == Reuse()


def test_mode_options_and_module_version_reasons_come_first() -> None:
    state = after(call_of((X, True)))
    decision = decide(
        state,
        call_of(
            (X, False),
            training=False,
            version=ModuleVersion(1, "attribute 'k' set"),
            options=ExportOptions("dynamo", 18),
        ),
    )
    assert line(decision) == (
        "module was version 0, now version 1 (attribute 'k' set); "
        "mode was train, now eval (train/eval mode changed); "
        "option exporter was 'torchscript', now 'dynamo' (an export option changed); "
        "option opset_version was 17, now 18 (an export option changed); "
        "args[1] was True, now False (a static bool value changed)"
    )


def test_requires_grad_flip_reprocesses() -> None:
    state = after(call_of((X,)))
    decision = decide(state, call_of((X.clone().requires_grad_(),)))
    assert isinstance(decision, Reprocess)
    assert (
        line(decision)
        == "args[0] was requires_grad=False, now requires_grad=True (an input's requires_grad changed)"
    )
    decision = decide(state, call_of((X,), params=(False,)))
    assert isinstance(decision, Reprocess)
    assert (
        line(decision)
        == "parameter 'w' was requires_grad=True, now requires_grad=False (a parameter's requires_grad changed)"
    )


def test_device_and_determinism_make_only_a_new_session() -> None:
    state = after(call_of((X,)))
    decision = decide(state, call_of((X,), deterministic=True))
    assert isinstance(decision, NewSession)
    assert (
        line(decision)
        == "deterministic algorithms was off, now on (torch.use_deterministic_algorithms changed)"
    )
    assert line(decide(state, call_of((X,), device="cuda:0"))) == (
        "device was cpu, now cuda:0 (the module changed device)"
    )


def test_train_eval_switching_exports_each_mode_once() -> None:
    state = after(call_of((X,)), call_of((X,), training=False))
    assert state.stats.exports == 2
    assert decide(state, call_of((X,))) == Reuse()
    assert decide(state, call_of((X,), training=False)) == Reuse()


def test_lru_bound_evicts_the_least_recently_used() -> None:
    state: ExportState[int] = ExportState(maxsize=2)
    a, b, c = call_of((X, 1)), call_of((X, 2)), call_of((X, 3))
    for x in (a, b, a, c):  # a is used again, so b is the oldest when c arrives
        state = apply(state, x, decide(state, x), 0)
    assert decide(state, a) == Reuse()
    assert isinstance(decide(state, b), Reexport)
    assert state.stats.exports == 3
    assert state.stats.cache_hits == 1


def test_module_version_bump_makes_every_entry_unreachable() -> None:
    state = after(call_of((X,)))
    state = bump_module_version(state, "parameter set changed")
    call = call_of((X,), version=state.module_version)
    assert (
        line(decide(state, call)) == "module was version 0, now version 1 (parameter set changed)"
    )


def test_repeated_reexports_of_one_leaf_mark_it_for_a_warning_once() -> None:
    state = after(call_of((X, 0)))
    for i in range(1, REPEAT_WARN_AFTER + 3):
        c = call_of((X, i))
        state = apply(state, c, decide(state, c), 0)
        if i < REPEAT_WARN_AFTER:
            assert state.warned == frozenset()
    assert state.warned == frozenset({"args[1]"})


def test_reexports_for_different_leaves_do_not_build_a_streak() -> None:
    state = after(call_of((X, 0, 0)))
    for i in range(1, 6):
        c = call_of((X, i, 0) if i % 2 else (X, i - 1, i))
        state = apply(state, c, decide(state, c), 0)
    assert state.warned == frozenset()


def test_history_holds_only_transitions() -> None:
    state = after(call_of((X,)), call_of((X,)), call_of((X,)))
    assert [t.kind for t in state.history] == ["export"]
    assert state.stats.calls == 3 and state.stats.cache_hits == 2


def test_static_spec_distinguishes_bool_int_float_and_matches_nan() -> None:
    assert StaticSpec(True) != StaticSpec(1) != StaticSpec(1.0)
    assert StaticSpec(float("nan")) == StaticSpec(float("nan"))
    assert TensorSpec(torch.float32, 2, True, "cpu") == TensorSpec(torch.float32, 2, False, "cuda")


def test_unsupported_leaf_names_path_type_and_support() -> None:
    with pytest.raises(OrtfxIOError) as info:
        ModelSchema.from_call((X, {"mask": object()}), {})
    assert str(info.value).startswith(
        "input args[1]['mask'] has type object, which ortfx cannot carry through an ONNX graph. "
        "Supported leaves are torch.Tensor, None, bool, int, float or str"
    )


@dataclasses.dataclass
class Out:
    loss: Any
    n: Any = None


Pair = collections.namedtuple("Pair", "a b")


def test_construct_inputs_and_restore_outputs_round_trip() -> None:
    args, kwargs = (X, 3), {"mask": torch.ones(2, dtype=torch.bool)}
    schema = ModelSchema.from_call(args, kwargs)
    out_tree = {"p": Pair(torch.zeros(1), "tag"), "o": Out(torch.ones(1), 7)}
    out_leaves, out_spec = io.flatten(out_tree)
    info = PostExportProcessedModelInfo(
        model=b"",
        inputs=(
            InputSpec("kwargs_mask", InputKind.USER, 2),
            InputSpec("args_0", InputKind.USER, 0),
            InputSpec("w", InputKind.PARAMETER, "w", True),
        ),
        input_schema=schema,
        output_schema=ModelSchema.from_flat(out_leaves, out_spec, root="output"),
        output_names=("o0", "o1"),
    )
    w = torch.zeros(4)
    inputs = info.construct_inputs(args, kwargs, named_tensors={"w": w})
    assert inputs[0] is kwargs["mask"] and inputs[1] is X and inputs[2] is w
    restored = info.restore_outputs([t for t in out_leaves if isinstance(t, torch.Tensor)])
    assert type(restored["p"]) is Pair and restored["p"].b == "tag"
    assert type(restored["o"]) is Out and restored["o"].n == 7 and type(restored["o"].n) is int
    assert info.params_to_train == ("w",)


def test_tensorize_scalars_feeds_chosen_leaves_as_tensors() -> None:
    leaves, spec = io.flatten(io.call_tree((X, 3, 0.5, True), {}))
    out = tensorize_scalars(leaves, spec, paths=frozenset({"*"}))
    assert out[1].dtype == torch.int64 and out[2].dtype == torch.float32 and out[3] is True
    out = tensorize_scalars(leaves, spec, paths=frozenset({"args[3]"}))
    assert out[1] == 3 and out[3].dtype == torch.bool


def test_core_imports_without_onnxruntime() -> None:
    code = (
        "import sys; sys.modules['onnxruntime'] = None\n"
        "import ortfx.io, ortfx.schema, ortfx.keys, ortfx.reasons, ortfx.transitions\n"
        "import ortfx.model_info, ortfx.module_state, ortfx.function_names, ortfx.options\n"
        "import ortfx.errors, ortfx.memory, ortfx._torch, ortfx.passes, ortfx.export\n"
        "assert not any(m.startswith('onnxruntime') and sys.modules[m] for m in sys.modules)\n"
        "print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.stdout.strip() == "ok", result.stderr
