"""Transitions end to end, counted with ortfx.stats and explained with ortfx.explain."""

from __future__ import annotations

import copy
import inspect
import logging
import warnings
from typing import Any

import attrs
import pytest
import torch
from torch import nn

import ortfx
from tests import models
from tests.models import max_diff


class Switchy(nn.Module):
    """Python control flow on static arguments: each value needs its own graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(
        self,
        x: torch.Tensor,
        flag: Any = True,
        n: Any = 1,
        scale: Any = 1.0,
        mode: Any = "a",
        extra: Any = None,
    ) -> torch.Tensor:
        y = self.lin(x)
        y = torch.relu(y) if flag else torch.tanh(y)
        for _ in range(n):
            y = y * scale
        if mode == "b":
            y = y + 1
        if extra is not None:
            y = y + extra
        return y


X = torch.randn(3, 4)


@pytest.mark.parametrize(
    ("first", "second", "reason"),
    [
        (
            {"flag": True},
            {"flag": False},
            "kwargs['flag'] was True, now False (a static bool value changed)",
        ),
        ({"n": 1}, {"n": 2}, "kwargs['n'] was 1, now 2 (a static int value changed)"),
        (
            {"scale": 1.0},
            {"scale": 0.5},
            "kwargs['scale'] was 1.0, now 0.5 (a static float value changed)",
        ),
        (
            {"mode": "a"},
            {"mode": "b"},
            "kwargs['mode'] was 'a', now 'b' (a static str value changed)",
        ),
        (
            {"extra": None},
            {"extra": torch.ones(3, 4)},
            "kwargs['extra'] was None, now float32[?, ?] (None became a tensor)",
        ),
        (
            {"extra": torch.ones(3, 4)},
            {"extra": None},
            "kwargs['extra'] was float32[?, ?], now None (a tensor became None)",
        ),
        (
            {"extra": torch.ones(3, 4)},
            {"extra": torch.ones(4)},
            "kwargs['extra'] was float32[?, ?], now float32[?] (a tensor's rank changed)",
        ),
    ],
)
def test_static_and_structural_changes_reexport_once_with_pytorch_result(
    first: dict[str, Any], second: dict[str, Any], reason: str
) -> None:
    torch.manual_seed(0)
    model = Switchy()
    wrapped = ortfx.ORTModule(model)
    for kwargs in (first, second, second):
        out = wrapped(X, **kwargs)
        assert max_diff(out, model(X, **kwargs)) <= 1e-6
    assert ortfx.stats(wrapped).exports == 2
    assert str(ortfx.explain(wrapped)[-1]) == "re-export: " + reason


def test_dtype_change_reexports() -> None:
    # Without grad: ORT 1.19's CPU provider has no float64 ReluGrad kernel.
    model = Switchy().double()
    wrapped = ortfx.ORTModule(model)
    with torch.no_grad():
        wrapped(X.double(), extra=torch.ones(3, 4, dtype=torch.float64))
        out = wrapped(X.double(), extra=torch.ones(3, 4, dtype=torch.float32))
        assert out.dtype == torch.float64
        assert max_diff(out, model(X.double(), extra=torch.ones(3, 4))) <= 1e-12
    assert str(ortfx.explain(wrapped)[-1]) == (
        "re-export: kwargs['extra'] was float64[?, ?], now float32[?, ?] (a tensor's dtype changed)"
    )


def test_input_requires_grad_flip_reprocesses_and_fills_grad() -> None:
    wrapped = ortfx.ORTModule(Switchy())
    wrapped(X).sum().backward()
    x = X.clone().requires_grad_()
    wrapped(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    s = ortfx.stats(wrapped)
    assert (s.exports, s.reprocesses) == (1, 1)
    assert str(ortfx.explain(wrapped)[-1]) == (
        "re-process: args[0] was requires_grad=False, now requires_grad=True "
        "(an input's requires_grad changed)"
    )


def test_parameter_requires_grad_flip_reprocesses() -> None:
    model = Switchy()
    wrapped = ortfx.ORTModule(model)
    wrapped(X).sum().backward()
    model.lin.bias.requires_grad_(False)
    model.zero_grad(set_to_none=True)
    wrapped(X).sum().backward()
    assert model.lin.bias.grad is None and model.lin.weight.grad is not None
    s = ortfx.stats(wrapped)
    assert (s.exports, s.reprocesses) == (1, 1)
    assert "parameter 'lin.bias' was requires_grad=True, now requires_grad=False" in str(
        ortfx.explain(wrapped)[-1]
    )


def test_deterministic_algorithms_toggle_makes_only_a_new_session() -> None:
    wrapped = ortfx.ORTModule(Switchy())
    wrapped(X).sum().backward()
    try:
        torch.use_deterministic_algorithms(True)
        wrapped(X).sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    s = ortfx.stats(wrapped)
    assert (s.exports, s.reprocesses, s.sessions) == (1, 0, 2)
    assert str(ortfx.explain(wrapped)[-1]) == (
        "new session: deterministic algorithms was off, now on "
        "(torch.use_deterministic_algorithms changed)"
    )


def test_train_eval_switching_exports_each_mode_once() -> None:
    wrapped = ortfx.ORTModule(models.GPTBlock(dropout=0.1))
    x = torch.randn(2, 5, 32)
    for _ in range(3):
        wrapped.train()
        wrapped(x).sum().backward()
        wrapped.eval()
        with torch.no_grad():
            wrapped(x)
    assert ortfx.stats(wrapped).exports == 2
    assert [t.kind for t in ortfx.explain(wrapped)] == ["export", "re-export"]


def test_returning_to_an_earlier_schema_hits_the_cache() -> None:
    wrapped = ortfx.ORTModule(Switchy())
    for flag in (True, False, True, False):
        wrapped(X, flag=flag)
    s = ortfx.stats(wrapped)
    assert (s.exports, s.cache_hits, s.calls) == (2, 2, 4)


def test_no_grad_in_train_mode_keeps_dropout_on() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5))
    wrapped = ortfx.ORTModule(model)
    x = torch.ones(8, 64)
    with torch.no_grad():
        out = wrapped(x)
    zeros = float((out == 0).float().mean())
    assert 0.3 < zeros < 0.7  # dropout active: about half the activations are zeroed
    wrapped.eval()
    with torch.no_grad():
        assert max_diff(wrapped(x), model(x)) <= 1e-6


def _dropout_losses() -> list[float]:
    torch.manual_seed(1234)
    model = models.TinyGPT(dropout=0.2)
    wrapped = ortfx.ORTModule(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    losses = []
    for _ in range(4):
        ids = torch.randint(0, 64, (2, 8))
        opt.zero_grad()
        loss = wrapped(ids, ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_same_seed_gives_same_losses_with_dropout() -> None:
    first, second = _dropout_losses(), _dropout_losses()
    assert first == second
    assert len(set(first)) == 4


def test_repeated_reexports_of_one_argument_warn_once_naming_the_option() -> None:
    wrapped = ortfx.ORTModule(Switchy())
    with pytest.warns(ortfx.OrtfxWarning) as record:
        for n in range(1, 7):
            wrapped(X, n=n)
    assert len(record) == 1
    assert str(record[0].message).startswith(
        "kwargs['n'] forced 3 re-exports in a row because its static value keeps changing"
    )
    assert "Options(dynamic_scalars=(\"kwargs['n']\",))" in str(record[0].message)


def test_dynamic_scalars_feed_a_float_as_tensor_without_reexport() -> None:
    model = Switchy()
    wrapped = ortfx.ORTModule(model, options=ortfx.Options(dynamic_scalars=("kwargs['scale']",)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        for scale in (0.5, 2.0, 3.0):
            assert max_diff(wrapped(X, scale=scale), model(X, scale=scale)) <= 1e-6
    assert ortfx.stats(wrapped).exports == 1


def test_attribute_set_through_wrapper_reexports() -> None:
    model = models.GPTBlock()
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(1, 4, 32)
    wrapped(x)
    wrapped.n_head = 2
    assert model.n_head == 2
    assert max_diff(wrapped(x), model(x)) <= 1e-6
    assert str(ortfx.explain(wrapped)[-1]) == (
        "re-export: module was version 0, now version 1 "
        "(attribute 'n_head' of GPTBlock set outside the wrapper)"
    )
    # A plain value no graph reads (a training loop's bookkeeping), or the same value again:
    # compared on the next call like any attribute, no export.
    wrapped._stage = "train"
    wrapped.n_head = 2
    wrapped(x)
    wrapped._stage = "validate"
    wrapped(x)
    assert ortfx.stats(wrapped).exports == 2


def test_inner_parameter_replacement_is_detected() -> None:
    model = Switchy()
    wrapped = ortfx.ORTModule(model)
    wrapped(X)
    model.lin = nn.Linear(4, 4)  # bypasses the wrapper; the registration hook sees it
    assert max_diff(wrapped(X), model(X)) <= 1e-6
    assert "'lin' of Switchy set to a Linear" in str(ortfx.explain(wrapped)[-1])


class CountsCalls(nn.Module):
    """A flag read by the forward, and a counter the forward itself sets."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gate = False
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.seen + 1  # the forward's own write: no reason to export again
        y = self.lin(x)
        return y.sigmoid() * y if self.gate else y


