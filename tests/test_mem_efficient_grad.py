"""Memory-efficient gradient management (Options(enable_mem_efficient_grad_management=True)).

Each parameter's gradient is handed to torch from inside ORT's backward; the properties checked
here: gradients equal eager PyTorch's (and the default mode's), each ``.grad`` is accumulated
exactly once per backward, hooks fire once per parameter and step while ORT's backward still
runs, and the usual training patterns (accumulation, set_to_none, freezing, recompute, dropout,
eval with grad, optimizer in backward) match eager.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections import Counter
from collections.abc import Callable

import onnx
import pytest
import torch
from torch import nn

import ortfx
from ortfx import passes
from ortfx.errors import OrtfxRuntimeError
from ortfx.options import LogLevel
from tests import models

MEM = ortfx.Options(enable_mem_efficient_grad_management=True)
TOL = 1e-6


def _gpt_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)


def _mlp_batch(seed: int = 0) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))


def _pair(model: nn.Module, options: ortfx.Options = MEM) -> tuple[nn.Module, ortfx.ORTModule]:
    """An eager copy and an ortfx wrapper of ``model``, with equal parameters."""
    return copy.deepcopy(model), ortfx.ORTModule(model, options=options)


def _assert_grads_equal(a: nn.Module, b: nn.Module, tol: float = TOL) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if pa.grad is None or pb.grad is None:
            assert pa.grad is None and pb.grad is None, name
            continue
        # Absolute below magnitude 1, relative above (float32 rounding scales with the value).
        scale = max(1.0, pa.grad.abs().max().item())
        assert models.max_diff(pa.grad, pb.grad) <= tol * scale, (
            name,
            models.max_diff(pa.grad, pb.grad),
        )


def _in_ort_backward() -> bool:
    """Whether ORT's backward is on the stack: the bridge's PythonOp backward runner."""
    return any(
        f.function == "backward_runner" and f.filename.endswith("pythonop.py")
        for f in inspect.stack()
    )


def test_gradients_equal_eager_and_default_mode() -> None:
    """Same gradients as PyTorch and as the default mode, on a GPT with embedding and LM head."""
    torch.manual_seed(0)
    model = models.TinyGPT()
    eager, mem = _pair(model)
    default = ortfx.ORTModule(copy.deepcopy(model))
    ids, labels = _gpt_batch()
    for m in (eager, mem, default):
        m(ids, labels).backward()
    _assert_grads_equal(eager, mem, 2e-6)
    _assert_grads_equal(default, mem, TOL)
    assert ortfx.stats(mem).exports == 1


def test_each_grad_accumulated_once_hooks_fire_inside_ort_backward() -> None:
    """register_hook and register_post_accumulate_grad_hook fire exactly once per parameter and
    backward, while ORT's backward is still running; last layer first."""
    torch.manual_seed(0)
    eager, mem = _pair(models.MLP())
    pre: Counter[str] = Counter()
    post: list[tuple[str, bool]] = []
    for name, p in mem.named_parameters():
        p.register_hook(lambda g, name=name: pre.update([name]))
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: post.append((name, _in_ort_backward()))
        )
    x = _mlp_batch()
    for step in range(1, 4):
        eager(x).pow(2).sum().backward()
        mem(x).pow(2).sum().backward()
        names = [n for n, _ in mem.named_parameters()]
        assert pre == Counter({n: step for n in names})
        assert Counter(n for n, _ in post) == Counter({n: step for n in names})
        _assert_grads_equal(eager, mem)  # accumulated over steps, never twice
    assert all(inside for _, inside in post)
    # ORT hands the last layer's gradients over before the first layer's.
    first_step = [n for n, _ in post[:4]]
    assert first_step.index("fc2.weight") < first_step.index("fc1.weight")


