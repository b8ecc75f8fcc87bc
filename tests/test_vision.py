"""Vision models as timm and torchvision build them: BatchNorm updated through functional
calls, hard activations' gradients; each against eager PyTorch."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortfx
from tests import vision_libraries

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d`` forward (timm/layers/norm_act.py): a BatchNorm2d subclass
    calling ``F.batch_norm`` on its own buffers, then an activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (
                1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            )
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track_running_stats
        x = F.batch_norm(
            x,
            self.running_mean if keep else None,
            self.running_var if keep else None,
            self.weight,
            self.bias,
            use_batch,
            factor,
            self.eps,
        )
        return torch.relu(x)


class FunctionalNorm(nn.Module):
    """A module normalizing by statistics it keeps in its own buffers, through F.batch_norm."""

    mean: torch.Tensor
    var: torch.Tensor

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(channels))
        self.register_buffer("var", torch.ones(channels))
        self.scale = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.mean, self.var, self.scale, None, self.training, 0.2, 1e-5)


class SubclassedNorm(nn.BatchNorm2d):
    """A subclass whose forward adds to torch's (super().forward, F.batch_norm inside)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def _net(norm: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), norm, nn.Conv2d(4, 2, 1))


NORMS: dict[str, Callable[[], nn.Module]] = {
    "BatchNormAct2d": lambda: BatchNormAct2d(4),
    "BatchNormAct2d-cumulative": lambda: BatchNormAct2d(4, momentum=None),
    "functional": lambda: FunctionalNorm(4),
    "subclass": lambda: SubclassedNorm(4),
}


def _where(path: str, step: int) -> Callable[[str], str]:
    return lambda message: f"{path}, step {step}: {message}"


def _steps(model: nn.Module, inputs: list[torch.Tensor], lr: float = 0.1) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x in inputs:
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("name", sorted(NORMS))
def test_functional_batch_norm_updates_statistics_as_eager(name: str) -> None:
    """Running statistics updated through F.batch_norm (a subclass's forward, a module's own
    buffers) match eager after every step, the exporting one included, and eval after
    training matches."""
    torch.manual_seed(0)
    eager = _net(NORMS[name]())
    wrapped = ortfx.ORTModule(copy.deepcopy(eager), options=STRICT)
    inputs = [torch.randn(4, 3, 6, 6) for _ in range(3)]
    for step, x in enumerate(inputs):
        expected, got = _steps(eager, [x]), _steps(wrapped, [x])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        for (path, a), (_, b) in zip(
            eager.named_buffers(), wrapped.module.named_buffers(), strict=True
        ):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=_where(path, step))
    eager.eval()
    wrapped.eval()
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    torch.testing.assert_close(wrapped(x), eager(x), rtol=1e-5, atol=1e-6)
    assert ortfx.stats(wrapped).fallback_calls == 0


class Activation(nn.Module):
    """``act(x * w)`` with ``w`` ones: the activation's gradient reaches both ``x`` and ``w``."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor], size: int) -> None:
        super().__init__()
        self.act = act
        self.w = nn.Parameter(torch.ones(size, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x * self.w.to(x.dtype))


# The kinks and their neighbours, and values well inside and outside.
KINKS = [-4.0, -3.0001, -3.0, -2.9999, -1.0, 0.0, 0.5, 2.9999, 3.0, 3.0001, 5.0]
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Hardswish": nn.Hardswish(),
    "F.hardswish": F.hardswish,
    "Hardsigmoid": nn.Hardsigmoid(),
    "F.hardsigmoid": F.hardsigmoid,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_hard_activations_train_as_eager(name: str, dtype: torch.dtype) -> None:
    """Hardswish and Hardsigmoid train in ORT (ORT 1.19 cannot differentiate them: the graph
    writes them as ops it can), with eager's values and gradients, at the kinks too."""
    eager = Activation(ACTIVATIONS[name], len(KINKS))
    wrapped = ortfx.ORTModule(copy.deepcopy(eager), options=STRICT)
    results = []
    for model in (eager, wrapped):
        x = torch.tensor(KINKS, dtype=dtype, requires_grad=True)
        y = model(x)
        (y * torch.linspace(1, 2, len(KINKS), dtype=dtype)).sum().backward()
        results.append(
            (y.detach(), x.grad, model.w.grad if model is eager else wrapped.module.w.grad)
        )
    for got, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert ortfx.stats(wrapped).fallback_calls == 0