def test_inner_plain_attribute_change_reexports() -> None:
    """A public plain attribute set on any module of the tree, outside the wrapper, is seen:
    the next call exports again and says why. Setting the same value again, a private name,
    ``train()``/``eval()`` and the forward's own writes do not export again."""
    model = nn.Sequential(CountsCalls())
    wrapped = ortfx.ORTModule(model)
    for _ in range(3):
        wrapped(X)
    assert ortfx.stats(wrapped).exports == 1
    model[0].gate = True  # the trace read False: PyTorch now gates
    # model(X) runs the forward in eager, whose own write of .seen must not count
    assert max_diff(wrapped(X), model(X)) <= 1e-6
    assert str(ortfx.explain(wrapped)[-1]) == (
        "re-export: module was version 0, now version 1 "
        "(attribute 'gate' of CountsCalls set outside the wrapper)"
    )
    model[0].gate = True  # the same value
    model[0]._note = "bookkeeping"
    model.eval()
    model.train()
    wrapped(X)
    assert ortfx.stats(wrapped).exports == 2
    wrapped.eval()  # eval and train are entries of their own, kept
    wrapped(X)
    wrapped.train()
    wrapped(X)
    assert ortfx.stats(wrapped).exports == 3
    model[0].n_head = 2  # even a new attribute: the forward may read it with getattr
    wrapped(X)
    assert ortfx.stats(wrapped).exports == 4


