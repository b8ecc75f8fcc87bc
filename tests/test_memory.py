"""Layer-wise recompute: levels, user configs, report, checkpoint, parity with level 0."""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any

import onnx
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ortfx
from ortfx import options as options_module
from ortfx.memory import PLAN_FORM, Plan, evaluate, parse_config
from tests import models
from tests.models import max_diff


def _recompute_nodes(directory: str) -> int:
    graph = onnx.load(os.path.join(directory, "m_execution_model_training.onnx")).graph
    return sum(n.name.endswith("_recompute") for n in graph.node)


def _train_step(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss: Any
) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    value = loss(model(*args, **kwargs))
    value.backward()
    return value.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _gpt2_case() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], Any]:
    ids = torch.randint(0, 64, (2, 12))
    kwargs = {
        "input_ids": ids,
        "labels": ids,
        "attention_mask": torch.ones_like(ids),
        "use_cache": False,
    }
    return models.tiny_gpt2(), (), kwargs, lambda out: out.loss


def _bert_case() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], Any]:
    ids = torch.randint(1, 64, (2, 12))
    kwargs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.tensor([0, 2]),
    }
    return models.tiny_bert(), (), kwargs, lambda out: out.loss


def _block_case() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], Any]:
    return (
        nn.Sequential(models.GPTBlock(), models.GPTBlock()),
        (torch.randn(2, 12, 32),),
        {},
        lambda y: y.square().mean(),
    )


@pytest.mark.parametrize(
    "case", [_block_case, _gpt2_case, _bert_case], ids=["gpt_block", "gpt2", "bert"]
)
def test_level_1_adds_recompute_nodes_and_matches_level_0(case: Any, tmp_path: Any) -> None:
    torch.manual_seed(0)
    model, args, kwargs, loss = case()
    baseline = ortfx.ORTModule(copy.deepcopy(model))
    debug = ortfx.DebugOptions(save_onnx=True, onnx_prefix="m", save_path=str(tmp_path))
    layerwise = ortfx.ORTModule(model, debug, options=ortfx.Options(memory_opt_level=1))
    for _ in range(2):
        loss_0, grads_0 = _train_step(baseline, args, kwargs, loss)
        loss_1, grads_1 = _train_step(layerwise, args, kwargs, loss)
        assert abs(loss_0 - loss_1) <= 1e-5
        assert len(grads_0) == len(grads_1)
        for g0, g1 in zip(grads_0, grads_1, strict=True):
            assert max_diff(g0, g1) <= 1e-5
    assert _recompute_nodes(str(tmp_path)) > 0
    report = ortfx.memory_report(layerwise)
    assert report and all(p.enabled for p in report if p.config.endswith(":1:-1"))
    assert not any(p.enabled for p in ortfx.memory_report(baseline))


def test_level_0_config_turns_on_exactly_the_named_plan_in_both_forms(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model, args, _, loss = _block_case()
    probe = ortfx.ORTModule(copy.deepcopy(model))
    loss(probe(*args)).backward()
    discovered = [p.config for p in ortfx.memory_report(probe)]
    assert "Gelu+Reshape+:1:-1" in discovered
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(["Gelu+Reshape+:1:-1"]))
    for config in ("Gelu+Reshape+:1:-1", str(path)):
        wrapped = ortfx.ORTModule(
            copy.deepcopy(model), options=ortfx.Options(memory_opt_config=config)
        )
        loss(wrapped(*args)).backward()
        status = {p.config: p.enabled for p in ortfx.memory_report(wrapped)}
        assert status["Gelu+Reshape+:1:-1"] is True
        assert [c for c, on in status.items() if on] == ["Gelu+Reshape+:1:-1"]


