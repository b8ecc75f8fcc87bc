"""Custom torch.autograd.Functions run inside the ORT graph (PythonOp) exactly as in eager mode.

Every test trains a module through ortfx and a deep copy in PyTorch and compares outputs and all
gradients within 1e-6, relative to the largest magnitude once that exceeds 1 (float32: ORT's Gemm
and torch's matmul sum in different orders, 1 ulp at 20 is 1.9e-6), over several steps, and
checks that no ctx is kept after a step.
"""

from __future__ import annotations

import copy
import gc
import logging
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ortfx
from ortfx.runtime import pythonop
from tests.models import max_diff

TOL = 1e-6


def close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Within TOL, relative to the largest magnitude of ``b`` once that exceeds 1."""
    assert b is not None
    return max_diff(a, b) <= TOL * max(1.0, float(b.detach().abs().max()))


STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)


class Scale3Grad(torch.autograd.Function):
    """The issue's example: forward doubles, backward triples (a straight-through style lie)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 3.0


class Around(nn.Module):
    """Linear -> body(h) -> Linear, so that gradients cross the Function both ways."""

    def __init__(self, body: Callable[..., Any], width: int = 4) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, 3)
        self.body = body

    def forward(self, x: torch.Tensor) -> Any:
        out = self.body(self.a(x))
        return self.b(out) if isinstance(out, torch.Tensor) else tuple(self.b(o) for o in out)


def _loss(out: Any) -> torch.Tensor:
    outs = out if isinstance(out, tuple) else (out,)
    return sum(((o * o).sum() for o in outs if o.is_floating_point()), torch.zeros(()))


def train_both(
    model: nn.Module,
    *,
    steps: int = 3,
    options: ortfx.Options = STRICT,
    loss: Callable[[Any], torch.Tensor] = _loss,
    batch: int = 5,
) -> ortfx.ORTModule:
    """Forward+backward ``steps`` times in ortfx and in PyTorch; outputs and grads must match."""
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model, options=options)
    width = model.a.in_features  # type: ignore[union-attr]
    for step in range(steps):
        x = torch.randn(batch, width)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_a, out_b = wrapped(xa), reference(xb)
        flat_a = out_a if isinstance(out_a, tuple) else (out_a,)
        flat_b = out_b if isinstance(out_b, tuple) else (out_b,)
        for oa, ob in zip(flat_a, flat_b, strict=True):
            assert close(oa, ob), ("output", step, max_diff(oa, ob))
        loss(out_a).backward()
        loss(out_b).backward()
        assert pythonop.live_contexts() == 0, "a ctx outlived its backward"
        assert close(xa.grad, xb.grad), ("input grad", step, max_diff(xa.grad, xb.grad))
        for (name, pa), (_, pb) in zip(
            model.named_parameters(), reference.named_parameters(), strict=True
        ):
            assert close(pa.grad, pb.grad), (name, step, max_diff(pa.grad, pb.grad))
    return wrapped


def test_custom_backward_is_used_not_the_traced_one() -> None:
    """Fails on main: there the graph trains with the inlined forward's gradient (2g, not 3g)."""
    model = Around(Scale3Grad.apply)
    wrapped = train_both(model)
    x = torch.ones(1, 4, requires_grad=True)
    Scale3Grad.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((1, 4), 3.0))  # the eager fact the parity rests on
    assert ortfx.stats(wrapped).exports == 1


_INNER = ortfx.ORTModule(nn.Linear(4, 4), options=STRICT)
_SIDE = nn.Linear(4, 4)


