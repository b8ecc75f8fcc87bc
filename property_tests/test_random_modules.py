"""Random small modules through ortfx against PyTorch: outputs, input and parameter gradients,
buffers after each step, and the caller's inputs. The layers are drawn from the everyday set,
including in-place activations, BatchNorm (train and eval), buffers updated in forward and
in-place changes of the input, so that a whole class of silent differences shows up here first.

Tolerance: 1e-5 absolute (float32, a few chained layers); buffers and outputs alike.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ortfx

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
WIDTH = 6


class CountingEMA(nn.Module):
    """A buffer updated in place and a counter replaced each call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(WIDTH))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema.mul_(0.5).add_(0.5 * x.detach().mean(0))
        self.calls = self.calls + 1
        return x


class ScaleInput(nn.Module):
    """Changes its input in place (only ever first in the stack, on the caller's tensor)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(1.5)


LAYERS = {
    "linear": lambda: nn.Linear(WIDTH, WIDTH),
    "relu_inplace": lambda: nn.ReLU(inplace=True),
    "tanh": nn.Tanh,
    "gelu": nn.GELU,
    "layernorm": lambda: nn.LayerNorm(WIDTH),
    "batchnorm": lambda: nn.BatchNorm1d(WIDTH),
    "batchnorm_cumulative": lambda: nn.BatchNorm1d(WIDTH, momentum=None),
    "ema": CountingEMA,
    "dropout0": lambda: nn.Dropout(0.0),
}


@st.composite
def stacks(draw: st.DrawFn) -> tuple[list[str], bool, bool, bool]:
    names = draw(st.lists(st.sampled_from(sorted(LAYERS)), min_size=1, max_size=4))
    return (
        names,
        draw(st.booleans()),  # the input changed in place first
        draw(st.booleans()),  # the input requires grad
        draw(st.booleans()),  # train (else eval, with grad)
    )


def _build(names: list[str], scale_input: bool) -> nn.Module:
    layers: list[nn.Module] = [ScaleInput()] if scale_input else []
    # A Linear first: an in-place layer on a leaf that requires grad is refused by PyTorch.
    layers += [nn.Linear(WIDTH, WIDTH), *(LAYERS[n]() for n in names)]
    layers.append(nn.Linear(WIDTH, 2))  # something trainable at the end
    return nn.Sequential(*layers)


def _close(a: Any, b: Any, what: str) -> None:
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.dtype == b.dtype, what
        assert (a.double() - b.double()).abs().max().item() <= 1e-5, what


@settings(max_examples=30, deadline=None, derandomize=True)
@given(stacks())
def test_random_modules_match_pytorch(case: tuple[list[str], bool, bool, bool]) -> None:
    """For every drawn stack: two training (or eval-with-grad) steps give PyTorch's outputs,
    gradients, buffers and in-place input changes, under FALLBACK_DISABLE."""
    names, scale_input, input_grad, train = case
    if scale_input and input_grad:
        input_grad = False  # an in-place change of a leaf that requires grad: PyTorch refuses
    torch.manual_seed(0)
    eager = _build(names, scale_input).train(train)
    wrapped = ortfx.ORTModule(copy.deepcopy(eager), options=STRICT)
    logging.getLogger("ortfx").disabled = True  # tracer notes about sizes are expected
    try:
        for step in range(2):
            x = torch.randn(4, WIDTH)
            xe = x.clone().requires_grad_(input_grad)
            xw = x.clone().requires_grad_(input_grad)
            ye, yw = eager(xe), wrapped(xw)
            _close(ye, yw, f"{names} step {step}: output")
            ye.square().sum().backward()
            yw.square().sum().backward()
            _close(xe.detach(), xw.detach(), f"{names}: the caller's input after the call")
            _close(xe.grad, xw.grad, f"{names}: input grad")
            for (n, p), q in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
                _close(p.grad, q.grad, f"{names}: grad of {n}")
            for (n, b), c in zip(eager.named_buffers(), wrapped.buffers(), strict=True):
                _close(b, c, f"{names}: buffer {n} after step {step}")
    finally:
        logging.getLogger("ortfx").disabled = False
    assert ortfx.stats(wrapped).fallback_calls == 0