@pytest.mark.parametrize("level", [0, 1])
def test_gradient_buffers_kept_without_copy_and_never_overwritten(level: int) -> None:
    """Torch keeps the buffer ORT computed a weight's gradient in as ``.grad`` (no copy), and
    that ``.grad`` still holds, after the whole backward and the next step's, exactly what the
    hook saw: ORT never reuses a buffer torch kept. Bias gradients ORT hands over as views of
    other values are copied instead."""
    torch.manual_seed(0)
    eager, mem = _pair(
        models.TinyGPT(),
        ortfx.Options(enable_mem_efficient_grad_management=True, memory_opt_level=level),
    )
    arrived: dict[str, tuple[int, torch.Tensor]] = {}
    for name, p in mem.named_parameters():
        p.register_hook(lambda g, name=name: arrived.__setitem__(name, (g.data_ptr(), g.clone())))
    for seed in range(2):
        ids, labels = _gpt_batch(seed)
        for m in (eager, mem):
            m.zero_grad(set_to_none=True)
            m(ids, labels).backward()
        kept = set()
        for name, p in mem.named_parameters():
            ptr, seen = arrived[name]
            assert p.grad is not None and torch.equal(p.grad, seen), name
            if p.grad.data_ptr() == ptr:
                kept.add(name)
        _assert_grads_equal(eager, mem, 2e-6)
        weights = {n for n, p in mem.named_parameters() if n.endswith("weight") and p.dim() == 2}
        assert weights <= kept, weights - kept


def test_owned_gradients_only_for_buffers_of_their_own() -> None:
    """The pass lets torch keep a gradient only if an allocating node made it and nothing but
    its PythonOpGrad reads it."""
    h = onnx.helper
    fn = "f"

    def feed(k: int) -> onnx.NodeProto:
        return h.make_node(
            "PythonOp", ["t"], [f"c{k}", f"p{k}"], domain="com.microsoft", func_name=fn,
            input_int_scalars=[k],
        )  # fmt: skip

    def grad(k: int, ctx: str | None = None) -> onnx.NodeProto:
        return h.make_node(
            "PythonOpGrad", [ctx or f"c{k}", f"g{k}"], [f"t{k}"], domain="com.microsoft"
        )

    nodes = [
        *(feed(k) for k in range(6)),
        h.make_node("Gemm", ["a", "b"], ["g0"], transA=1),  # owned
        h.make_node("MatMul", ["a", "b"], ["r"]),
        h.make_node("Reshape", ["r", "s"], ["g1"]),  # a view of r
        h.make_node("Gemm", ["a", "b", "c"], ["g2"]),  # may be written into c
        h.make_node("ReduceSum", ["a", "ax"], ["g3"]),
        h.make_node("Neg", ["g3"], ["other"]),  # g3 read twice
        h.make_node("Add", ["a", "b"], ["g4"]),  # may be a's buffer
        h.make_node("LayerNormalizationGrad", ["a", "b", "c"], ["dx", "g5"]),
        h.make_node("PassThrough", ["c5", "dx"], ["c5b", "dxb"], domain="com.microsoft"),
        *(grad(k) for k in range(5)),
        grad(5, "c5b"),  # behind a barrier over its context: owned
    ]
    graph = h.make_graph(nodes, "g", [], [])
    assert passes.owned_gradients(h.make_model(graph), fn) == frozenset({0, 5})


def test_default_mode_hooks_fire_after_ort_backward() -> None:
    """The contrast: without the option, hooks run after ORT's whole backward."""
    mem_off = ortfx.ORTModule(models.MLP())
    inside: list[bool] = []
    for p in mem_off.parameters():
        p.register_post_accumulate_grad_hook(lambda p: inside.append(_in_ort_backward()))
    mem_off(_mlp_batch()).sum().backward()
    assert inside == [False] * 4


def test_accumulation_over_micro_steps_and_set_to_none() -> None:
    """Micro-batches without zero_grad sum up as in eager; zero_grad with and without
    set_to_none restarts as in eager."""
    torch.manual_seed(0)
    eager, mem = _pair(models.TinyGPT())
    for set_to_none in (True, False, True):
        for m in (eager, mem):
            m.zero_grad(set_to_none=set_to_none)
        for seed in range(3):
            ids, labels = _gpt_batch(seed)
            eager(ids, labels).backward()
            mem(ids, labels).backward()
        _assert_grads_equal(eager, mem, 4e-6)
    assert all(p.grad is not None for p in mem.parameters())