class CallsAnORTModule(torch.autograd.Function):
    """A forward that calls an ORTModule (the inner model), with its own backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _INNER(x) * 2.0

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 2.0


class ClosesOverAParameter(torch.autograd.Function):
    """A forward that uses a parameter it is not given (eager: no gradient reaches it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _SIDE(x) + x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


def test_forward_calling_an_ortmodule_runs_it_in_ort() -> None:
    """Export traced the inner model's parameters as constants of the Function's body and
    failed ("Cannot insert a Tensor that requires grad as a constant"). Now the outer graph runs
    the Function as a PythonOp, and the inner model runs in its own ORT session each call."""
    before = ortfx.stats(_INNER)
    wrapped = train_both(Around(CallsAnORTModule.apply), steps=3)
    assert ortfx.stats(wrapped).exports == 1
    inner = ortfx.stats(_INNER)
    assert inner.calls - before.calls == 6  # 3 steps, in ortfx and in the eager reference
    assert inner.fallback_calls == 0 and inner.exports == 1
    assert all(p.grad is None for p in _INNER.parameters())  # forward runs without grad


def test_forward_closing_over_a_parameter() -> None:
    """The class behind the case above: any tensor that requires grad, used in a forward
    without being an input, made the export fail."""
    wrapped = train_both(Around(ClosesOverAParameter.apply), steps=2)
    assert ortfx.stats(wrapped).exports == 1
    assert all(p.grad is None for p in _SIDE.parameters())


def test_a_users_profiler_keeps_running_through_an_export() -> None:
    """The export's profile hook chains to the one the user had set and puts it back."""
    seen: list[str] = []

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            seen.append(frame.f_code.co_name)

    sys.setprofile(profiler)
    gc.disable()  # what follows must not rely on a GC pass
    try:
        wrapped = ortfx.ORTModule(Around(ClosesOverAParameter.apply), options=STRICT)
        wrapped(torch.randn(2, 4))
        assert sys.getprofile() is profiler
        # The output died at once, and the Function's ctx with it: the retried export left
        # no reference cycle (first attempt's exception -> its frames -> the call's outputs).
        assert pythonop.live_contexts() == 0
    finally:
        gc.enable()
        sys.setprofile(None)
    assert "forward" in seen and ortfx.stats(wrapped).exports == 1


def test_non_tensor_arguments_keep_their_python_types() -> None:
    seen: list[tuple[type, ...]] = []

    class Mixed(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx: Any,
            x: torch.Tensor,
            f: float,
            i: int,
            b: bool,
            s: str,
            n: None,
            ints: tuple[int, ...],
            floats: tuple[float, ...],
            mixed: tuple[Any, ...],
        ) -> torch.Tensor:
            seen.append(tuple(map(type, (f, i, b, s, n, ints, floats, mixed))))
            assert (f, i, b, s, n, ints, floats, mixed) == (
                0.5,
                3,
                True,
                "relu",
                None,
                (1, 2),
                (0.25,),
                ("a", 1),
            )
            ctx.f = f
            return (x * f + i).relu() if b and s == "relu" else x

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
            return (g * ctx.f * 5, None, None, None, None, None, None, None, None)

    def body(h: torch.Tensor) -> torch.Tensor:
        return Mixed.apply(h, 0.5, 3, True, "relu", None, (1, 2), (0.25,), ("a", 1))

    train_both(Around(body))
    types = (float, int, bool, str, type(None), tuple, tuple, tuple)
    assert seen and all(s == types for s in seen), seen


@pytest.mark.parametrize("materialize", [True, False])
def test_several_outputs_one_unused(materialize: bool) -> None:
    received: list[bool] = []

    class Split(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ctx.set_materialize_grads(materialize)
            return x * 2, x.exp()

        @staticmethod
        def backward(ctx: Any, ga: torch.Tensor | None, gb: torch.Tensor | None) -> Any:
            received.append(gb is None)
            if gb is not None:
                assert gb.shape == (5, 4) and not gb.any()  # materialized zeros
            return ga * 7 if ga is not None else None

    train_both(Around(lambda h: Split.apply(h)[0]))
    # Eager and ORT both call backward: with zeros when materializing, None otherwise.
    assert received and all(r is (not materialize) for r in received), received


def test_mark_non_differentiable_output() -> None:
    class SortLike(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            index = (x > 0).to(torch.int64)
            ctx.mark_non_differentiable(index)
            ctx.save_for_backward(x)
            return x.abs(), index

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor, g_index: torch.Tensor | None) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return g * x.sign() * 0.5

    def body(h: torch.Tensor) -> torch.Tensor:
        value, index = SortLike.apply(h)
        return value + index.to(value.dtype)

    train_both(Around(body))


def test_save_for_backward_of_inputs_and_outputs() -> None:
    class ExpTimes(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            y = x.exp() * w
            ctx.save_for_backward(x, w, y)
            return y

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x, _w, y = ctx.saved_tensors
            return g * y * 1.5, (g * x.exp()).sum(0) * 0.5

    class Model(Around):
        def __init__(self) -> None:
            super().__init__(lambda h: h)
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x: torch.Tensor) -> Any:
            return self.b(ExpTimes.apply(self.a(x), self.w))

    train_both(Model())


def test_mark_dirty_in_place_on_every_call() -> None:
    class AddOneInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            x.add_(1.0)
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 4.0

    def body(h: torch.Tensor) -> torch.Tensor:
        h = h * 1.0  # in place on an intermediate, as eager allows
        y = AddOneInPlace.apply(h)
        return y + h  # h is y now: both see the update

    train_both(Around(body), steps=4)


def test_outputs_aliasing_inputs() -> None:
    class PassThrough(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x.view(-1)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor, g_flat: torch.Tensor) -> torch.Tensor:
            return g * 2 + g_flat.view(g.shape) * 3

    def body(h: torch.Tensor) -> torch.Tensor:
        same, flat = PassThrough.apply(h)
        return same * flat.view(same.shape) + h

    train_both(Around(body))


def test_same_function_twice_in_one_graph() -> None:
    train_both(Around(lambda h: Scale3Grad.apply(Scale3Grad.apply(h).tanh())))


def _scaled(factor: float) -> type[torch.autograd.Function]:
    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * factor

    return Scaled


def test_same_name_in_two_scopes_runs_the_right_class() -> None:
    two, five = _scaled(2.0), _scaled(5.0)
    assert two.__qualname__ == five.__qualname__ and two is not five
    train_both(Around(lambda h: two.apply(h) + five.apply(h * 3)))
    train_both(Around(five.apply))


def test_eval_and_no_grad_never_call_backward() -> None:
    calls: list[str] = []

    class Counted(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            calls.append("forward")
            return x * 3

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            calls.append("backward")
            return g

    torch.manual_seed(0)
    model = Around(Counted.apply)
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model, options=STRICT)
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert close(wrapped(x), reference(x))
    wrapped.eval()
    reference.eval()
    assert close(wrapped(x), reference(x))
    assert "backward" not in calls and "forward" in calls
    assert pythonop.live_contexts() == 0


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_python_exception_reaches_the_user_and_the_wrapper_stays_usable(where: str) -> None:
    fail = [False]  # the first call (export and a clean step) succeeds

    class Fragile(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            if where == "forward" and fail[0]:
                raise KeyError("no such head: 7")
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            if where == "backward" and fail[0]:
                raise ValueError("gradient went NaN in layer 3")
            return g * 3

    model = Around(Fragile.apply)
    wrapped = ortfx.ORTModule(model, options=STRICT)
    x = torch.randn(5, 4)
    wrapped(x).sum().backward()
    fail[0] = True
    expected = (KeyError, "no such head: 7") if where == "forward" else (ValueError, "layer 3")
    with pytest.raises(expected[0], match=expected[1]):
        wrapped(x).sum().backward()
    assert pythonop.live_contexts() == 0
    fail[0] = False
    model.zero_grad(set_to_none=True)
    train_both(model)  # the same (model, Function) trains fine afterwards
    wrapped(x).sum().backward()
    assert pythonop.live_contexts() == 0


def test_a_thousand_steps_keep_no_context() -> None:
    model = Around(lambda h: Scale3Grad.apply(h).sin())
    wrapped = ortfx.ORTModule(model, options=STRICT)
    x = torch.randn(5, 4)
    for _ in range(1000):
        wrapped(x).sum().backward()
        assert pythonop.live_contexts() == 0
    assert ortfx.stats(wrapped).exports == 1


def test_turned_off_raises_naming_the_function() -> None:
    off = ortfx.Options(
        enable_custom_autograd_function=False, fallback_policy=ortfx.FallbackPolicy.DISABLE
    )
    wrapped = ortfx.ORTModule(Around(Scale3Grad.apply), options=off)
    with pytest.raises(ortfx.OrtfxExportError, match=r"tests\.test_pythonop\.Scale3Grad.*off"):
        wrapped(torch.randn(2, 4))
    env = ortfx.Options.from_env(environ={"ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": "0"})
    assert env.enable_custom_autograd_function is False


def test_turned_off_falls_back_to_pytorch_when_the_policy_allows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Default policy: PyTorch runs the module, so the custom backward is still honoured."""
    off = ortfx.Options(enable_custom_autograd_function=False)
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        train_both(Around(Scale3Grad.apply), options=off, steps=2)
    logged = [r.getMessage() for r in caplog.records if r.name == "ortfx"]
    assert len(logged) == 1 and "falling back to PyTorch" in logged[0], logged
    assert "tests.test_pythonop.Scale3Grad" in logged[0]


def test_dynamo_exporter_switches_to_torchscript_for_custom_functions() -> None:
    import onnxscript  # noqa: F401  # a test extra: fail, never skip

    options = ortfx.Options(exporter="dynamo", fallback_policy=ortfx.FallbackPolicy.DISABLE)
    train_both(Around(Scale3Grad.apply), options=options)


def test_interpreter_exits_cleanly_after_pythonop_runs() -> None:
    code = textwrap.dedent(
        """
        import torch, ortfx
        from tests.test_pythonop import Around, Scale3Grad, STRICT
        wrapped = ortfx.ORTModule(Around(Scale3Grad.apply), options=STRICT)
        out = wrapped(torch.randn(5, 4))
        out.sum().backward()
        kept = wrapped(torch.randn(5, 4))  # a forward whose backward never runs
        print("done")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=240
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.strip().endswith("done")


def test_without_the_bridge_import_works_and_the_model_gets_a_typed_error() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["ortfx._bridge"] = None  # as if the extension failed to build
        import torch, ortfx
        from tests.test_pythonop import Around, Scale3Grad, STRICT
        wrapped = ortfx.ORTModule(Around(Scale3Grad.apply), options=STRICT)
        try:
            wrapped(torch.randn(5, 4)).sum().backward()
        except ortfx.OrtfxInitError as e:
            print(str(e))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=240
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tests.test_pythonop.Scale3Grad" in result.stdout
    assert "ortfx._bridge" in result.stdout and "enable_custom_autograd_function" in result.stdout


def test_runners_in_unsafe_mode_follow_orts_reference_rules() -> None:
    """ORT's unsafe mode calls ``forward(ctx, ...)`` directly; it must own the only ctx reference.

    Driven through the runners as the bridge calls them (ORT only picks this mode on request).
    """
    from torch.utils.dlpack import from_dlpack, to_dlpack  # type: ignore[attr-defined]

    class SaveAndScale(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, k: float) -> torch.Tensor:
            ctx.save_for_backward(x)
            ctx.k = k
            return x * k

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
            (x,) = ctx.saved_tensors
            return g * x * ctx.k, None

    x = torch.randn(3, 2)
    # requires_grad, tensor_flags, is_training, inplace_map, invoke id, safe_run_mode
    flags = ([1, 0], [1, 0], True, [-1, -1], "unsafe-test", False)
    with pythonop.training_run():
        result = pythonop.forward_runner(
            "f", SaveAndScale.forward, *flags, (to_dlpack(x.clone()), 0.5)
        )
    ctx, capsule = result
    assert sys.getrefcount(ctx) == 3  # result list + local + getrefcount's argument
    assert sys.getrefcount(capsule) == 3
    assert torch.equal(from_dlpack(capsule), x * 0.5)
    del result, capsule
    g = torch.randn(3, 2)
    grads = pythonop.backward_runner(
        "f", SaveAndScale.backward, *flags, (ctx, to_dlpack(g.clone()))
    )
    assert torch.equal(from_dlpack(grads[0]), g * x * 0.5) and grads[1] is None
    assert pythonop.live_contexts() == 0


PYTHONOP_THREADS = """
import faulthandler; faulthandler.dump_traceback_later(120, exit=True)
import threading, torch, ortfx, copy, warnings
from torch import nn
warnings.simplefilter("ignore")
S = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
class Scale3(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x): return x * 2.0
    @staticmethod
    def backward(ctx, g): return g * 3.0
class M(nn.Module):
    def __init__(s): super().__init__(); s.a = nn.Linear(8, 8); s.b = nn.Linear(8, 2)
    def forward(s, x): return s.b(Scale3.apply(s.a(x)))
errors = []
def run(i):
    try:
        torch.manual_seed(i)
        m = M(); w = ortfx.ORTModule(copy.deepcopy(m), options=S)
        for _ in range(20):
            x = torch.randn(3, 8)
            w(x).sum().backward(); m(x).sum().backward()
            d = (w.module.a.weight.grad - m.a.weight.grad).abs().max().item()
            assert d < 1e-5, d
    except BaseException as e: errors.append(repr(e))
ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
print("errors", errors)
"""


def test_pythonop_graphs_from_several_threads_neither_deadlock_nor_mix_contexts() -> None:
    """Four threads, each training its own wrapper with a custom Function, 20 steps: runs of
    graphs with PythonOps are serialized (two at once deadlocked on the GIL and ORT's lock), and
    contexts are keyed so a late release never drops another thread's (ids are reused)."""
    result = subprocess.run(
        [sys.executable, "-c", PYTHONOP_THREADS], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "errors []"