def test_torch_compile_traces_attribute_writes_without_graph_breaks() -> None:
    """The attribute check routes nn.Module.__setattr__ for the whole process: a forward
    compiled by torch.compile that writes attributes must trace as without ortfx."""
    from torch._dynamo.utils import counters  # test-only: dynamo's graph-break counter

    keep = ortfx.ORTModule(nn.Linear(4, 4))
    keep(X)  # a live wrapper: the check is installed
    model = CountsCalls()
    compiled = torch.compile(model)
    counters.clear()
    for _ in range(2):
        assert max_diff(compiled(X), model.lin(X)) <= 1e-6
    assert dict(counters["graph_break"]) == {}
    assert model.seen == 2


def test_hooks_registered_or_removed_after_the_first_call_export_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A forward hook or pre-hook on an inner module, or a global one, registered after the
    first call ran nowhere: ORT ran the graph traced without it. Now each change of the
    tree's hooks exports again (the hook is traced in, as one present at the first call),
    with outputs as eager's; hooks on modules outside the tree change nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(3, 4)
    wrapped(x)
    elsewhere = nn.Linear(4, 4).register_forward_hook(lambda m, i, o: o * 5)
    wrapped(x)
    elsewhere.remove()
    wrapped(x)
    assert ortfx.stats(wrapped).exports == 1
    doubled = model[0].register_forward_hook(lambda m, i, o: o * 2)
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        assert max_diff(wrapped(x), model(x)) <= 1e-6
    # Loud about what a trace cannot keep: the hook's Python side effects.
    assert "forward hooks on '0' (Linear) ran once, while exporting" in caplog.text
    assert str(ortfx.explain(wrapped)[-1]) == (
        "re-export: module was version 0, now version 1 "
        "(hooks of '0' (Linear) changed outside the wrapper)"
    )
    doubled.remove()
    assert max_diff(wrapped(x), model(x)) <= 1e-6
    shifted = model[2].register_forward_pre_hook(lambda m, i: (i[0] + 1,))
    assert max_diff(wrapped(x), model(x)) <= 1e-6
    shifted.remove()
    relu_plus_one = nn.modules.module.register_module_forward_hook(
        lambda m, i, o: o + 1 if isinstance(m, nn.ReLU) else None
    )
    try:
        assert max_diff(wrapped(x), model(x)) <= 1e-6
    finally:
        relu_plus_one.remove()
    assert max_diff(wrapped(x), model(x)) <= 1e-6
    assert ortfx.stats(wrapped).exports == 6