def test_freezing_and_unfreezing_reprocesses() -> None:
    """Parameters frozen between steps stay plain inputs and get no gradient; unfreezing feeds
    them again. Each change re-processes the graph, never re-exports."""
    torch.manual_seed(0)
    eager, mem = _pair(models.MLP())
    x = _mlp_batch()
    for frozen in ((), ("fc1.weight", "fc1.bias"), ("fc2.bias",), ()):
        for m in (eager, mem):
            m.zero_grad()
            for name, p in m.named_parameters():
                p.requires_grad_(name not in frozen)
        eager(x).pow(2).sum().backward()
        mem(x).pow(2).sum().backward()
        _assert_grads_equal(eager, mem)
        assert {n for n, p in mem.named_parameters() if p.grad is None} == set(frozen)
    stats = ortfx.stats(mem)
    assert stats.exports == 1 and stats.reprocesses == 3


def test_input_gradients_with_frozen_parameters() -> None:
    """Only a user input requires grad (every parameter frozen): nothing is fed, the input's
    gradient matches eager."""
    model = models.MLP().requires_grad_(False)
    eager, mem = _pair(model)
    xa = _mlp_batch().requires_grad_()
    xb = xa.detach().clone().requires_grad_()
    eager(xa).sum().backward()
    mem(xb).sum().backward()
    assert models.max_diff(xa.grad, xb.grad) <= TOL


def test_memory_optimizer_level_1() -> None:
    """Recompute (memory_opt_level=1) and fed parameters together: gradients equal eager."""
    torch.manual_seed(0)
    options = ortfx.Options(enable_mem_efficient_grad_management=True, memory_opt_level=1)
    eager, mem = _pair(models.TinyGPT(), options)
    ids, labels = _gpt_batch()
    eager(ids, labels).backward()
    mem(ids, labels).backward()
    _assert_grads_equal(eager, mem, 2e-6)


def test_dropout_matches_default_mode() -> None:
    """With dropout the masks are ORT's: the default mode (same torch seed) is the reference."""
    torch.manual_seed(0)
    model = models.TinyGPT(dropout=0.2)
    default = ortfx.ORTModule(copy.deepcopy(model))
    mem = ortfx.ORTModule(model, options=MEM)
    ids, labels = _gpt_batch()
    la, lb = default(ids, labels), mem(ids, labels)
    assert models.max_diff(la, lb) <= TOL
    la.backward()
    lb.backward()
    _assert_grads_equal(default, mem)


def test_eval_mode_with_grad() -> None:
    """A call in eval mode with grad enabled trains the eval graph, as in eager."""
    torch.manual_seed(0)
    eager, mem = _pair(models.TinyGPT(dropout=0.2))
    eager.eval()
    mem.eval()
    ids, labels = _gpt_batch()
    eager(ids, labels).backward()
    mem(ids, labels).backward()
    _assert_grads_equal(eager, mem, 2e-6)


def _optimizer_in_backward(
    model: nn.Module, lr: float
) -> dict[nn.Parameter, torch.optim.Optimizer]:
    """PyTorch's tutorial pattern: one optimizer per parameter, stepped as its gradient is
    accumulated, then the gradient dropped."""
    # SGD with momentum, not Adam: Adam turns the float noise of gradients that are zero in
    # exact arithmetic (the key bias of attention) into full-size steps.
    optimizers = {p: torch.optim.SGD([p], lr=lr, momentum=0.9) for p in model.parameters()}

    def step(p: torch.Tensor) -> None:
        optimizers[p].step()  # type: ignore[index]
        optimizers[p].zero_grad(set_to_none=True)  # type: ignore[index]

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    return optimizers  # type: ignore[return-value]


def test_optimizer_in_backward_matches_eager() -> None:
    """After N steps with the optimizer fused into backward, the weights equal eager's; no
    gradient is left behind, and no step ran before ORT's backward began."""
    torch.manual_seed(0)
    eager, mem = _pair(models.TinyGPT())
    _optimizer_in_backward(eager, 0.1)
    _optimizer_in_backward(mem, 0.1)
    inside: list[bool] = []
    for p in mem.parameters():
        p.register_post_accumulate_grad_hook(lambda p: inside.append(_in_ort_backward()))
    for step in range(5):
        ids, labels = _gpt_batch(step)
        la, lb = eager(ids, labels), mem(ids, labels)
        assert models.max_diff(la, lb) <= 1e-5, step
        la.backward()
        lb.backward()
    for (name, pa), (_, pb) in zip(eager.named_parameters(), mem.named_parameters(), strict=True):
        assert models.max_diff(pa, pb) <= 1e-5, (name, models.max_diff(pa, pb))
        assert pb.grad is None
    assert inside and all(inside)