def test_report_rows_estimate_bytes_from_input_sizes() -> None:
    torch.manual_seed(0)
    wrapped = ortfx.ORTModule(models.GPTBlock(), options=ortfx.Options(memory_opt_level=1))
    wrapped(torch.randn(2, 12, 32)).sum().backward()
    gelu = next(p for p in ortfx.memory_report(wrapped) if p.config == "Gelu+Reshape+:1:-1")
    # One GELU over (batch 2, seq 12, hidden 128) float32 activations.
    assert (gelu.frequency, gelu.saving_bytes) == (1, 2 * 12 * 128 * 4)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            "Gelu+",
            "memory optimizer config entry 'Gelu+' is not a plan: expected 'cluster:type:count', e.g. 'Gelu+:1:-1'",
        ),
        ("Gelu+:3:-1", "memory optimizer config entry 'Gelu+:3:-1' is not a plan"),
        (
            "Gelu+:1:-1,FusedMatMul+:1:x",
            "memory optimizer config entry 'FusedMatMul+:1:x' is not a plan",
        ),
        ("missing_plans.json", "memory optimizer config file 'missing_plans.json' does not exist"),
        ("Gelu+:1", "memory optimizer config entry 'Gelu+:1' is not a plan"),
        ("Gelu+:one:-1", "memory optimizer config entry 'Gelu+:one:-1' is not a plan"),
        ("Gelu+:1:-1:2", "memory optimizer config entry 'Gelu+:1:-1:2' is not a plan"),
        ("x:Gelu+:1:-1", "memory optimizer config entry 'x:Gelu+:1:-1' is not a plan"),
    ],
)
def test_malformed_configs_name_the_bad_entry(config: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"is not a plan|does not exist") as info:
        ortfx.Options(memory_opt_config=config)
    assert str(info.value).startswith(message)


def test_malformed_json_file_names_file_and_entry(tmp_path: Any) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(["Gelu+:1:-1", "oops"]))
    with pytest.raises(ValueError, match=r"entry 'oops' is not a plan.*\(in .*bad.json\)"):
        parse_config(str(path))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        parse_config(str(path))
    path.write_text(json.dumps(["Gelu+:1:-1", 3]))
    with pytest.raises(ValueError, match="entry 1") as info:
        ortfx.Options(memory_opt_config=str(path))
    assert str(info.value) == (
        f"memory optimizer config file {str(path)!r}: entry 1 (3) is a int, not a plan string; "
        f"expected {PLAN_FORM}."
    )


def test_malformed_config_from_environment_warns_naming_the_entry_and_form() -> None:
    options_module._warned.clear()
    with pytest.warns(ortfx.OrtfxWarning) as record:
        got = ortfx.Options.from_env(environ={"ORTMODULE_MEMORY_OPT_CONFIG": "Gelu+:1:-1,Gelu+:1"})
    assert got == ortfx.Options()
    assert [str(w.message) for w in record] == [
        "ignoring ORTMODULE_MEMORY_OPT_CONFIG='Gelu+:1:-1,Gelu+:1': memory optimizer config "
        "entry 'Gelu+:1' is not a plan: expected 'cluster:type:count', e.g. 'Gelu+:1:-1' where "
        "type is 0, 1 or 2 and count is -1 (all) or a non-negative int; keeping the default."
    ]


def test_configure_rejects_a_malformed_config() -> None:
    wrapped = ortfx.ORTModule(models.MLP(), options=ortfx.Options(memory_opt_config="Gelu+:1:-1"))
    with pytest.raises(ValueError, match=r"entry 'Gelu\+:one:-1' is not a plan"):
        ortfx.configure(wrapped, memory_opt_config="Gelu+:one:-1")


def test_level_1_ignores_the_config_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    options = ortfx.Options(memory_opt_level=1, memory_opt_config="Gelu+:1:-1")
    wrapped = ortfx.ORTModule(models.GPTBlock(), options=options)
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        for t in (4, 5):
            wrapped(torch.randn(1, t, 32, requires_grad=t == 5)).sum().backward()
    said = [r.getMessage() for r in caplog.records if "ignores memory_opt_config" in r.getMessage()]
    assert said == [
        "memory_opt_level 1 turns on every layer-wise plan itself and ignores memory_opt_config "
        "'Gelu+:1:-1'; use level 0 to apply only the listed plans"
    ]


