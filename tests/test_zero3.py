"""ZeRO-3 with real DeepSpeed: 1 and 2 ranks (gloo on 127.0.0.1) train through ortfx as plain
PyTorch and eager DeepSpeed do; the gather-all protocol gathers and releases in pairs.

Each world size is one launch of ``tests/zero3_worker.py`` per rank, running every scenario;
DeepSpeed must be installed (the ``test`` extra): a missing one fails here, it is not skipped.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import ortfx
from ortfx.errors import ZERO3_NOT_CONFIGURED
from ortfx.hooks import zero3
from tests.models import TinyGPT
from tests.test_hooks import Scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 1e-6
TIMEOUT = 300  # seconds per launch; a hung collective fails instead of blocking the suite


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _launch(world: int) -> list[dict[str, Any]]:
    """Start one worker process per rank, wait (bounded), check exit codes, read results."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                "DS_ACCELERATOR": "cpu",
                "OMP_NUM_THREADS": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
            }
            log = open(os.path.join(tmp, f"log{rank}.txt"), "w")  # noqa: SIM115 - closed below
            out = os.path.join(tmp, f"out{rank}.json")
            cmd = [sys.executable, "-m", "tests.zero3_worker", out]
            procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log), log))
        codes = []
        for proc, log in procs:
            try:
                codes.append(proc.wait(timeout=TIMEOUT))
            except subprocess.TimeoutExpired:
                for other, _ in procs:
                    other.kill()
                codes.append(None)
            finally:
                log.close()
        if codes != [0] * world:
            logs = ""
            for r, c in enumerate(codes):
                with open(os.path.join(tmp, f"log{r}.txt")) as f:
                    logs += f"--- rank {r} (exit {c}) ---\n{f.read()[-4000:]}\n"
            pytest.fail(f"ZeRO-3 worker launch with {world} rank(s) failed:\n{logs}")
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"out{rank}.json")) as f:
                results.append(json.load(f))
        return results


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return _launch(request.param)


def _problems(runs: list[dict[str, Any]], reference: dict[str, Any]) -> list[str]:
    """How a run (one result per rank) differs from ``reference`` beyond TOLERANCE; its error
    if it raised. Empty means parity."""
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return errors
    problems = []
    # Each rank's loss is the mean over its shard; their mean is the full-batch mean.
    losses = np.mean([r["losses"] for r in runs], axis=0)
    loss_diff = float(np.max(np.abs(losses - np.array(reference["losses"]))))
    if loss_diff > TOLERANCE:
        problems.append(f"losses differ by {loss_diff:.3g}")
    for rank, run in enumerate(runs):
        for name, want in reference["weights"].items():
            diff = float(np.max(np.abs(np.array(run["weights"][name]) - np.array(want))))
            if diff > TOLERANCE:
                problems.append(f"rank {rank}: {name} differs by {diff:.3g}")
    return problems


def test_deepspeed_is_installed() -> None:
    """The test extra installs DeepSpeed 0.19 (this fails loudly where it is missing)."""
    assert importlib.metadata.version("deepspeed").startswith("0.19.")


def test_parity_with_plain_pytorch_and_eager_deepspeed(ranks: list[dict[str, Any]]) -> None:
    """10 steps through ortfx under ZeRO-3 match plain PyTorch on the full batch and eager
    DeepSpeed ZeRO-3 (losses and final gathered weights) within 1e-6."""
    plain = ranks[0]["plain"]
    eager = [r["eager"] for r in ranks]
    ours = [r["ortfx"] for r in ranks]
    assert _problems(eager, plain) == []  # the reference itself
    assert _problems(ours, plain) == []
    eager_mean = {**eager[0], "losses": np.mean([e["losses"] for e in eager], axis=0)}
    assert _problems(ours, eager_mean) == []


def test_every_gather_is_released_and_nothing_reexports(ranks: list[dict[str, Any]]) -> None:
    """After each step every parameter is partitioned, each gather had its release, no forward
    is pending, and the module was exported once."""
    for r in ranks:
        for step, check in enumerate(r["ortfx"]["checks"], start=1):
            assert check == {
                "partitioned": True,
                "gathers": step,
                "releases": step,
                "live": 0,
                "held": 0,
                "exports": 1,
            }
        assert r["ortfx"]["transitions"] == [
            "export: module was never exported, now called (first call)"
        ]
        # DeepSpeed's bookkeeping stays on the wrapper and did not invalidate the graph.
        assert r["ortfx"]["hook_state_on_wrapper"] == ["ds_inflight_param_registry"]