def test_parameter_changed_between_forward_and_backward_raises() -> None:
    """As in eager: a weight changed in place after the forward cannot be differentiated."""
    mem = ortfx.ORTModule(models.MLP(), options=MEM)
    loss = mem(_mlp_batch()).sum()
    with torch.no_grad():
        mem.fc1.weight.add_(1.0)  # type: ignore[operator]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("level", [0, 1])
def test_optimizer_in_backward_with_recompute(level: int) -> None:
    """Fused optimizer steps change weights in place while ORT's backward runs: ORT must have
    read each weight for the last time before its gradient is handed over, recompute too."""
    torch.manual_seed(1)
    options = ortfx.Options(enable_mem_efficient_grad_management=True, memory_opt_level=level)
    eager, mem = _pair(models.TinyGPT(), options)
    _optimizer_in_backward(eager, 0.1)
    _optimizer_in_backward(mem, 0.1)
    for step in range(3):
        ids, labels = _gpt_batch(step)
        la, lb = eager(ids, labels), mem(ids, labels)
        assert models.max_diff(la, lb) <= 1e-5, step
        la.backward()
        lb.backward()
    for (name, pa), (_, pb) in zip(eager.named_parameters(), mem.named_parameters(), strict=True):
        assert models.max_diff(pa, pb) <= 1e-5, (name, models.max_diff(pa, pb))


@pytest.mark.parametrize(
    "restricted",
    [
        lambda loss, x, params: torch.autograd.grad(loss, [x]),
        lambda loss, x, params: loss.backward(inputs=[x]),
    ],
    ids=["autograd.grad", "backward(inputs=)"],
)
def test_restricted_backward_raises_and_leaves_grads(
    restricted: Callable[[torch.Tensor, torch.Tensor, list[nn.Parameter]], object],
) -> None:
    """A backward asking for some tensors only would have to keep .grad untouched: ortfx says
    it cannot, instead of accumulating parameter gradients nobody asked for."""
    mem = ortfx.ORTModule(models.MLP(), options=MEM)
    x = _mlp_batch().requires_grad_()
    with pytest.raises(OrtfxRuntimeError, match="enable_mem_efficient_grad_management=False"):
        restricted(mem(x).sum(), x, list(mem.parameters()))
    assert all(p.grad is None for p in mem.parameters())


def test_switching_reprocesses_with_reason(caplog: pytest.LogCaptureFixture) -> None:
    """configure() on and off re-processes without re-export; the transition says why; the
    feature table shows the option; gradients stay equal to eager throughout."""
    torch.manual_seed(0)
    eager, wrapped = _pair(models.MLP(), ortfx.Options(log_level=LogLevel.INFO))
    x = _mlp_batch()
    with caplog.at_level(logging.INFO, logger="ortfx"):
        for on in (False, True, False, True):
            ortfx.configure(wrapped, enable_mem_efficient_grad_management=on)
            for m in (eager, wrapped):
                m.zero_grad()
            eager(x).pow(2).sum().backward()
            wrapped(x).pow(2).sum().backward()
            _assert_grads_equal(eager, wrapped)
    stats = ortfx.stats(wrapped)
    assert stats.exports == 1
    history = [str(t) for t in ortfx.explain(wrapped)]
    on = (
        "re-process: option enable_mem_efficient_grad_management was False, now True "
        "(parameters enter the graph another way)"
    )
    off = on.replace("False, now True", "True, now False")
    assert history[1:] == [on, off, on]
    messages = [r.getMessage() for r in caplog.records if r.name == "ortfx"]
    tables = [m for m in messages if m.startswith("features:")]
    assert "Mem-efficient gradients" in tables[0]
    assert any(
        "Mem-efficient gradients" in t and "ON" in t.split("Mem-efficient")[1][:40] for t in tables
    )


def test_environment_variable() -> None:
    env = {"ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT": "1"}
    assert ortfx.Options.from_env(environ=env).enable_mem_efficient_grad_management
    assert not ortfx.Options.from_env(environ={}).enable_mem_efficient_grad_management