def test_autocast_is_part_of_the_key_and_of_the_fallback_key() -> None:
    """A graph traced without torch.autocast computes in float32; under autocast eager
    computes in bfloat16. The call under autocast exports again (ORT has no bfloat16 CPU
    training kernels: it falls back, loudly, with eager's dtype and values), and the calls
    after the autocast region run in ORT again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(4, 8)
    wrapped(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = wrapped(x), model(x)
    assert got.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(got, expected)
    assert str(ortfx.explain(wrapped)[-1]).startswith(
        "fallback: call was run in ONNX Runtime, now run in PyTorch (OrtfxUnsupportedOpError: "
        "ONNX Runtime 1.19 cannot train operator Gemm"
    )
    assert ortfx.stats(wrapped).fallback_calls == 1
    got = wrapped(x)
    assert got.dtype == torch.float32 and max_diff(got, model(x)) <= 1e-6
    assert ortfx.stats(wrapped).fallback_calls == 1  # back in ORT


class CreatesTensors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum(1) + torch.zeros(x.shape[0])  # the default dtype decides


def test_the_default_dtype_is_part_of_the_key() -> None:
    """torch.set_default_dtype(float64) after the first call: eager's result turns float64
    (a tensor the forward creates), the float32 graph must not be reused silently."""
    model = CreatesTensors()
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(2, 4)
    wrapped(x)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        logging.getLogger("ortfx").disabled = True  # ORT cannot train float64: a fallback
        try:
            got, expected = wrapped(x), model(x)
        finally:
            logging.getLogger("ortfx").disabled = False
    finally:
        torch.set_default_dtype(previous)
    assert got.dtype == expected.dtype == torch.float64
    assert max_diff(got, expected) <= 1e-6
    assert ortfx.stats(wrapped).fallback_calls == 1
    assert wrapped(x).dtype == torch.float32  # back in ORT
    assert ortfx.stats(wrapped).fallback_calls == 1


def test_attributes_the_forward_sets_while_exporting_are_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A forward that keeps Python state (a call counter) runs its Python once, while
    exporting: later calls run the graph. Never silent: the export's WARNING names the
    attribute; a forward without such writes gets none."""
    model = nn.Sequential(CountsCalls())
    wrapped = ortfx.ORTModule(model)
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        for _ in range(3):
            wrapped(X)
    assert model[0].seen == 1  # as the WARNING says: set by the exporting call only
    warnings_ = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings_ == [
        "the forward sets attribute 'seen' of CountsCalls while exporting: ONNX Runtime runs "
        "the exported graph, not the forward's Python, so later calls leave these attributes "
        "as the exporting call set them. Keep such state in a buffer (register_buffer, updated "
        "in place: ortfx writes it back on every call), return it as an output, or run this "
        "module in PyTorch."
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        ortfx.ORTModule(Switchy())(X)
    assert not caplog.records


class FillsContainers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.acts: list[torch.Tensor] = []
        self.stats: dict[str, torch.Tensor] = {}
        self.seen_shapes: set[tuple[int, ...]] = set()

    def forward(self, x: torch.Tensor, feats: list[torch.Tensor]) -> torch.Tensor:
        h = self.lin(x)
        self.acts.append(h.detach())
        self.stats["mean"] = h.mean().detach()
        self.seen_shapes.add(tuple(x.shape))
        feats.append(h.detach())
        return torch.relu(h)


def test_containers_the_forward_fills_while_exporting_are_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A forward that appends to a list, sets a dict item or adds to a set (its own, or an
    argument) runs that Python once, while exporting: no later call fills them, which was
    silent. The export's WARNING names them, the trace's own filling is undone (a call
    through ortfx never fills them), the outputs match eager (1e-6); a forward that only
    reads containers gets no warning."""
    model = FillsContainers()
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model)
    feats: list[torch.Tensor] = []
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        for _ in range(3):
            assert max_diff(wrapped(X, feats), reference(X, [])) <= 1e-6
    assert (model.acts, model.stats, model.seen_shapes, feats) == ([], {}, set(), [])
    warnings_ = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings_ == [
        "the forward changes the contents of 'acts' of FillsContainers, 'stats' of "
        "FillsContainers, 'seen_shapes' of FillsContainers, its arguments (a list, dict or "
        "set: appended to, items set) while exporting: ONNX Runtime runs the exported graph, "
        "not the forward's Python, so no call through ortfx changes them (the export's own "
        "change is undone). Return such values as outputs, or run this module in PyTorch."
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        ortfx.ORTModule(Switchy())(X)
    assert not caplog.records


class AsksIfTraced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if torch.jit.is_tracing():  # a "trace-friendly" branch that computes something else
            return y.clamp(-0.1, 0.1)
        return y


def test_a_forward_asking_whether_it_is_traced_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ortfx's export traces the forward, so a branch on torch.jit.is_tracing() is baked as
    the traced one, which no eager call takes: the export's WARNING names the line (it was
    silent; libraries' own queries, such as transformers' traceable paths, are not named)."""
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        ortfx.ORTModule(AsksIfTraced())(X)
    line = AsksIfTraced.forward.__code__.co_firstlineno + 2
    warnings_ = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings_ == [
        f"the forward asks whether it is traced (is_tracing() at test_transitions_e2e.py:{line}): "
        "ortfx's export traces it, so the graph holds the branch taken while traced, which no "
        "eager call takes. Make both branches compute the same values, or run this module in "
        "PyTorch."
    ]


def test_invalidate_forces_a_reexport() -> None:
    model = nn.Sequential(models.GPTBlock())
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(1, 4, 32)
    wrapped(x)
    model[0]._n_head_hidden = 2  # private names are not watched: invalidate() covers them
    ortfx.invalidate(wrapped)
    assert max_diff(wrapped(x), model(x)) <= 1e-6
    assert ortfx.stats(wrapped).exports == 2


def test_failed_call_is_counted_and_changes_nothing_else() -> None:
    strict = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
    wrapped = ortfx.ORTModule(Switchy(), options=strict)
    wrapped(X)
    before = copy.copy(ortfx.stats(wrapped))
    with pytest.raises(ortfx.OrtfxIOError):
        wrapped(X, extra=object())
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        wrapped(X, bogus=1)
    after = ortfx.stats(wrapped)
    assert after == attrs.evolve(before, calls=before.calls + 2, failed_calls=2)
    assert len(ortfx.explain(wrapped)) == 1  # no transition from the failed calls
    wrapped(X)  # and the good call after them reuses the graph
    assert ortfx.stats(wrapped).exports == 1 and ortfx.stats(wrapped).fast_hits == 1


class Attention(nn.Module):
    """nn.MultiheadAttention: the TorchScript exporter bakes batch and sequence sizes in."""

    def __init__(self) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.att(x, x, x, need_weights=False)[0]


def test_graph_that_cannot_run_a_new_shape_switches_to_dynamo_with_an_explanation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = Attention()
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model)
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        for shape in [(2, 5, 16), (3, 7, 16), (2, 5, 16)]:
            x = torch.randn(*shape)
            model.zero_grad()
            reference.zero_grad()
            a, b = wrapped(x), reference(x)
            assert max_diff(a, b) <= 1e-5
            a.sum().backward()
            b.sum().backward()
            for pa, pb in zip(model.parameters(), reference.parameters(), strict=True):
                assert max_diff(pa.grad, pb.grad) <= 5e-5  # sums over up to 21 positions
    assert [str(t) for t in ortfx.explain(wrapped)] == [
        "export: module was never exported, now called (first call)",
        "re-export: option exporter was 'torchscript', now 'dynamo' (an export option changed)",
    ]
    message = caplog.records[0].getMessage()
    assert message.startswith(
        "the torchscript graph cannot run these input sizes (ONNX Runtime failed"
    )
    assert message.endswith(
        "switching this module to the dynamo exporter, which keeps sizes symbolic"
    )