class MobileBlock(nn.Module):
    """MobileNetV3's inverted residual: conv, BatchNorm, hardswish, squeeze-excite gated by
    hardsigmoid."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.Hardswish())
        self.squeeze = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 4, 1), nn.ReLU(), nn.Conv2d(4, 8, 1)
        )
        self.project = nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.expand(x)
        out: torch.Tensor = x + self.project(h * F.hardsigmoid(self.squeeze(h)))
        return out


def test_mobilenet_block_trains_in_ort() -> None:
    """A MobileNetV3 block trains in ORT (no fallback) with eager's losses and statistics."""
    torch.manual_seed(0)
    eager = MobileBlock()
    wrapped = ortfx.ORTModule(copy.deepcopy(eager), options=STRICT)
    inputs = [torch.randn(4, 3, 5, 5) * 3 for _ in range(3)]
    torch.testing.assert_close(_steps(wrapped, inputs), _steps(eager, inputs), rtol=1e-5, atol=1e-6)
    for a, b in zip(eager.buffers(), wrapped.module.buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert ortfx.stats(wrapped).fallback_calls == 0


def _timm(name: str) -> nn.Module:
    timm = vision_libraries.import_timm()
    model: nn.Module = timm.create_model(name, pretrained=False, num_classes=3)
    return model


def _torchvision(name: str) -> nn.Module:
    torchvision = vision_libraries.import_torchvision()
    # No dropout: eager's and ORT's random streams differ.
    model: nn.Module = getattr(torchvision.models, name)(num_classes=3, dropout=0.0)
    return model


LIBRARY_MODELS: dict[str, Callable[[], nn.Module]] = {
    "timm-regnetx_002": lambda: _timm("regnetx_002"),
    "timm-mobilenetv3_small_050": lambda: _timm("mobilenetv3_small_050"),
    "timm-efficientnet_b0": lambda: _timm("efficientnet_b0"),
    "torchvision-mobilenet_v3_small": lambda: _torchvision("mobilenet_v3_small"),
}


@pytest.mark.parametrize("name", sorted(LIBRARY_MODELS))
def test_library_models_train_as_eager(name: str) -> None:
    """timm's and torchvision's CNNs (BatchNormAct2d, hardswish, squeeze-excite) train in ORT
    with eager's losses and every buffer eager's after each step (what eval then reads)."""
    torch.manual_seed(0)
    eager = LIBRARY_MODELS[name]()
    wrapped = ortfx.ORTModule(copy.deepcopy(eager), options=STRICT)
    # 64x64 and 4 images: the last stages normalize over 2x2 pixels of 4 images; over 1x1 of 2
    # images the rounding of two equal computations grows past any tolerance.
    inputs = [torch.randn(4, 3, 64, 64) for _ in range(2)]
    for step, x in enumerate(inputs):
        expected, got = _steps(eager, [x], lr=0.01), _steps(wrapped, [x], lr=0.01)
        # Rounding through 20-odd BatchNorms (the statistics' bugs were 10-35 % off).
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-5)
        for (path, a), (_, b) in zip(
            eager.named_buffers(), wrapped.module.named_buffers(), strict=True
        ):
            torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4, msg=_where(path, step))
    assert ortfx.stats(wrapped).fallback_calls == 0


class CheckpointedNorm(nn.Module):
    """A conv + BatchNorm stage run through torch.utils.checkpoint (timm's
    ``set_grad_checkpointing()``): eager's recompute updates the statistics again."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.stage = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            out: torch.Tensor = torch.utils.checkpoint.checkpoint(
                self.stage, x, use_reentrant=False
            )
            return out
        out = self.stage(x)
        return out


def test_checkpointed_batch_norm_updates_once_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under checkpointing ortfx updates BatchNorm statistics once per step, as the model does
    without checkpointing (eager's recompute updates them twice), and says so in one WARNING
    naming the buffers."""
    torch.manual_seed(0)
    wrapped = ortfx.ORTModule(CheckpointedNorm(checkpointed=True), options=STRICT)
    plain = copy.deepcopy(wrapped.module)
    plain.checkpointed = False
    inputs = [torch.randn(4, 3, 6, 6) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        got = _steps(wrapped, inputs)
    torch.testing.assert_close(got, _steps(plain, inputs), rtol=1e-5, atol=1e-6)
    for a, b in zip(plain.buffers(), wrapped.module.buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    said = [r.getMessage() for r in caplog.records if "a second time per step" in r.getMessage()]
    assert len(said) == 1
    assert "stage.1.num_batches_tracked, stage.1.running_mean, stage.1.running_var" in said[0]
