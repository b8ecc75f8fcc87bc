"""Integer and float arithmetic whose exported form differed from PyTorch: floor division,
truncating division, arithmetic shifts, atan2's quadrants, and integer division by zero (which
killed the process in ORT's kernel)."""

from __future__ import annotations

import copy
import itertools
import math
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import onnx
import pytest
import torch
from torch import nn

import ortfx
from ortfx import passes
from tests.test_parity_paths import _strict

FLOATS_X = torch.tensor([-7.5, -7.0, -2.5, -0.5, 0.5, 1.5, 2.5, 7.0, 3.0, -3.0, 0.0, -0.0, 1e30])
FLOATS_Y = torch.tensor([2.0, -2.0, 2.0, 2.0, -2.0, 2.0, 2.0, 3.0, -0.0, 0.0, 3.0, 5.0, 1e-20])
INTS_X = torch.tensor([-7, -7, 7, 7, -1, 0, 5, -5, 9, -9, 3, 4, -(2**40)])
INTS_Y = torch.tensor([2, -2, 2, -2, 3, 3, -3, 3, 4, 4, -1, 1, 3])


class Binary(nn.Module):
    def __init__(self, f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.f = f

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.f(x, y)


OPS: dict[str, Callable[[Any, Any], Any]] = {
    "x // y": lambda x, y: x // y,
    "floor_divide": torch.floor_divide,
    "div floor": lambda x, y: torch.div(x, y, rounding_mode="floor"),
    "div trunc": lambda x, y: torch.div(x, y, rounding_mode="trunc"),
    "x % y": lambda x, y: x % y,
    "fmod": torch.fmod,
    "x / y": lambda x, y: x / y,
}


def _same(expected: torch.Tensor, got: torch.Tensor) -> bool:
    """Equal values (NaN = NaN; -0.0 = 0.0, see docs/index.md) and dtypes."""
    if expected.dtype != got.dtype or expected.shape != got.shape:
        return False
    if not expected.is_floating_point():
        return torch.equal(expected, got)
    return bool(torch.isclose(expected, got, rtol=1e-6, atol=0.0, equal_nan=True).all())


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize(
    ("kind", "x", "y"), [("float", FLOATS_X, FLOATS_Y), ("int", INTS_X, INTS_Y)]
)
@pytest.mark.parametrize("name", list(OPS))
def test_division_matches_pytorch(
    name: str, kind: str, x: torch.Tensor, y: torch.Tensor, mode: str
) -> None:
    """Exact values and dtypes (float quotients within 1e-6 relative). ``//`` used to truncate
    (-7 // 2 gave -3), float trunc division turned inf into -9.2e18, ``1e30 % 1e-20`` gave -inf."""
    module = Binary(OPS[name])
    wrapped = _strict(module)
    getattr(wrapped, mode)()
    assert _same(module(x, y), wrapped(x.clone(), y.clone()))


def test_right_shift_of_signed_integers_is_arithmetic() -> None:
    """``-7 >> 1`` is -4 in torch; the exporter's division gave -3."""
    module = Binary(lambda x, y: (x >> 1) + (x >> y.abs() % 3))
    wrapped = _strict(module)
    assert torch.equal(module(INTS_X, INTS_Y), wrapped(INTS_X, INTS_Y))


def test_atan2_quadrants_zeros_and_infinities() -> None:
    """Every pair of signed zeros, finite values and infinities (values within 1e-6): the
    exporter's form gave -pi for atan2(0, -1), NaN for atan2(0, 0) and atan2(inf, inf)."""
    values = [0.0, -0.0, 1.0, -1.0, 2.5, -3.0, math.inf, -math.inf, math.nan, 1e-30, -1e30]
    pairs = list(itertools.product(values, values))
    y = torch.tensor([p[0] for p in pairs])
    x = torch.tensor([p[1] for p in pairs])
    module = Binary(torch.atan2)
    got = _strict(module)(y, x)
    assert torch.allclose(module(y, x), got, rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("op", [torch.atan2, lambda y, x: torch.atan(y / (x.abs() + 1))])
def test_atan_and_atan2_train(op: Callable[..., torch.Tensor]) -> None:
    """ORT 1.19 has no gradient for ``Atan``: atan and atan2 could not train. ortfx registers
    one (``aten.STANDARD_GRADIENTS``). Both arguments' gradients equal PyTorch's (1e-6), two
    sizes, at points away from atan2's (0, 0)."""
    module = Binary(op)
    wrapped = _strict(module)
    for n in (5, 7):
        y, x = torch.randn(n), torch.randn(n) + 3
        ya, xa = y.clone().requires_grad_(), x.clone().requires_grad_()
        yb, xb = y.clone().requires_grad_(), x.clone().requires_grad_()
        weights = torch.randn(n)
        (module(ya, xa) * weights).sum().backward()
        (wrapped(yb, xb) * weights).sum().backward()
        assert torch.allclose(yb.grad, ya.grad, atol=1e-6)  # type: ignore[arg-type]
        assert torch.allclose(xb.grad, xa.grad, atol=1e-6)  # type: ignore[arg-type]


def test_integer_division_by_zero_raises_like_pytorch_and_does_not_crash() -> None:
    """In a subprocess: ORT's integer kernels divided by zero in C (SIGFPE killed the
    interpreter). Now each of //, %, fmod and div(rounding_mode) by a zero divisor raises
    torch's ``RuntimeError: ZeroDivisionError``, and the next good call still works."""
    script = textwrap.dedent(
        """
        import torch, ortfx
        from torch import nn
        strict = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
        ops = [lambda x, y: x // y, lambda x, y: x % y, torch.fmod,
               lambda x, y: torch.div(x, y, rounding_mode="trunc")]
        class M(nn.Module):
            def __init__(self, f):
                super().__init__()
                self.f = f
            def forward(self, x, y):
                return self.f(x, y)
        for f in ops:
            for mode in ("train", "eval"):
                wrapped = ortfx.ORTModule(M(f), options=strict)
                getattr(wrapped, mode)()
                x, good, zero = torch.tensor([7, -7]), torch.tensor([2, 3]), torch.tensor([2, 0])
                assert torch.equal(wrapped(x, good), f(x, good))
                for call in (lambda: f(x, zero), lambda: wrapped(x, zero)):
                    try:
                        call()
                    except RuntimeError as e:
                        assert str(e) == "ZeroDivisionError", str(e)
                    else:
                        raise AssertionError("no error")
                assert torch.equal(wrapped(x, good), f(x, good))
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


def test_constant_divisors_get_no_guard() -> None:
    """Shape arithmetic (``size // 2``) divides by constants: no guard nodes, so no cost."""
    h = onnx.helper
    i64 = onnx.TensorProto.INT64
    two = h.make_node("Constant", [], ["two"], value=h.make_tensor("t", i64, [], [2]))
    div = h.make_node("Div", ["x", "two"], ["q"])
    graph = h.make_graph(
        [two, div],
        "g",
        [h.make_tensor_value_info("x", i64, [3])],
        [h.make_tensor_value_info("q", i64, [3])],
    )
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    assert not passes.guard_integer_division.edit(proto)  # type: ignore[attr-defined]
    assert [n.op_type for n in proto.graph.node] == ["Constant", "Div"]


class SelfDistances(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        # torch's exact form (it switches to a matrix-product form for 25+ rows)
        return torch.cdist(h, h, p=self.p, compute_mode="donot_use_mm_for_euclid_dist")


@pytest.mark.parametrize("rows", [5, 40])
@pytest.mark.parametrize("p", [1.0, 2.0, 3.0])
def test_cdist_with_coincident_points(p: float, rows: int) -> None:
    """cdist(h, h) with two equal rows: the exporter's forms gave NaN gradients (a root's
    derivative at 0), and NaN values for p = 3. Values equal PyTorch's within 1e-5, gradients
    within 5e-5 (sums of up to 1600 terms that cancel, added in another order); torch's
    gradient at a zero distance is 0."""
    torch.manual_seed(0)
    model = SelfDistances(p)
    wrapped = _strict(copy.deepcopy(model))
    x = torch.randn(rows, 4)
    x[1] = x[0]
    expected, out = model(x), wrapped(x)
    assert torch.allclose(out, expected, atol=1e-5)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    out.backward(grad)
    for a, b in zip(model.parameters(), wrapped.parameters(), strict=True):
        assert torch.isfinite(b.grad).all()  # type: ignore[arg-type]
        assert torch.allclose(a.grad, b.grad, atol=5e-5)  # type: ignore[arg-type]


class Reductions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h.norm(dim=1) + torch.logsumexp(h, 1) + h.norm() + torch.logsumexp(h, (0, 1))


@pytest.mark.parametrize("opset", [12, 17, 18])
def test_norm_and_logsumexp_train(opset: int) -> None:
    """``x.norm(dim=1)`` and ``torch.logsumexp`` failed to build a gradient graph at opset 13+
    (ORT writes an attribute-style Unsqueeze for keepdims=0). Outputs and gradients equal
    PyTorch's (1e-5)."""
    torch.manual_seed(0)
    model = Reductions()
    options = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE, opset_version=opset)
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=options)
    x = torch.randn(4, 3)
    expected, out = model(x), wrapped(x)
    assert torch.allclose(out, expected, atol=1e-5)
    expected.sum().backward()
    out.sum().backward()
    for a, b in zip(model.parameters(), wrapped.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)  # type: ignore[arg-type]