def test_no_grad_and_inference_calls_are_untouched() -> None:
    """Under no_grad the inference graph runs (no PythonOp, nothing fed), same outputs."""
    torch.manual_seed(0)
    eager, mem = _pair(models.MLP())
    x = _mlp_batch()
    with torch.no_grad():
        assert models.max_diff(eager(x), mem(x)) <= TOL
    mem(x).sum().backward()
    with torch.no_grad():
        assert models.max_diff(eager(x), mem(x)) <= TOL


def test_feeds_run_without_autograd_nodes_and_are_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bridge runs the parameter feeds directly (the Function is never applied); what a
    training forward keeps for them is released by its backward, or when its output dies
    without one, and a forward without backward accumulates nothing."""
    from ortfx.runtime import memgrad, pythonop

    def never(*args: object) -> None:
        raise AssertionError("FeedParameter applied: the bridge's direct path was not taken")

    monkeypatch.setattr(memgrad.FeedParameter, "forward", staticmethod(never))
    torch.manual_seed(0)
    eager, mem = _pair(models.MLP())
    x = _mlp_batch()
    out = mem(x)
    assert pythonop.live_contexts() == 4  # one per parameter that requires grad
    del out
    assert pythonop.live_contexts() == 0
    assert all(p.grad is None for p in mem.parameters())
    eager(x).sum().backward()
    mem(x).sum().backward()
    assert pythonop.live_contexts() == 0
    _assert_grads_equal(eager, mem)


DDP_TIMEOUT = 120  # seconds for both ranks; a hung collective fails instead of blocking


def _ddp_ranks(world: int) -> list[dict[str, object]]:
    """Run tests/ddp_worker.py on ``world`` CPU ranks (gloo, 127.0.0.1, a free port)."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
            }
            cmd = [sys.executable, "-m", "tests.ddp_worker", os.path.join(tmp, f"{rank}.json")]
            procs.append(
                subprocess.Popen(
                    cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
            )
        outputs = []
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=DDP_TIMEOUT)[0].decode()[-3000:])
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                pytest.fail("DDP ranks did not finish in time")
        if any(p.returncode for p in procs):
            pytest.fail("DDP rank failed:\n" + "\n".join(outputs))
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"{rank}.json")) as f:
                results.append(json.load(f))
        return results


def test_ddp_over_ortmodule_matches_single_process() -> None:
    """DistributedDataParallel(ORTModule(model)) on 2 gloo ranks: losses and weights after N
    steps equal one eager process on the concatenated batch; with the option on, DDP's
    gradient hooks run inside ORT's backward."""
    from tests import ddp_worker

    ranks = _ddp_ranks(2)
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    eager = ddp_worker.make_model()
    optimizer = torch.optim.SGD(eager.parameters(), lr=ddp_worker.LR)
    losses = []
    for step in range(ddp_worker.STEPS):
        loss = eager(*ddp_worker.batch(step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    for mode in ("mem_efficient=True", "mem_efficient=False"):
        for rank in ranks:
            run = rank[mode]
            assert max(abs(a - b) for a, b in zip(run["losses"], losses, strict=True)) <= 1e-5
            for name, p in eager.named_parameters():
                got = torch.tensor(run["weights"][name])
                assert models.max_diff(got, p.flatten()) <= 1e-5, (mode, name)
    assert all(ranks[0]["mem_efficient=True"]["inside"])
    assert not any(ranks[0]["mem_efficient=False"]["inside"])


def test_restricted_backwards_are_said_with_each_training_graph(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A backward asking only for parameters runs no ortfx code, so it cannot raise: the
    limit is said at WARNING when the training graph is built, never silently."""
    torch.manual_seed(0)
    wrapped = ortfx.ORTModule(nn.Linear(4, 2), options=MEM)
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        for _ in range(2):
            wrapped(torch.randn(3, 4)).sum().backward()
    said = [
        r.getMessage()
        for r in caplog.records
        if "memory-efficient gradients are on" in r.getMessage()
    ]
    assert len(said) == 1
    assert "loss.backward(inputs=[p])" in said[0] and "gives them no gradient" in said[0]
