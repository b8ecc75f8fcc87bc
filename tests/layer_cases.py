"""The standard-layer sweep's cases and its worker (run in a subprocess by test_layer_sweep).

``python -m tests.layer_cases NAME...`` runs each case: a tiny model around one standard layer,
forward and backward through ortfx under ``FALLBACK_DISABLE`` at two input sizes, compared with
eager PyTorch. Before a case it prints ``START name``, after it one ``RESULT`` line with a JSON
record, so that the parent can name the case that killed the process.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import ortfx

TOL = 1e-5

# Input factory: (sizes index) -> the input; the layer sees a float input that requires grad
# unless it is integer (embedding).
Make = Callable[[int], torch.Tensor]


def _image(rank: int, channels: int) -> Make:
    sizes = ((8, 10, 6), (12, 7, 9))

    def make(k: int) -> torch.Tensor:
        return torch.randn(2 + k, channels, *sizes[k][:rank], requires_grad=True)

    return make


def _seq(width: int) -> Make:
    def make(k: int) -> torch.Tensor:
        return torch.randn(2 + k, 5 + 3 * k, width, requires_grad=True)

    return make


def _ids(vocab: int) -> Make:
    def make(k: int) -> torch.Tensor:
        return torch.randint(0, vocab, (2 + k, 5 + 3 * k))

    return make


def _conv(rank: int, c_in: int, c_out: int, *, bias: bool = True) -> nn.Module:
    return (nn.Conv1d, nn.Conv2d, nn.Conv3d)[rank - 1](c_in, c_out, 1, bias=bias)


class _BagOfComputedTable(nn.Module):
    """``F.embedding_bag`` on a table the forward computes: the exported Loop's body reads a
    value from outside it (ORT 1.19's gradient builder aborted the process on it)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(11, 6))
        self.mix = nn.Linear(6, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding_bag(ids, self.mix(self.table), mode="sum")


class _First(nn.Module):
    """Keeps the first output of a layer that returns a tuple (RNNs)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]  # type: ignore[no-any-return]


def _spatial(
    rank: int, layer: nn.Module, channels: int = 4, *, bias: bool = True
) -> tuple[nn.Module, Make]:
    """A 1x1 convolution (so that parameters are trained through the layer), then the layer.

    Before a normalization the convolution has no bias, as usual: the true gradient of such a
    bias is 0, and both PyTorch's and ORT's float32 results are noise of about 1e-4 around it.
    """
    conv = _conv(rank, channels, channels, bias=bias)
    return nn.Sequential(conv, layer), _image(rank, channels)


# name -> builder of (model, input factory)
CASES: dict[str, Callable[[], tuple[nn.Module, Make]]] = {
    # convolutions
    "Conv1d": lambda: _spatial(1, nn.Conv1d(4, 3, 3, padding=1)),
    "Conv1d-grouped": lambda: _spatial(1, nn.Conv1d(4, 4, 5, padding=2, groups=2)),
    "Conv1d-depthwise": lambda: _spatial(1, nn.Conv1d(4, 8, 3, stride=2, groups=4)),
    "Conv2d-depthwise": lambda: _spatial(2, nn.Conv2d(4, 4, 3, padding=1, groups=4)),
    "Conv2d": lambda: _spatial(2, nn.Conv2d(4, 3, 3, stride=2)),
    "Conv3d": lambda: _spatial(3, nn.Conv3d(4, 3, 2)),
    "ConvTranspose1d": lambda: _spatial(1, nn.ConvTranspose1d(4, 3, 3, stride=2)),
    "ConvTranspose2d": lambda: _spatial(2, nn.ConvTranspose2d(4, 3, 3, stride=2)),
    "ConvTranspose3d": lambda: _spatial(3, nn.ConvTranspose3d(4, 3, 2)),
    # pooling
    "MaxPool1d": lambda: _spatial(1, nn.MaxPool1d(2)),
    "MaxPool2d": lambda: _spatial(2, nn.MaxPool2d(2)),
    "MaxPool2d-pad-ceil": lambda: _spatial(2, nn.MaxPool2d(3, 2, padding=1, ceil_mode=True)),
    "MaxPool3d": lambda: _spatial(3, nn.MaxPool3d(2)),
    "AvgPool1d": lambda: _spatial(1, nn.AvgPool1d(2)),
    "AvgPool2d": lambda: _spatial(2, nn.AvgPool2d(2)),
    "AvgPool2d-pad-exclude": lambda: _spatial(
        2, nn.AvgPool2d(3, 2, padding=1, count_include_pad=False)
    ),
    "AvgPool3d": lambda: _spatial(3, nn.AvgPool3d(2)),
    "LPPool1d": lambda: _spatial(1, nn.LPPool1d(2, 2)),
    "LPPool2d": lambda: _spatial(2, nn.LPPool2d(2, 2)),
    "AdaptiveAvgPool1d": lambda: _spatial(1, nn.AdaptiveAvgPool1d(1)),
    "AdaptiveAvgPool2d-global": lambda: _spatial(2, nn.AdaptiveAvgPool2d(1)),
    "AdaptiveAvgPool2d": lambda: _spatial(2, nn.AdaptiveAvgPool2d((2, 3))),
    "AdaptiveAvgPool3d": lambda: _spatial(3, nn.AdaptiveAvgPool3d(1)),
    "AdaptiveMaxPool1d": lambda: _spatial(1, nn.AdaptiveMaxPool1d(1)),
    "AdaptiveMaxPool2d-global": lambda: _spatial(2, nn.AdaptiveMaxPool2d(1)),
    "AdaptiveMaxPool2d": lambda: _spatial(2, nn.AdaptiveMaxPool2d((2, 3))),
    # upsampling, padding, shuffles
    "Upsample-nearest": lambda: _spatial(2, nn.Upsample(scale_factor=2, mode="nearest")),
    "Upsample-bilinear": lambda: _spatial(2, nn.Upsample(scale_factor=2, mode="bilinear")),
    "Upsample-size": lambda: _spatial(2, nn.Upsample(size=(5, 7), mode="nearest")),
    "ZeroPad2d": lambda: _spatial(2, nn.ZeroPad2d((1, 2, 0, 1))),
    "ConstantPad1d": lambda: _spatial(1, nn.ConstantPad1d(2, 0.5)),
    "ReflectionPad2d": lambda: _spatial(2, nn.ReflectionPad2d(1)),
    "ReplicationPad2d": lambda: _spatial(2, nn.ReplicationPad2d(1)),
    "PixelShuffle": lambda: _spatial(2, nn.PixelShuffle(2)),
    "PixelUnshuffle": lambda: (
        nn.Sequential(_conv(2, 4, 4), nn.PixelUnshuffle(2)),
        lambda k: torch.randn(2 + k, 4, 8 + 2 * k, 6 + 4 * k, requires_grad=True),
    ),
    "Flatten-Linear": lambda: (
        nn.Sequential(_conv(2, 4, 4), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)),
        _image(2, 4),
    ),
    # normalization
    "BatchNorm1d": lambda: _spatial(1, nn.BatchNorm1d(4), bias=False),
    "BatchNorm2d": lambda: _spatial(2, nn.BatchNorm2d(4), bias=False),
    "BatchNorm3d": lambda: _spatial(3, nn.BatchNorm3d(4), bias=False),
    "GroupNorm": lambda: _spatial(2, nn.GroupNorm(2, 4), bias=False),
    "InstanceNorm1d": lambda: _spatial(1, nn.InstanceNorm1d(4, affine=True), bias=False),
    "InstanceNorm2d": lambda: _spatial(2, nn.InstanceNorm2d(4), bias=False),
    "LayerNorm": lambda: (nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6)), _seq(6)),
    "LocalResponseNorm": lambda: _spatial(2, nn.LocalResponseNorm(3), bias=False),
    # embeddings
    "Embedding": lambda: (nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 2)), _ids(11)),
    "EmbeddingBag": lambda: (nn.EmbeddingBag(11, 6, mode="mean"), _ids(11)),
    "embedding_bag-computed-table": lambda: (_BagOfComputedTable(), _ids(11)),
    # recurrent
    "RNN": lambda: (_First(nn.RNN(6, 5, batch_first=True)), _seq(6)),
    "LSTM": lambda: (_First(nn.LSTM(6, 5, batch_first=True)), _seq(6)),
    "GRU": lambda: (_First(nn.GRU(6, 5, batch_first=True)), _seq(6)),
    "LSTM-2layer-bidir": lambda: (
        _First(nn.LSTM(6, 5, num_layers=2, bidirectional=True, batch_first=True)),
        _seq(6),
    ),
}


def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    # Relative to the reference's magnitude once it exceeds 1 (sums over many elements).
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def run_case(name: str) -> dict[str, Any]:
    """One case: two input sizes, forward and backward, compared with eager PyTorch."""
    torch.manual_seed(0)
    model, make = CASES[name]()
    eager = copy.deepcopy(model)
    options = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
    wrapped = ortfx.ORTModule(model, options=options)
    worst = 0.0
    try:
        for k in (0, 1, 0):
            x = make(k)
            x_eager = x.detach().clone().requires_grad_(x.requires_grad)
            y = wrapped(x)
            y_eager = eager(x_eager)
            weights = torch.randn_like(y_eager)
            (y * weights).sum().backward()
            (y_eager * weights).sum().backward()
            worst = max(worst, _max_diff(y, y_eager), _max_diff(x.grad, x_eager.grad))
            for (pname, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
                worst = max(worst, _max_diff(p.grad, q.grad))
                del pname
    except ortfx.OrtfxError as error:
        return {"status": "error", "type": type(error).__name__, "message": str(error)}
    except Exception as error:
        return {"status": "untyped", "type": type(error).__name__, "message": str(error)}
    status = "parity" if worst <= TOL else "mismatch"
    return {"status": status, "max_diff": worst, "sessions": ortfx.stats(wrapped).sessions}


class SmallCNN(nn.Module):
    """Conv, BatchNorm, MaxPool2d, AvgPool2d, a global pool and a classifier (a tiny ResNet stem)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, padding=1),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(),
            nn.AvgPool2d(2),
        )
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.stem(x).mean(dim=(2, 3))
        return nn.functional.cross_entropy(self.head(h), y)