def test_changing_the_level_reprocesses_without_export() -> None:
    wrapped = ortfx.ORTModule(models.GPTBlock())
    x = torch.randn(2, 6, 32)
    wrapped(x).sum().backward()
    ortfx.configure(wrapped, memory_opt_level=1)
    wrapped(x).sum().backward()
    s = ortfx.stats(wrapped)
    assert (s.exports, s.reprocesses) == (1, 1)
    assert str(ortfx.explain(wrapped)[-1]) == (
        "re-process: option memory_opt_level was 0, now 1 (a memory optimizer option changed)"
    )
    with pytest.raises(ValueError, match="'memory_opt_level' must be one of 0, 1, 2"):
        ortfx.configure(wrapped, memory_opt_level=5)
    assert ortfx.options_of(wrapped).memory_opt_level == 1


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(models.GPTBlock() for _ in range(2))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("level", [0, 1])
def test_torch_checkpoint_inside_exports_and_is_explained(
    reentrant: bool, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    reference = copy.deepcopy(model)
    debug = ortfx.DebugOptions(log_level=ortfx.LogLevel.INFO)
    wrapped = ortfx.ORTModule(model, debug, options=ortfx.Options(memory_opt_level=level))
    x = torch.randn(2, 6, 32)
    # An input that requires grad: through a reentrant checkpoint, the only way PyTorch gives
    # the parameters inside gradients (tests/test_randomness.py covers the other case).
    with caplog.at_level(logging.INFO, logger="ortfx"):
        out = wrapped(x.clone().requires_grad_())
    expected = reference(x.clone().requires_grad_())
    assert max_diff(out, expected) <= 1e-5
    out.sum().backward()
    expected.sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert max_diff(p.grad, q.grad) <= 1e-5
    said = [r.getMessage() for r in caplog.records if "torch.utils.checkpoint" in r.getMessage()]
    assert len(said) == 1
    if level:
        assert "memory_opt_level 1 recomputes layer-wise inside ONNX Runtime instead" in said[0]
        assert any(p.enabled for p in ortfx.memory_report(wrapped))
    else:
        assert (
            "at memory_opt_level 0 their activations are kept like any others (no recompute)"
            in said[0]
        )
    assert ortfx.stats(wrapped).fallback is None


def test_plan_strings_and_estimates() -> None:
    assert str(Plan.parse("FusedMatMul+Add+:1:-1")) == "FusedMatMul+Add+:1:-1"
    assert parse_config("Gelu+:1:-1, FusedMatMul+:1:12") == (
        Plan("Gelu+", 1, -1),
        Plan("FusedMatMul+", 1, 12),
    )
    assert evaluate("((a)*(b)*(4)) * 4 * 1.000000 + floor(c/4)", {"a": 2, "b": 3, "c": 9}) == 98.0
    assert evaluate("empty_dim_param3 * 4", {"a": 1}) is None
    assert evaluate("__import__('os')", {}) is None


def test_every_plan_discovered_at_level_1_is_applied(tmp_path: Any) -> None:
    """Plans are named by the ops of the graph they were found on: discovery and the session
    that applies them must see the same graph, or plans reported ON match nothing (silently).
    The reference forces ORT's full optimization on every session through the seam."""
    import onnxruntime as ort

    from ortfx.runtime import events

    def recompute_nodes(where: Any, force_all: bool) -> int:
        torch.manual_seed(0)
        model, args, _, loss = _block_case()
        debug = ortfx.DebugOptions(save_onnx=True, onnx_prefix="m", save_path=str(where))
        every = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if force_all:
            events.session_option_edits.append(
                lambda so, training: setattr(so, "graph_optimization_level", every)
            )
        try:
            wrapped = ortfx.ORTModule(model, debug, options=ortfx.Options(memory_opt_level=1))
            loss(wrapped(*args)).backward()
        finally:
            if force_all:
                events.session_option_edits.pop()
        return _recompute_nodes(str(where))

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    applied = recompute_nodes(tmp_path / "a", force_all=False)
    assert applied == recompute_nodes(tmp_path / "b", force_all=True)
    assert applied >= 20  # GPTBlock: most of its 7 plans, several nodes each
