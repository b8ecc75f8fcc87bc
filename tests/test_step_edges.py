"""The edges of a training step, each against eager PyTorch: in-place copies into buffers,
forwards that return nothing, a second backward through one forward, one bad (sparse) call
among good ones, and the constructor's signature."""

from __future__ import annotations

import copy
import inspect
import logging
import re
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import ortfx
from tests.models import max_diff

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)


@pytest.fixture
def quiet() -> Iterator[None]:
    """The fallbacks' WARNING lines are expected here."""
    log = logging.getLogger("ortfx")
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = False


def _grads_match(wrapped: nn.Module, eager: nn.Module, tol: float = 1e-5) -> None:
    for (name, p), q in zip(wrapped.named_parameters(), eager.parameters(), strict=True):
        assert max_diff(p.grad, q.grad) <= tol, name


def _buffers_match(wrapped: nn.Module, eager: nn.Module, tol: float = 1e-6) -> None:
    for (name, b), c in zip(wrapped.named_buffers(), eager.buffers(), strict=True):
        assert b.dtype == c.dtype, name
        assert max_diff(b, c) <= tol, name


def _twins(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module, nn.Module]:
    """A seeded model, an eager copy of it, and the model wrapped (fallback off)."""
    torch.manual_seed(0)
    model = make()
    return model, copy.deepcopy(model), ortfx.ORTModule(model, options=STRICT)


def _register(module: nn.Module, **buffers: torch.Tensor) -> None:
    for name, value in buffers.items():
        module.register_buffer(name, value)


# ---- the constructor's signature ---------------------------------------------------------------


def test_the_constructor_signature_is_the_documented_one() -> None:
    """help() and IDEs read inspect.signature: the parameters ORTModule takes, not __new__'s
    catch-all."""
    shown = inspect.signature(ortfx.ORTModule)
    assert str(shown).startswith("(module: ")
    assert list(shown.parameters) == ["module", "debug_options", "options"]
    assert shown.parameters["module"].default is inspect.Parameter.empty
    assert shown.parameters["debug_options"].default is None
    assert shown.parameters["options"].kind is inspect.Parameter.KEYWORD_ONLY
    wrapped = ortfx.ORTModule(nn.Linear(2, 2))
    assert inspect.signature(type(wrapped)) == shown  # the per-class subclass too
    assert list(inspect.signature(wrapped.forward).parameters) == ["input"]  # still forward's


# ---- one bad call changes only that call ---------------------------------------------------------


@pytest.mark.usefixtures("quiet")
def test_one_sparse_call_changes_only_that_call() -> None:
    """A sparse input raises OrtfxIOError (DISABLE) or runs in PyTorch (default); the dense
    calls after it run in ORT again (and on the fast path), with eager's values (1e-6)."""
    for policy in (None, ortfx.FallbackPolicy.DISABLE):
        options = ortfx.Options() if policy is None else ortfx.Options(fallback_policy=policy)
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        wrapped = ortfx.ORTModule(model, options=options)
        x = torch.randn(5, 4)
        wrapped(x).sum().backward()
        if policy is None:
            assert max_diff(wrapped(x.to_sparse()), model(x)) <= 1e-6
            assert ortfx.stats(wrapped).fallback_calls == 1
        else:
            with pytest.raises(ortfx.OrtfxIOError, match="sparse_coo"):
                wrapped(x.to_sparse())
        before = ortfx.stats(wrapped)
        for _ in range(3):
            assert max_diff(wrapped(x), model(x)) <= 1e-6
        after = ortfx.stats(wrapped)
        assert after.fallback is None
        assert after.fallback_calls == before.fallback_calls
        assert after.fast_hits - before.fast_hits >= 2  # back on the fast path
        assert after.exports == before.exports


@pytest.mark.usefixtures("quiet")
def test_a_first_sparse_call_does_not_send_dense_calls_to_pytorch() -> None:
    """The fallback key holds the layout (and requires_grad, the tensor's class): a sparse
    first call falls back alone."""
    model = nn.Linear(4, 3)
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(5, 4)
    wrapped(x.to_sparse())
    wrapped(x)
    stats = ortfx.stats(wrapped)
    assert (stats.fallback_calls, stats.exports, stats.fallback) == (1, 1, None)


# ---- a forward that returns nothing --------------------------------------------------------------