def test_debug_statistics_pair_every_gather_with_its_release(ranks: list[dict[str, Any]]) -> None:
    """With debug and stats_output_dir, each rank writes one line per gather and release."""
    for r in ranks:
        events = r["ortfx"]["events"]
        assert [e["event"] for e in events] == ["gather", "release"] * 12
        # 612 = every element of Net, gathered whole and released whole each time.
        assert {(e["params"], e["elements"]) for e in events} == {(7, 612)}


def test_eval_releases_at_once_training_forward_holds_until_backward(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        run = r["ortfx"]
        assert run["after_no_grad"]["partitioned"] and run["after_no_grad"]["live"] == 0
        between = run["between"]
        assert not between["partitioned"] and between["live"] == 1
        assert between["gathers"] == between["releases"] + 1
        assert run["after_backward"] == {
            **between,
            "partitioned": True,
            "releases": between["gathers"],
            "live": 0,
            "held": 0,
        }


def test_graph_inputs_have_the_full_shapes(ranks: list[dict[str, Any]]) -> None:
    """The exported graph's parameter inputs have ``ds_shape``, not the partitioned (0,)."""
    for r in ranks:
        for name, (graph, full) in r["ortfx"]["graph_shapes"].items():
            assert graph == full, name


def test_unconfigured_wrapper_says_what_to_do(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["unconfigured"]["error"] == ZERO3_NOT_CONFIGURED.format(
            count=7, name="emb.weight", full=[16, 8], local=[0]
        )


@pytest.mark.parametrize(
    ("control", "because"),
    [
        # p.grad written directly: DeepSpeed's post-accumulate hooks never run.
        ("grad_assign", "unknown parameter type"),
        # released between forward and backward: ORT's full-size gradients meet (0,) parameters.
        ("early_release", "The size of tensor a (0) must match"),
    ],
)
def test_negative_controls_fail(ranks: list[dict[str, Any]], control: str, because: str) -> None:
    """Broken protocols do not pass the parity check, so the checks above can fail."""
    runs = [r[control] for r in ranks]
    problems = _problems(runs, ranks[0]["plain"])
    assert problems
    assert all(because in p for p in problems), problems


# ---- phase 2: layer-wise gathering inside the graph -----------------------------------------

LAYERS, WIDTH = 8, 32  # tests/zero3_worker.py's Deep
LAYER = WIDTH * WIDTH + WIDTH  # one Linear's elements
# Per step after the first: every parameter once in the forward, once in the backward.
GATHERS_PER_STEP = 2 * 2 * LAYERS


def test_layerwise_parity_with_plain_pytorch_and_eager_deepspeed(
    ranks: list[dict[str, Any]],
) -> None:
    """Phase 2 on 8 Linear layers, 10 steps: losses and final gathered weights within 1e-6."""
    runs = [r["layerwise"] for r in ranks]
    plain = runs[0]["plain"]
    eager = [r["eager"] for r in runs]
    ours = [r["ortfx"] for r in runs]
    assert _problems(eager, plain) == []
    assert _problems(ours, plain) == []
    eager_mean = {**eager[0], "losses": np.mean([e["losses"] for e in eager], axis=0)}
    assert _problems(ours, eager_mean) == []


def test_layerwise_gathers_each_parameter_next_to_its_layer(ranks: list[dict[str, Any]]) -> None:
    """Each step gathers every parameter in the forward and again in the backward, releases
    each, ends partitioned with no context kept, and never re-exports."""
    for r in ranks:
        run = r["layerwise"]["ortfx"]
        assert run["options"] == [True, True]
        # Layers 1-7 read their weight in the backward (dX); layer 0's input needs no grad.
        assert run["regathers"] == LAYERS - 1
        assert run["ordered_feeds"] == 2 * (LAYERS - 1)  # layer 0 reads a graph input
        for step, check in enumerate(run["checks"], start=1):
            gathers = 1 + GATHERS_PER_STEP * step  # the export gathers all, once
            assert check == {
                "partitioned": True,
                "gathers": gathers,
                "releases": gathers,
                "live": 0,
                "held": 0,
                "exports": 1,
                "contexts": 0,
            }


def test_layerwise_no_grad_forward_gathers_all_and_releases(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        run = r["layerwise"]["ortfx"]
        after = run["after_no_grad"]
        last = run["checks"][-1]
        assert after == {**last, "gathers": last["gathers"] + 1, "releases": last["releases"] + 1}


def test_layerwise_eval_before_training_exports_with_the_weights_gathered(
    ranks: list[dict[str, Any]],
) -> None:
    """An eval-mode no_grad call first (its own export), then a training step: the training
    export gathers the partitioned weights for its trace; both losses equal eager DeepSpeed's
    first (the model has no dropout). Configured with the defaults: layer-wise (issue 31)."""
    for r in ranks:
        run = r["layerwise"]["ortfx"]["eval_first"]
        want = r["layerwise"]["eager"]["losses"][0]
        assert np.abs(np.array(run["losses"]) - want).max() <= TOLERANCE
        assert run["partitioned"] and run["exports"] == 2
        assert run["default_layerwise"] is True


def test_layerwise_every_gather_has_its_release(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        events = r["layerwise"]["ortfx"]["events"]
        held, most = 0, 0
        for e in events[2:-2]:  # between the gather-alls of the first step and the no_grad call
            held += e["elements"] if e["event"] == "gather" else -e["elements"]
            assert held >= 0
            most = max(most, held)
        assert held == 0
        assert most == WIDTH * WIDTH  # one weight at a time, as DeepSpeed counts
        assert [e["event"] for e in events[:2]] == ["gather", "release"]
        assert [e["event"] for e in events[-2:]] == ["gather", "release"]
        assert {e["params"] for e in events[2:-2]} == {1}  # one parameter at a time


def test_layerwise_peak_gathered_memory_matches_eager_deepspeed(
    ranks: list[dict[str, Any]],
) -> None:
    """After the first step, the gathered parameter elements a rank holds at once, counted by
    DeepSpeed's status and measured as live storage (which also sees what ORT holds), are at
    most 1.2x eager DeepSpeed's (which gathers one Linear at a time)."""
    for r in ranks:
        eager, ours = r["layerwise"]["eager"], r["layerwise"]["ortfx"]
        assert ours["peak_counted"] <= 1.2 * eager["peak_counted"]
        assert ours["peak_stored"] <= 1.2 * eager["peak_stored"]
        if len(ranks) == 2:  # on 1 rank eager DeepSpeed keeps every parameter's storage
            assert eager["peak_stored"] == eager["peak_counted"] == LAYER
            # Without the pause for gloo's worker thread, a back-to-back gather can briefly
            # see the previous one's buffer: at most one more weight.
            assert ours["peak_stored_at_once"] <= LAYER + WIDTH * WIDTH


def test_gather_probe_sees_phase_1_holding_everything(ranks: list[dict[str, Any]]) -> None:
    """The probe can fail: phase 1 holds the whole model (612 elements of Net) at once."""
    for r in ranks:
        assert r["ortfx"]["peak_stored"] == r["ortfx"]["peak_counted"] == 612


# ---- in-process: no DeepSpeed launch needed ------------------------------------------------


def test_deepspeed_bookkeeping_attributes_do_not_invalidate() -> None:
    """ds_* and DeepSpeed's per-forward counters set on the wrapper stay on it (the user's
    forward cannot read them) and keep the graph; other attributes still invalidate."""
    model = ortfx.ORTModule(Scaled())
    x = torch.randn(4, 3)
    model(x)
    for value in range(3):
        model.ds_grads_remaining = value
        model.applied_pre_backward_ref_cnt = value
        model(x)
    assert model.ds_grads_remaining == 2 and "ds_grads_remaining" not in vars(model.module)
    assert ortfx.stats(model).exports == 1
    del model.ds_grads_remaining
    assert not hasattr(model, "ds_grads_remaining")
    model.scale = 2.0  # the forward reads it: re-export, and the new value is used
    torch.testing.assert_close(model(x), model.module.lin(x) * 2.0)
    assert ortfx.stats(model).exports == 2


def test_a_ds_attribute_the_module_has_is_still_forwarded() -> None:
    inner = Scaled()
    inner.ds_scale = 1.0  # type: ignore[assignment]
    model = ortfx.ORTModule(inner)
    model(torch.randn(4, 3))
    model.ds_scale = 3.0
    assert inner.ds_scale == 3.0
    assert ortfx.stats(model).exports == 1
    model(torch.randn(4, 3))
    assert ortfx.stats(model).exports == 2


def test_partitioned_parameters_without_the_hooks_raise() -> None:
    """A parameter carrying ZeRO-3's ds_shape in a wrapper without the hooks is an error, not
    an export of a (0,)-shaped weight."""
    inner = Scaled()
    inner.lin.weight.ds_shape = inner.lin.weight.shape  # type: ignore[attr-defined]
    model = ortfx.ORTModule(inner)
    with pytest.raises(ortfx.OrtfxInitError) as info:
        model(torch.randn(4, 3))
    assert str(info.value) == ZERO3_NOT_CONFIGURED.format(
        count=1, name="lin.weight", full=[2, 3], local=[2, 3]
    )
    assert ortfx.stats(model).exports == 0


def test_statistics_file_is_not_overwritten_unless_asked(tmp_path: Any) -> None:
    settings = zero3.Settings(debug=True, stats_output_dir=str(tmp_path))
    sink = zero3._stats_sink(settings)
    assert sink is not None
    sink.close()
    with pytest.raises(FileExistsError, match="stats_overwrite=True"):
        zero3._stats_sink(settings)
    again = zero3._stats_sink(zero3.Settings(True, str(tmp_path), stats_overwrite=True))
    assert again is not None
    again.close()


class TiedAndTransposed(nn.Module):
    """A weight read through a Transpose, and a tied weight read by the first and last layer:
    the rewrite must clone the layout node into the backward and must not chain into a cycle."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 6)
        self.mid = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(6, 6) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(x))
        h = torch.tanh(h @ self.w.t())
        h = torch.tanh(self.mid(h))
        return (self.emb(h) ** 2).mean()


@pytest.mark.parametrize("make", [TiedAndTransposed, lambda: nn.Sequential(nn.Linear(5, 5))])
def test_layerwise_rewrite_keeps_gradients(tmp_path: Any, make: Any) -> None:
    """Without DeepSpeed the feeds hand out the parameters as they are: the rewritten gradient
    graph (ordered feeds, backward re-feeds, one backward gather at a time) must give eager's
    gradients, input gradient included."""
    torch.manual_seed(0)
    eager = make()
    model = ortfx.ORTModule(
        copy.deepcopy(eager),
        options=ortfx.Options(
            enable_mem_efficient_grad_management=True,
            zero3_layerwise=True,
            save_onnx=True,
            onnx_prefix="lw",
            save_path=str(tmp_path),
        ),
    )
    width = next(eager.parameters()).shape[1]
    for _ in range(2):
        x = torch.randn(4, width, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        out = eager(x2)
        (out if out.dim() == 0 else out.sum()).backward()
        out = model(x)
        (out if out.dim() == 0 else out.sum()).backward()
        torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=1e-6)
        for (name, p), q in zip(model.module.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)
    graph = onnx.load(str(tmp_path / "lw_optimized_training.onnx")).graph
    regathered = [n for n in graph.node if n.name.startswith("ortfx_layerwise_regather_")]
    assert regathered  # every weight here has a backward reader (dX)
    assert ortfx.stats(model).exports == 1


def test_layerwise_rewrite_on_a_transformer_matches_the_unrewritten_graph(tmp_path: Any) -> None:
    """TinyGPT (embedding, LayerNorm, attention, head): the rewritten graph's gradients equal
    those of the same graph without the rewrite, over two steps."""
    torch.manual_seed(0)
    base = TinyGPT()
    ids = torch.randint(0, 64, (2, 8))
    grads = []
    for layerwise in (False, True):
        model = ortfx.ORTModule(
            copy.deepcopy(base),
            options=ortfx.Options(
                enable_mem_efficient_grad_management=True,
                zero3_layerwise=layerwise,
                save_onnx=True,
                onnx_prefix=f"gpt{int(layerwise)}",
                save_path=str(tmp_path),
            ),
        )
        for _ in range(2):
            model(ids, ids).backward()
        grads.append([p.grad for p in model.module.parameters()])
        graph = onnx.load(str(tmp_path / f"gpt{int(layerwise)}_optimized_training.onnx")).graph
        regathers = [n for n in graph.node if n.name.startswith("ortfx_layerwise_regather_")]
        assert bool(regathers) is layerwise
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