def train_cnn(steps: int = 6) -> dict[str, Any]:
    """SGD steps through ortfx and in PyTorch, alternating two image sizes and batch sizes."""
    torch.manual_seed(0)
    model = SmallCNN()
    eager = copy.deepcopy(model)
    options = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
    wrapped = ortfx.ORTModule(model, options=options)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    worst = 0.0
    for step in range(steps):
        n, side = (4, 16) if step % 2 == 0 else (3, 12)
        x, y = torch.randn(n, 3, side, side), torch.randint(0, 5, (n,))
        losses = []
        for net, optimizer in zip((wrapped, eager), optimizers, strict=True):
            optimizer.zero_grad()
            loss = net(x, y)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        worst = max(worst, _max_diff(losses[0], losses[1]))
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            worst = max(worst, _max_diff(p, q))
        for a, b in zip(model.buffers(), eager.buffers(), strict=True):
            worst = max(worst, _max_diff(a.float(), b.float()))
    stats = ortfx.stats(wrapped)
    return {"max_diff": worst, "exports": stats.exports, "sessions": stats.sessions}


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    if names == ["--train-cnn"]:
        print(f"RESULT {json.dumps(train_cnn())}", flush=True)
        return
    for name in names:
        print(f"START {name}", flush=True)
        record = {"case": name, **run_case(name)}
        print(f"RESULT {json.dumps(record)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