class OnlyPython(nn.Module):
    """Trainable parameters, a forward that computes nothing the caller gets."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        return {"none": None, "n": 3}


class Accumulates(nn.Module):
    """Returns None; only updates state (a statistics pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        _register(self, total=torch.zeros(4), count=torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> None:
        with torch.no_grad():
            self.total.add_(self.lin(x).sum(0))
        self.count.add_(x.shape[0])


@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_forward_returning_nothing_runs_and_updates_state_as_eager(requires_grad: bool) -> None:
    """No tensor out (None, or only Python values), with trainable parameters: the result and
    the buffers are eager's on every step; no error from ORT's gradient builder."""
    for cls in (OnlyPython, Accumulates):
        model, eager, wrapped = _twins(cls)
        for _ in range(3):
            x = torch.randn(6, 4, requires_grad=requires_grad)
            assert wrapped(x) == eager(x.detach().clone().requires_grad_(requires_grad))
            _buffers_match(model, eager)
        assert ortfx.stats(wrapped).fallback_calls == 0


# ---- a second backward through one forward -------------------------------------------------------


class Net(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.tanh(self.bn(self.lin(x)))))


def test_two_losses_backward_through_one_forward_accumulate_as_eager() -> None:
    """l1.backward(retain_graph=True); l2.backward(): gradients accumulate as eager's (1e-5),
    the running statistics move once per forward, and a third backward without a retained
    graph raises torch's own error, as eager does."""
    model, eager, wrapped = _twins(Net)
    for _ in range(3):
        x = torch.randn(6, 4)
        y, z = wrapped(x), eager(x)
        y.sum().backward(retain_graph=True)
        z.sum().backward(retain_graph=True)
        (y**2).mean().backward()
        (z**2).mean().backward()
        _grads_match(model, eager)
        _buffers_match(model, eager)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            y.sum().backward()
    # autograd.grad with retain_graph, then backward, as in GAN steps
    x = torch.randn(6, 4, requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    y, z = wrapped(x), eager(xe)
    (gx,) = torch.autograd.grad(y.pow(2).sum(), x, retain_graph=True)
    (gz,) = torch.autograd.grad(z.pow(2).sum(), xe, retain_graph=True)
    assert max_diff(gx, gz) <= 1e-5
    for p in (*model.parameters(), *eager.parameters()):
        p.grad = None
    y.sum().backward()
    z.sum().backward()
    _grads_match(model, eager)
    assert max_diff(x.grad, xe.grad) <= 1e-5


def test_a_second_backward_that_cannot_replay_raises_a_typed_error() -> None:
    """With dropout on, running the forward again would draw other masks: the second
    backward raises OrtfxRuntimeError saying what to do, and the first one's gradients stand.
    create_graph=True stays a typed error too."""
    torch.manual_seed(0)
    wrapped = ortfx.ORTModule(Net(p=0.5), options=STRICT)
    y = wrapped(torch.randn(6, 4))
    y.sum().backward(retain_graph=True)
    first = wrapped.module.lin.weight.grad.clone()
    with pytest.raises(ortfx.OrtfxRuntimeError, match=r"random numbers \(Dropout\).*Sum the"):
        y.sum().backward()
    assert torch.equal(wrapped.module.lin.weight.grad, first)
    # Higher-order gradients stay a typed error.
    x = torch.randn(6, 4, requires_grad=True)
    with pytest.raises(ortfx.OrtfxRuntimeError, match="create_graph"):
        torch.autograd.grad(wrapped(x).sum(), x, create_graph=True)


# ---- in-place copies into buffers ----------------------------------------------------------------


class Copies(nn.Module):
    """``copy_`` into buffers as statistics, queues and counters use it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        _register(
            self,
            last_mean=torch.zeros(4),
            seen=torch.zeros((), dtype=torch.long),
            level=torch.zeros(2, 4),
            queue=torch.zeros(6, 4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.last_mean.copy_(y.detach().mean(0))  # the same shape and dtype
        self.seen.copy_(self.seen + x.shape[0] * 1.0)  # a float into a long counter
        self.level.copy_(y.detach().mean())  # broadcast from a scalar
        self.queue[:2].copy_(y.detach()[:2])  # into a slice (MoCo's queue)
        self.queue.copy_(self.queue.roll(2, 0))
        return (y * self.last_mean).sum()


def test_copy_into_buffers_runs_in_ort_and_matches_eager() -> None:
    """Tensor.copy_ into buffers exports (no aten::copy fallback): outputs, gradients and
    every buffer (dtype included) equal eager's after each of four steps (1e-5)."""
    model, eager, wrapped = _twins(Copies)
    for _ in range(4):
        x = torch.randn(5, 4)
        got, expected = wrapped(x), eager(x)
        assert max_diff(got, expected) <= 1e-5
        got.backward()
        expected.backward()
        _grads_match(model, eager)
        _buffers_match(model, eager, tol=1e-5)
    stats = ortfx.stats(wrapped)
    assert (stats.exports, stats.fallback_calls) == (1, 0)


class Teacher(nn.Module):
    """A student and an EMA teacher whose parameters the forward updates with ``copy_``."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(4, 3)
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.student.parameters(), strict=True):
                t.copy_(0.9 * t + 0.1 * s)
        return (self.student(x) - self.teacher(x)).pow(2).mean()


def test_copy_into_parameters_runs_in_ort_and_matches_eager() -> None:
    """An EMA teacher updated in the forward (copy_ into parameters under no_grad) trains in
    ORT: after each of four SGD steps the losses, the student's gradients and the teacher's
    parameters equal eager's (1e-5); the export itself changed no parameter."""
    model, eager, wrapped = _twins(Teacher)
    optimizers = [torch.optim.SGD(m.student.parameters(), lr=0.1) for m in (model, eager)]
    for _ in range(4):
        x = torch.randn(5, 4)
        got, expected = wrapped(x), eager(x)
        assert max_diff(got, expected) <= 1e-5
        for loss, optimizer in zip((got, expected), optimizers, strict=True):
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        for name, p in model.named_parameters():
            assert max_diff(p, dict(eager.named_parameters())[name]) <= 1e-5, name
    stats = ortfx.stats(wrapped)
    assert (stats.exports, stats.fallback_calls) == (1, 0)


class ThroughAliases(nn.Module):
    """In-place writes through aliases of a buffer and of a parameter, which the tracer
    records on the alias (the graph would leave them out)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 3)
        self.teacher = nn.Linear(4, 3).requires_grad_(False)
        _register(self, scale=torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "detach":
            self.scale.detach().mul_(0.9)
        elif self.how == "view":
            self.scale.view(3).mul_(0.9)
        else:  # the old EMA idiom
            self.teacher.weight.data.mul_(0.9).add_(0.1 * self.lin.weight.data)
        return (self.lin(x) * self.scale - self.teacher(x)).pow(2).mean()


@pytest.mark.parametrize("how", ["detach", "view", "data"])
@pytest.mark.usefixtures("quiet")
def test_writes_through_aliases_fall_back_loudly_and_leave_state_as_eager(how: str) -> None:
    """A write through detach(), view() or .data: refused at export (OrtfxExportError naming
    it under DISABLE), so the default policy runs PyTorch; after three steps every buffer and
    parameter equals eager's (exact: the export put back what it wrote)."""
    torch.manual_seed(0)
    model = ThroughAliases(how)
    eager = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model)
    for _ in range(3):
        x = torch.randn(5, 4)
        assert torch.equal(wrapped(x), eager(x))
    for name, value in model.state_dict().items():
        assert torch.equal(value, eager.state_dict()[name]), name
    assert ortfx.stats(wrapped).fallback_calls == 3
    strict = ortfx.ORTModule(ThroughAliases(how), options=STRICT)
    shown = ".data" if how == "data" else f"{how}()"
    with pytest.raises(ortfx.OrtfxExportError, match=f"in place through {re.escape(shown)}"):
        strict(torch.randn(5, 4))


class Heads(nn.Module):
    """Two heads over a shared body, a size read from a third, and an input scaled alone."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head_a, self.head_b = nn.Linear(4, 2), nn.Linear(4, 2)
        self.sizer = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.relu(self.body(x))
        width = (self.sizer(x).argmax(-1) > 0).float()  # no gradient reaches sizer
        return self.head_a(h) * (1 + 0 * width[:, None]), self.head_b(h), y * 2


@pytest.mark.parametrize("memgrad", [False, True])
def test_what_only_unused_outputs_reach_gets_no_gradient_as_eager(memgrad: bool) -> None:
    """Eager leaves .grad None on what only outputs without a gradient reach (a head the loss
    does not use, an input scaled into an unused output, a layer read only through argmax),
    and an optimizer then leaves those parameters alone; ortfx handed them zeros, so AdamW's
    weight decay and momentum moved them. Parameters (1e-6), .grad None-ness, and
    autograd.grad(allow_unused=True) as eager, with memory-efficient gradients too."""
    torch.manual_seed(0)
    model = Heads()
    options = ortfx.Options(
        fallback_policy=ortfx.FallbackPolicy.DISABLE,
        enable_mem_efficient_grad_management=memgrad,
    )
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=options)
    runs = []
    inputs = torch.randn(8, 4), torch.randn(8)
    for module in (model, wrapped):
        optimizer = torch.optim.AdamW(module.parameters(), lr=0.1, weight_decay=0.1)
        x, y = inputs[0], inputs[1].clone().requires_grad_()
        for step in range(3):
            optimizer.zero_grad()
            a, b, _ = module(x, y)
            (a.pow(2).mean() if step < 2 else (a.sum() + b.sum())).backward()
            if step < 2:
                optimizer.step()
        runs.append(
            (
                {n: p.grad is None for n, p in module.named_parameters()},
                [p.detach().clone() for p in module.parameters()],
                y.grad,
            )
        )
    (none_eager, params_eager, y_eager), (none_ours, params_ours, y_ours) = runs
    assert none_ours == none_eager
    assert none_eager["head_b.weight"] is False and none_eager["sizer.weight"] is True
    assert y_eager is None and y_ours is None
    for ours, eager in zip(params_ours, params_eager, strict=True):
        assert max_diff(ours, eager) <= 1e-6
    if not memgrad:  # autograd.grad asks for chosen tensors only, which memgrad refuses
        x = torch.randn(8, 4)
        for module in (model, wrapped):
            a, _, _ = module(x, torch.randn(8))
            found = torch.autograd.grad(
                a.sum(), [module.head_a.weight, module.head_b.weight], allow_unused=True
            )
            assert found[0] is not None and found[1] is None


class ReturnsHidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        return h, self.b(h), h.clone()  # h is returned and read by b; its clone is not


@pytest.mark.parametrize("how", ["register_hook", "retain_grad"])
def test_a_hook_on_an_output_the_graph_also_reads_raises(how: str) -> None:
    """A returned tensor the forward also uses (a hidden state the next layer reads): eager's
    hook (or retain_grad) sees its whole gradient, ORT adds the inner part within its graph,
    so the hook saw only the outer part (and a rescaling hook trained differently), silently.
    The backward raises a typed error; a hook on a tensor the graph does not reuse (the
    clone) and calls without hooks give eager's gradients (1e-6)."""
    torch.manual_seed(0)
    model = ReturnsHidden()
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    x = torch.randn(3, 4)
    h, y, _ = wrapped(x)
    if how == "register_hook":
        h.register_hook(lambda g: g * 3)
    else:
        h.retain_grad()
    with pytest.raises(ortfx.OrtfxRuntimeError, match="output 0 of the module has a gradient hook"):
        (y.sum() + h.sum()).backward()
    for module in (model, wrapped):
        module.zero_grad()
        h, y, c = module(x)
        c.register_hook(lambda g: g * 3)
        (y.sum() + h.sum() + c.sum()).backward()
    for (path, p), q in zip(wrapped.named_parameters(), model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert max_diff(p.grad, q.grad) <= 1e-6, path


class ReturnsWithoutInnerGradient(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.a(x)
        h = torch.tanh(self.b(x))
        # y is read inside only through argmax and a size; h returned as a clone and read
        return y, y.argmax(-1), x.new_zeros(y.shape), h.clone(), h * 3


def test_a_hook_on_an_output_read_inside_without_a_gradient_works_as_eager() -> None:
    """An output read inside only by what passes no gradient (argmax, a size) or returned as
    a clone gets exactly its own gradient: its hook and retain_grad() work as in eager (1e-6;
    parameter gradients 1e-5)."""
    torch.manual_seed(0)
    model = ReturnsWithoutInnerGradient()
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    x = torch.randn(3, 4)
    grads = []
    for module in (model, wrapped):
        y, _, _, c, z = module(x)
        y.retain_grad()
        seen: list[torch.Tensor] = []
        c.register_hook(lambda g, seen=seen: seen.append(g) or g * 2)
        (y.pow(2).sum() + c.sum() + z.sum()).backward()
        grads.append((y.grad, seen[0], [p.grad for p in module.parameters()]))
    (y_e, c_e, p_e), (y_o, c_o, p_o) = grads
    assert max_diff(y_o, y_e) <= 1e-6 and max_diff(c_o, c_e) <= 1e-6
    for a, b in zip(p_o, p_e, strict=True):
        assert max_diff(a, b) <= 1e-5  # sums of magnitude 10


def test_a_librarys_hook_on_an_output_the_graph_reads_passes() -> None:
    """FSDP's and DeepSpeed's pre-backward hooks on a module's outputs schedule their own work
    and return nothing: such a hook (its function from a library's module) does not raise
    where a user's hook on the same output does, and the gradients are eager's (1e-6)."""
    torch.manual_seed(0)
    model = ReturnsHidden()
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    x = torch.randn(3, 4)
    calls: list[int] = []

    def schedule(grad: torch.Tensor) -> None:
        calls.append(1)

    schedule.__module__ = "deepspeed.runtime.zero.parameter_offload"
    for module in (model, wrapped):
        h, y, _ = module(x)
        h.register_hook(schedule)
        (y.sum() + h.sum()).backward()
    assert calls == [1, 1]
    for (path, p), q in zip(wrapped.named_parameters(), model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert max_diff(p.grad, q.grad) <= 1e-6, path