def test_eval_on_the_inner_module_takes_effect() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5))
    wrapped = ortfx.ORTModule(model)
    x = torch.ones(4, 16)
    with torch.no_grad():
        wrapped(x)
        model.eval()  # directly on the user's module, not through the wrapper
        assert max_diff(wrapped(x), model(x)) <= 1e-6
    assert "mode was train, now eval" in str(ortfx.explain(wrapped)[-1])


class CastsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.to(self.lin.weight.dtype))


def test_dtype_change_on_an_inner_module_is_named_not_taken_for_a_shape_problem() -> None:
    model = CastsInput()
    wrapped = ortfx.ORTModule(model)
    with torch.no_grad():
        wrapped(X)
        model.lin.double()  # bypasses the wrapper: no hook fires for an in-place dtype change
        out = wrapped(X)
    assert out.dtype == torch.float64 and max_diff(out, model(X)) <= 1e-12
    reasons = [str(t) for t in ortfx.explain(wrapped)]
    assert reasons[-1] == (
        "re-export: module was version 0, now version 1 ('lin.weight' changed from "
        "float32[4, 4] to float64[4, 4] outside the wrapper)"
    )
    assert all("dynamo" not in r for r in reasons)


class WithState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("shift", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) + self.shift


@pytest.mark.parametrize("slot", ["a.weight", "b.weight", "b.bias", "shift"])
def test_tensors_replaced_in_their_slot_outside_the_wrapper_are_tracked_again(slot: str) -> None:
    """``module._parameters[name] = p`` / ``module._buffers[name] = t`` fire no hook (as
    accelerate's set_module_tensor_to_device does it): any slot, not only the first
    parameter's, is compared on every call; the new tensor is fed and trained (1e-6)."""
    model = WithState()
    wrapped = ortfx.ORTModule(model)
    wrapped(X).sum().backward()
    owner, _, name = slot.rpartition(".")
    holder = model.get_submodule(owner)
    if name in holder._buffers:
        holder._buffers[name] = torch.full((4,), 3.0)  # no hook fires
    else:
        holder._parameters[name] = nn.Parameter(torch.full_like(getattr(holder, name), 0.5))
    model.zero_grad()
    out = wrapped(X)
    out.sum().backward()
    expected = copy.deepcopy(model)
    expected.zero_grad()
    reference = expected(X)
    reference.sum().backward()
    assert max_diff(out, reference) <= 1e-6
    for (path, p), q in zip(model.named_parameters(), expected.parameters(), strict=True):
        assert p.grad is not None and max_diff(p.grad, q.grad) <= 1e-6, path
    assert f"{slot!r} was replaced outside the wrapper" in str(ortfx.explain(wrapped)[-1])


