"""Attempts that do not end in ORT running the call leave no trace: whichever step fails
(export, gradient build, session creation), the fallback's step changes the module (buffers,
attributes, RNG streams) exactly as eager's one run does. CPU bf16 autocast is the common way
there (ORT 1.19 has no bfloat16 CPU training kernels)."""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
from torch import nn

import ortfx
from ortfx.export import trace
from ortfx.runtime.fallback import fall_back
from ortfx.runtime.records import Shell
from tests.models import max_diff


class Stateful(nn.Module):
    """A step that changes everything a module holds: running statistics (torch's kernel
    updates them without moving their version counter), a teacher's parameters (an EMA under
    no_grad), a counter attribute, a private one, and the default RNG stream (dropout)."""

    def __init__(self, norm: str = "batch", fails: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8) if norm == "batch" else nn.LayerNorm(8)
        self.head = nn.Linear(8, 2)
        self.teacher = nn.Linear(4, 8).requires_grad_(False)
        self.fails = fails
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self._last_batch = x.shape[0]
        with torch.no_grad():
            self.teacher.weight.mul_(0.5).add_(self.lin.weight, alpha=0.5)
        h = nn.functional.dropout(self.norm(self.lin(x)), 0.25, self.training)
        if self.fails:  # an op the TorchScript exporter cannot express
            h = torch.cummax(h, 1)[0]
        return self.head(h).float().pow(2).mean()


def _autocast(on: bool) -> contextlib.AbstractContextManager[object]:
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


CASES = {
    # where the attempt fails: autocast?, norm, an unexportable op?
    "export (bf16 autocast, BatchNorm)": (True, "batch", False),
    "export (an op the exporter lacks)": (False, "batch", True),
    "gradient build (bf16 autocast, LayerNorm)": (True, "layer", False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_failed_attempt_leaves_the_module_as_eager_does(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Three steps through the default policy against three eager steps from the same state
    and seed: losses, gradients, buffers (running statistics and the batch counter), the
    teacher's parameters, attributes and the RNG stream are equal (exact: the fallback runs
    the same code). One WARNING says why, once."""
    autocast, norm, fails = CASES[case]
    torch.manual_seed(0)
    model = Stateful(norm, fails)
    eager = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model)
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        for step in range(3):
            x = torch.randn(6, 4)
            torch.manual_seed(100 + step)
            with _autocast(autocast):
                got = wrapped(x)
            got.backward()
            after_ours = torch.rand(1)
            torch.manual_seed(100 + step)
            with _autocast(autocast):
                expected = eager(x)
            expected.backward()
            assert torch.equal(torch.rand(1), after_ours), "the RNG stream moved"
            assert got.dtype == expected.dtype and torch.equal(got, expected)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(model.named_buffers(), eager.buffers(), strict=True):
        assert torch.equal(b, c), name
    assert torch.equal(model.teacher.weight, eager.teacher.weight)
    assert (model.calls, model._last_batch) == (eager.calls, eager._last_batch) == (3, 6)
    stats = ortfx.stats(wrapped)
    assert stats.fallback_calls == 3 and stats.fallback is not None
    lines = [r for r in caplog.records if r.name == "ortfx" and "falling back" in r.message]
    assert len(lines) == 1
    # Outside autocast the same module runs in ORT (eval mode: no dropout masks to match).
    if not fails:
        wrapped.eval()
        eager.eval()
        x = torch.randn(6, 4)
        assert max_diff(wrapped(x), eager(x)) <= 1e-5
        assert ortfx.stats(wrapped).fallback is None


def test_a_session_that_cannot_open_leaves_the_module_as_eager_does() -> None:
    """The export succeeds and ORT cannot open the session (no bfloat16 Gemm on CPU): the
    attributes the traced forward set are undone, so eager's step counts once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    counted = Counted(model)
    eager = copy.deepcopy(counted)
    wrapped = ortfx.ORTModule(counted)
    logging.getLogger("ortfx").disabled = True
    try:
        for _ in range(2):
            x = torch.randn(3, 4)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert torch.equal(wrapped(x), eager(x))
    finally:
        logging.getLogger("ortfx").disabled = False
    assert counted.calls == eager.calls == 2
    # In ORT (no autocast), the first call's export counts once too, as eager's call.
    wrapped(torch.randn(3, 4))
    eager(torch.randn(3, 4))
    assert ortfx.stats(wrapped).fallback is None
    assert counted.calls == eager.calls == 3


class Counted(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.inner(x)
        return out


def test_layer_norm_under_bf16_autocast_is_a_typed_error_when_fallback_is_off() -> None:
    """FALLBACK_DISABLE: ORT's gradient build rejects the mixed-dtype LayerNormalization; the
    error names the operator and its node, and the module is as it was."""
    torch.manual_seed(0)
    model = Stateful("layer")
    options = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
    wrapped = ortfx.ORTModule(model, options=options)
    before = copy.deepcopy(model.state_dict())
    with (
        pytest.raises(ortfx.OrtfxUnsupportedOpError, match="LayerNormalization") as info,
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        wrapped(torch.randn(6, 4))
    assert info.value.op == "LayerNormalization" and "norm" in info.value.node
    assert model.calls == 0 and not hasattr(model, "_last_batch")
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_graph_build_failures_that_name_no_operator_fall_back_under_the_default_policy() -> None:
    """An ORT build or session failure of one graph (OrtfxGraphBuildError, an
    OrtfxInitError) falls back under the default policy (UNSUPPORTED_ONNX_MODEL) and raises
    under DISABLE; ORT missing (a plain OrtfxInitError) still needs BAD_INITIALIZATION."""
    error = ortfx.OrtfxGraphBuildError("ONNX Runtime could not build the gradient graph: ...")
    assert isinstance(error, ortfx.OrtfxInitError)
    logging.getLogger("ortfx").disabled = True
    try:
        fallen = fall_back(Shell.create(ortfx.Options()), error, key="k")
        assert fallen.state.fallback_reason("k") is not None
        strict = Shell.create(ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE))
        with pytest.raises(ortfx.OrtfxGraphBuildError):
            fall_back(strict, error, key="k")
        with pytest.raises(ortfx.OrtfxInitError):
            fall_back(Shell.create(ortfx.Options()), ortfx.OrtfxInitError("no ORT"), key="k")
    finally:
        logging.getLogger("ortfx").disabled = False


def test_an_export_failing_under_autocast_says_autocast_was_on() -> None:
    """BatchNorm under bf16 autocast fails in torch's exporter ("mixed dtype (CPU)"), a message
    that names neither autocast nor bf16: ortfx's error says the call ran under autocast and
    what to do; the same failure without autocast does not say it."""
    options = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
    torch.manual_seed(0)
    with (
        pytest.raises(ortfx.OrtfxExportError, match="mixed dtype") as info,
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        ortfx.ORTModule(Stateful("batch"), options=options)(torch.randn(6, 4))
    assert str(info.value).endswith(trace.AUTOCAST_ACTIVE)
    with pytest.raises(ortfx.OrtfxExportError, match="cummax") as plain:
        ortfx.ORTModule(Stateful("batch", fails=True), options=options)(torch.randn(6, 4))
    assert "autocast" not in str(plain.value)
