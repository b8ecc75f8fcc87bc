"""NaN, ±inf and values exactly at an activation's bounds: outputs and input gradients equal
PyTorch's, except the differences docs/index.md lists, which are pinned here value by value.

The reference is eager PyTorch on one element at a time: torch's own Hardtanh, ReLU6 and shrink
backwards give a different gradient at NaN in vectorized lanes (0) than in the scalar loop
(the incoming gradient), so within one tensor the answer depends on the element's position.
ortfx gives the scalar loop's answer everywhere, as torch's ReLU does."""

from __future__ import annotations

import copy
import math
from typing import Any

import attrs
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import ortfx
from ortfx import passes
from tests.test_parity_paths import STRICT, _strict

# NaN, ±inf, each activation's bounds and kinks, ordinary values.
VALUES = [math.nan, math.inf, -math.inf, 0.0, 6.0, -1.0, 1.0, 0.5, -0.5, 0.1, 20.0, -3.0, 2.5]


class Abs(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs()


class Clamp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(min=-0.5, max=1.0)


class ClampMin(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(min=0.5)


class ClampMax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp_max(x, 1.0)


class ClampTensor(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(min=torch.full_like(x, -0.5))


class ClampTensors(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(torch.full_like(x, -1.0), torch.full_like(x, 6.0))


class ClampTensorMax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x, max=torch.full_like(x, 0.5))


class Maximum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.maximum(x, torch.zeros_like(x))


class InplaceHardtanh(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.hardtanh(x * 1.0, -0.5, 0.5, inplace=True)


# Elementwise layers that train in ORT 1.19, each with the input values where ortfx differs
# from PyTorch (docs/index.md, "Known differences").
ACTIVATIONS: dict[str, tuple[nn.Module, frozenset[float]]] = {
    "ReLU": (nn.ReLU(), frozenset()),
    "ReLU6": (nn.ReLU6(), frozenset()),
    "Hardtanh": (nn.Hardtanh(), frozenset()),
    "Hardtanh(-0.5,0.5)": (nn.Hardtanh(-0.5, 0.5), frozenset()),
    "hardtanh_": (InplaceHardtanh(), frozenset()),
    "clamp": (Clamp(), frozenset()),
    "clamp_min": (ClampMin(), frozenset()),
    "clamp_max": (ClampMax(), frozenset()),
    "clamp(tensor min)": (ClampTensor(), frozenset()),
    "clamp(tensor max)": (ClampTensorMax(), frozenset()),
    "clamp(tensor min, max)": (ClampTensors(), frozenset()),
    "LeakyReLU": (nn.LeakyReLU(0.1), frozenset()),
    "Softshrink": (nn.Softshrink(), frozenset()),
    "Hardshrink": (nn.Hardshrink(), frozenset()),
    "Sigmoid": (nn.Sigmoid(), frozenset()),
    "Tanh": (nn.Tanh(), frozenset()),
    "SiLU": (nn.SiLU(), frozenset()),
    "Softsign": (nn.Softsign(), frozenset()),
    "Tanhshrink": (nn.Tanhshrink(), frozenset()),
    "GELU(tanh)": (nn.GELU(approximate="tanh"), frozenset()),
    # Known differences: ORT's Gelu gives gelu(inf) = inf where torch gives NaN, and its
    # gradients at ±inf are ±inf where torch's are NaN; LogSigmoid's gradient at -inf is NaN
    # in ORT, 1 in torch; Abs and Maximum have gradient NaN at a NaN input in ORT, 0 and the
    # incoming gradient in torch.
    "GELU": (nn.GELU(), frozenset({math.inf, -math.inf})),
    "LogSigmoid": (nn.LogSigmoid(), frozenset({-math.inf})),
    "abs": (Abs(), frozenset({math.nan})),
    "maximum": (Maximum(), frozenset({math.nan})),
}


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ~torch.isclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


def _key(v: float) -> float:
    return math.nan if math.isnan(v) else v


def _values_at(mask: torch.Tensor) -> set[str]:
    return {repr(VALUES[int(i)]) for i in mask.nonzero().flatten()}


def _elementwise(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Eager output and input gradient, computed one element at a time (torch's scalar loop)."""
    outs, grads = [], []
    for v, g in zip(x.flatten(), grad.flatten(), strict=True):
        one = v.reshape(1).clone().requires_grad_()
        out = layer(one)
        out.backward(g.reshape(1))
        assert one.grad is not None
        outs.append(out.detach())
        grads.append(one.grad)
    return torch.cat(outs).reshape(x.shape), torch.cat(grads).reshape(x.shape)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_matches_pytorch_at_nonfinite_and_bounds(name: str) -> None:
    """Output and input gradient per input value (tolerance 1e-5 relative, 1e-6 absolute)."""
    layer, known = ACTIVATIONS[name]
    wrapped = _strict(copy.deepcopy(layer))
    x = torch.tensor(VALUES)
    grad = torch.linspace(0.5, 1.5, len(VALUES))
    oe, ge = _elementwise(layer, x, grad)
    xw = x.clone().requires_grad_()
    ow = wrapped(xw)
    ow.backward(grad)
    assert xw.grad is not None
    differing = _differs(oe, ow) | _differs(ge, xw.grad)
    assert _values_at(differing) == {repr(_key(v)) for v in known}


def test_nan_input_row_gradient_matches_pytorch() -> None:
    """A NaN in one input row of Linear → ReLU → Linear: every input gradient, that row's
    included, equals PyTorch's (1e-6); parameter gradients are NaN at the same places."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU6(), nn.Linear(4, 1))
    wrapped = _strict(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    x[0, 1] = float("nan")
    xe, xw = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager(xe).sum().backward()
    wrapped(xw).sum().backward()
    assert xe.grad is not None and xw.grad is not None
    assert torch.isfinite(xe.grad[0, [0, 2, 3]]).all()
    assert torch.allclose(xe.grad, xw.grad, atol=1e-6, equal_nan=True)
    for p, q in zip(eager.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(torch.isnan(p.grad), torch.isnan(q.grad))  # type: ignore[arg-type]


def test_relu6_at_zero_trains_like_pytorch() -> None:
    """ReLU6 after ReLU (inputs exactly 0, as after any ReLU or zero padding): torch's gradient
    at 0 is 0; ORT's Clip gradient was 1. Parameter gradients equal PyTorch's (1e-6)."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.ReLU6(), nn.Linear(8, 1))
    wrapped = _strict(copy.deepcopy(eager))
    x = torch.randn(16, 8)
    eager(x).sum().backward()
    wrapped(x).sum().backward()
    for p, q in zip(eager.parameters(), wrapped.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, atol=1e-6)


def test_dynamo_exporter_hardtanh_matches_pytorch() -> None:
    """The dynamo exporter's translations give the same bounds and NaN gradients."""
    layer = nn.Sequential(nn.ReLU6(), nn.Hardtanh(-0.5, 0.5), nn.ReLU())
    wrapped = ortfx.ORTModule(copy.deepcopy(layer), options=attrs.evolve(STRICT, exporter="dynamo"))
    x = torch.tensor([VALUES, [0.5, -0.5, 0.0, 6.0, *VALUES[4:]]])
    oe, ge = _elementwise(layer, x, torch.ones_like(x))
    xw = x.clone().requires_grad_()
    ow = wrapped(xw)
    ow.sum().backward()
    assert xw.grad is not None
    assert not _differs(oe, ow).any()
    assert not _differs(ge, xw.grad).any()


def _relu_grad_model(typed: bool) -> onnx.ModelProto:
    h = onnx.helper
    f = onnx.TensorProto.FLOAT
    node = h.make_node("ReluGrad", ["dy", "x"], ["dx"], name="g", domain="com.microsoft")
    io = [h.make_tensor_value_info(n, f, [5]) for n in ("dy", "x", "dx")]
    if not typed:  # no type for any of the node's values: the pass cannot make a typed zero
        io = [h.make_tensor_value_info(n, 0, None) for n in ("dy", "x", "dx")]
    graph = h.make_graph([node], "g", io[:2], io[2:])
    model = h.make_model(
        graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8  # ORT 1.19 reads up to 10
    return model


@pytest.mark.parametrize("typed", [True, False])
def test_relu_grad_pass_is_torchs_threshold_backward(typed: bool) -> None:
    """Both forms of the rewrite (typed zero, or IsNaN repair) equal torch's ReLU backward."""
    model = _relu_grad_model(typed)
    assert passes.relu_grad_passes_nan(model)
    assert any(n.op_type == "ReluGrad" for n in model.graph.node) == (not typed)
    if not typed:  # ORT needs the graph's input and output types
        f = onnx.TensorProto.FLOAT
        for v in [*model.graph.input, *model.graph.output]:
            v.CopyFrom(onnx.helper.make_tensor_value_info(v.name, f, [5]))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = torch.tensor([math.nan, -1.0, 0.0, 2.0, math.inf])
    dy = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    (got,) = session.run(None, {"dy": dy.numpy(), "x": x.numpy()})
    xe = x.clone().requires_grad_()
    torch.relu(xe).backward(dy)
    assert torch.equal(torch.from_numpy(got), xe.grad)


NAN, INF = math.nan, math.inf
# Rows: NaN among numbers, NaN after -inf, finite with ties, two NaNs first.
WITH_NAN = torch.tensor(
    [[1.0, NAN, 3.0, INF], [-INF, 2.0, NAN, 0.0], [1.0, 4.0, 3.0, 4.0], [NAN, NAN, 1.0, 1.0]]
)
REDUCTIONS = {
    "argmax": lambda y: y.argmax(1),
    "argmin": lambda y: y.argmin(-1),
    "argmax_all": lambda y: y.argmax(),
    "max_dim": lambda y: torch.stack([y.max(1).values, y.max(1).indices.float()]),
    "min_dim_keepdim": lambda y: torch.cat([y.min(1, keepdim=True).values, y.min(1, True)[1]], 1),
    "amax": lambda y: y.amax(1),
    "amin": lambda y: y.amin((0, 1)),
    "max_all": lambda y: y.max().reshape(1),
    "min_all": lambda y: y.min().reshape(1),
    "sign": torch.sign,
    "hardswish": nn.functional.hardswish,
}


class Reduced(nn.Module):
    def __init__(self, reduce: Any) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(x * self.scale)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


# ORT 1.19 has no gradient for ReduceMax/ReduceMin or Sign: those train in PyTorch (loudly).
TRAINS = {"argmax", "argmin", "argmax_all", "hardswish"}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_max_like_reductions_propagate_nan_as_pytorch(name: str) -> None:
    """ORT's ReduceMax/Min and ArgMax/Min skip NaN: x.max() of a tensor holding NaN returned
    its largest number, silently. Values and indices equal PyTorch's exactly (NaN, the first
    NaN's index, sign(NaN) = 0, hardswish(-inf) = NaN) without gradients and, for what ORT
    trains, in a training call, whose gradient on finite inputs matches eager (1e-6)."""
    torch.manual_seed(0)
    model = Reduced(REDUCTIONS[name])
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    with torch.no_grad():
        got, expected = wrapped(WITH_NAN), model(WITH_NAN)
        assert _same(got.float(), expected.float()), (got, expected)
        assert _same(wrapped(torch.ones(4, 4)).float(), model(torch.ones(4, 4)).float())
    if name not in TRAINS:
        return
    assert _same(wrapped(WITH_NAN).detach().float(), model(WITH_NAN).detach().float())
    finite = torch.randn(4, 4)
    out, expected = wrapped(finite), model(finite)
    assert _same(out.detach().float(), expected.detach().float())
    if out.requires_grad:
        out.sum().backward()
        expected.sum().backward()
        assert wrapped.scale.grad is not None and model.scale.grad is not None
        assert float((wrapped.scale.grad - model.scale.grad).abs().max()) <= 1e-6