def test_sessions_count_real_sessions() -> None:
    wrapped = ortfx.ORTModule(Switchy())
    wrapped(X).sum().backward()
    with torch.no_grad():  # same graph, run without gradients: an inference session
        wrapped(X)
    wrapped(X).sum().backward()
    s = ortfx.stats(wrapped)
    assert (s.exports, s.sessions, s.calls) == (1, 2, 3)


def test_configure_cache_size_shrinks_the_cache() -> None:
    wrapped = ortfx.ORTModule(Switchy())
    for flag in (True, False):
        wrapped(X, flag=flag)
    ortfx.configure(wrapped, cache_size=1)
    wrapped(X, flag=True)
    assert ortfx.stats(wrapped).exports == 3


def test_register_buffer_through_the_wrapper_bumps_the_version_once() -> None:
    wrapped = ortfx.ORTModule(Switchy())
    wrapped(X)
    wrapped.register_buffer("extra", torch.ones(1))
    wrapped(X)
    assert [str(t) for t in ortfx.explain(wrapped)][1:] == [
        "re-export: module was version 0, now version 1 (buffer 'extra' registered through the wrapper)"
    ]


def test_repeated_reexport_warning_points_at_the_callers_line() -> None:
    wrapped = ortfx.ORTModule(Switchy())
    with pytest.warns(ortfx.OrtfxWarning) as record:
        for n in range(1, 5):
            wrapped(X, n=n)
    assert record[0].filename == __file__


