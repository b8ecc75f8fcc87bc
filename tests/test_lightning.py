"""Lightning drives a LightningModule whose network is wrapped (docs/lightning.md)."""

from __future__ import annotations

import copy
import logging
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

import ortfx


class Regressor(L.LightningModule):  # type: ignore[misc]
    """The docs' recipe; ``wrap``: where the network is wrapped (``None``: never)."""

    def __init__(self, wrap: str | None) -> None:
        super().__init__()
        self.wrap = wrap
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.net: nn.Module = ortfx.ORTModule(net) if wrap == "init" else net
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.wrap == "configure_model" and not isinstance(self.net, ortfx.ORTModule):
            self.net = ortfx.ORTModule(self.net)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(model: Regressor, precision: str) -> Regressor:
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(
            torch.randn(32, 8, generator=generator), torch.randn(32, 1, generator=generator)
        ),
        batch_size=8,
    )
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision=precision,
    )
    trainer.fit(model, data)
    return model


def _state(model: Regressor) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("wrap", ["init", "configure_model"])
def test_lightning_trains_the_wrapped_network_as_eager(wrap: str) -> None:
    """Wrapped in ``__init__`` or ``configure_model``: the network trains in ORT with eager's
    losses, parameters and BatchNorm statistics, under the module's own state-dict keys."""
    eager, wrapped = _fit(Regressor(None), "32-true"), _fit(Regressor(wrap), "32-true")
    assert isinstance(wrapped.net, ortfx.ORTModule)
    torch.testing.assert_close(wrapped.losses, eager.losses, rtol=1e-5, atol=1e-6)
    expected, got = _state(eager), _state(wrapped)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
    stats = ortfx.stats(wrapped.net)
    assert stats.fallback_calls == 0 and stats.calls >= 3


def test_lightning_bf16_mixed_falls_back_loudly(caplog: pytest.LogCaptureFixture) -> None:
    """``precision="bf16-mixed"`` (autocast, which ORT cannot train on CPU): the calls run in
    PyTorch after one WARNING, with eager's losses and statistics; nothing raises."""
    eager = _fit(Regressor(None), "bf16-mixed")
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        wrapped = _fit(Regressor("init"), "bf16-mixed")
    warned = [r for r in caplog.records if r.name == "ortfx" and "falling back" in r.message]
    assert len(warned) == 1
    assert ortfx.stats(wrapped.net).fallback_calls == 3
    torch.testing.assert_close(wrapped.losses, eager.losses)
    for key, value in _state(eager).items():
        torch.testing.assert_close(_state(wrapped)[key], value)


def test_wrapper_state_dict_loads_into_the_plain_module() -> None:
    """Checkpoints of the wrapped LightningModule load into the unwrapped one (same keys)."""
    wrapped = Regressor("init")
    plain = copy.deepcopy(Regressor(None))
    plain.load_state_dict(wrapped.state_dict())