def test_dynamic_scalar_used_in_python_control_flow_becomes_static(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = Switchy()
    wrapped = ortfx.ORTModule(model, options=ortfx.Options(dynamic_scalars=("kwargs['n']",)))
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        for n in (2, 3):  # range(n) bakes n in: a graph fed n as a tensor would be wrong
            assert max_diff(wrapped(X, n=n), model(X, n=n)) <= 1e-6
    said = [r.getMessage() for r in caplog.records if r.name == "ortfx"]
    line = inspect.getsourcelines(Switchy.forward)[1] + 11  # for _ in range(n)
    assert said == [
        "the trace took 1 Python value(s) from tensors (a branch on them, a number computed "
        "from them), which the graph holds as constants: index at "
        f"test_transitions_e2e.py:{line} (tensor values) = 2. ortfx checks each after every "
        "run, and a call that gives another value is computed again with a graph for that "
        "value (said once per graph)",
        "kwargs['n'] is in dynamic_scalars, but the exported graph does not read it as a tensor: "
        "the module turns the value into a Python value (e.g. range(n), if n > 0), which the "
        "tracer bakes in. ortfx treats it as static from now on; remove it from "
        "Options.dynamic_scalars",
    ]


def test_fast_path_keeps_values_python_calls_equal_apart() -> None:
    """The steady-state fast path must split what the schema splits: True vs 1, 0.0 vs -0.0."""
    wrapped = ortfx.ORTModule(Switchy())
    for n in (1, True, 1, True):
        wrapped(X, n=n)
    for scale in (0.0, -0.0, 0.0):
        wrapped(X, scale=scale)
    s = ortfx.stats(wrapped)
    assert (s.exports, s.calls) == (4, 7)
    assert str(ortfx.explain(wrapped)[1]) == (
        "re-export: kwargs['n'] was 1, now True (a static value changed type)"
    )


def test_export_leaves_python_numpy_and_torch_random_streams_untouched() -> None:
    import random

    import numpy as np

    model = models.GPTBlock(dropout=0.3)  # the traced forward draws dropout masks
    wrapped = ortfx.ORTModule(model)
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    with torch.no_grad():  # train mode: the tracer runs dropout, which draws from torch's RNG
        wrapped(torch.ones(1, 3, 32))
    assert ortfx.stats(wrapped).exports == 1
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(1), expected[2])


def test_steady_calls_take_the_fast_path_without_deciding() -> None:
    from ortfx.runtime import events

    wrapped = ortfx.ORTModule(Switchy())
    with events.recording() as seen:
        for t in (3, 5, 7, 2):  # other sizes, same kind of call
            wrapped(torch.randn(t, 4)).sum().backward()
        assert [name for name, _ in seen].count("decide") == 1  # only the first call decided
        wrapped(X, flag=False)
    assert [name for name, _ in seen].count("decide") == 2  # a different call: slow path again
    s = ortfx.stats(wrapped)
    assert (s.calls, s.fast_hits) == (5, 3)


def test_configure_rejects_unknown_options_and_keeps_state() -> None:
    wrapped = ortfx.ORTModule(Switchy())
    with pytest.raises(
        TypeError, match=r"^ortfx.configure got unknown option\(s\) 'bogus'; valid options are "
    ):
        ortfx.configure(wrapped, bogus=1)
    assert ortfx.options_of(wrapped) == ortfx.Options()


class GradModeBranch(nn.Module):
    """Branches on grad mode, as transformers' checkpointed layers do; grad-mode contexts of
    its own inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("offset", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            shift = self.offset.mean()
        y = self.lin(x) - shift
        return y * 2 if torch.is_grad_enabled() else y - 1


def test_a_branch_on_grad_mode_gets_a_graph_per_mode() -> None:
    """Each grad mode gets the branch PyTorch takes (outputs and gradients equal eager's,
    1e-6), one export per mode, reused when the mode comes back; the transition says why;
    ortfx leaves grad mode as it found it. A module that never asks shares one graph."""
    torch.manual_seed(0)
    eager = GradModeBranch()
    wrapped = ortfx.ORTModule(copy.deepcopy(eager))
    for _ in range(2):
        expected, got = eager(X), wrapped(X)
        assert torch.is_grad_enabled()
        assert torch.allclose(expected, got, atol=1e-6)
        expected.sum().backward()
        got.sum().backward()
        for p, q in zip(eager.parameters(), wrapped.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, atol=1e-6)  # type: ignore[arg-type]
        with torch.no_grad():
            assert torch.allclose(eager(X), wrapped(X), atol=1e-6)
            assert not torch.is_grad_enabled()
    assert ortfx.stats(wrapped).exports == 2
    assert [str(t) for t in ortfx.explain(wrapped)][1] == (
        "re-export: grad mode was enabled, now disabled (the module reads torch.is_grad_enabled())"
    )
    plain = ortfx.ORTModule(nn.Linear(4, 4))
    plain(X).sum().backward()
    with torch.no_grad():
        plain(X)
    assert ortfx.stats(plain).exports == 1
