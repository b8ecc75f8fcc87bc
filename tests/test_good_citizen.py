"""ortfx inside someone else's process: what it must leave alone.

The scenarios that need a process where nothing ran before run in subprocesses
(``tests/citizen_worker.py``); each test here would fail on the code before the good-citizen
reshape (checked against that commit)."""

from __future__ import annotations

import contextlib
import copy
import json
import pstats
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ortfx
from tests.models import SHAPE_INFERENCE, shape_inference_recorded

ROOT = Path(__file__).resolve().parent.parent
STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)


def _worker(scenario: str, *argv: str, timeout: int = 600) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "tests.citizen_worker", scenario, *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


# ORT refuses torch's own export of a bool cumsum (CumSum takes no bool): ortfx's symbolic
# fixes that for ortfx's graphs only; the user's export stays exactly torch's.
TORCH_OWN_INVALID = {"cumsum_bool"}


def test_a_users_onnx_export_is_torchs_own_before_and_after_ortfx() -> None:
    """For one model per op ortfx writes its own way (every TorchScript symbolic it registers,
    and a custom Function's PythonOp), the user's ``torch.onnx.export`` gives the same bytes
    (or the same error) before and after ortfx trained models with both exporters, torch's
    symbolic registry is exactly as before, no graph has a custom domain, and each loads in a
    plain ``onnxruntime.InferenceSession`` (all but torch's own invalid bool cumsum)."""
    found = _worker("user_export")
    assert found["differ"] == []
    assert found["registry_same"], found["registry_diff"]
    assert len(found["exported"]) >= 20
    for name, (loads, domains) in found["loads"].items():
        assert domains == [], name
        if name in TORCH_OWN_INVALID:
            assert "CumSum" in loads, loads
        else:
            assert loads == "loads", (name, loads)


def test_ortfx_before_any_export_leaves_torchs_registry_whole() -> None:
    """torch fills its symbolic registry on its first export. When ortfx's export is the
    process's first, the user's exports afterwards give the bytes (or errors) of a process
    that never imported ortfx, and the registry is that process's (ortfx once took torch's
    own cross-entropy, nll_loss and scatter_reduce symbolics away with its own)."""
    torch_only, ortfx_first = _worker("torch_only"), _worker("ortfx_first")
    assert torch_only["exported"]["cross_entropy"][0] == "ok"
    differ = sorted(
        n for n in torch_only["exported"] if torch_only["exported"][n] != ortfx_first["exported"][n]
    )
    assert differ == []
    registry_diff = sorted(
        k
        for k in set(torch_only["registry"]) | set(ortfx_first["registry"])
        if torch_only["registry"].get(k) != ortfx_first["registry"].get(k)
    )
    assert registry_diff == []


def test_another_thread_sees_torchs_own_process_while_ortfx_exports() -> None:
    """While one thread is inside ortfx's export, another thread sees torch's own Tensor
    attributes, grad-mode functions, Module.__setattr__, RemovableHandle.remove and F.linear,
    its own grad mode, and the process's stdout/stderr (objects and file descriptors); a plain
    model it trains meanwhile reads its autograd attributes, runs its hooks and gets the
    gradients of a run without ortfx (exactly). After the export nothing is left changed."""
    found = _worker("during_export")
    assert found["view_differs"] == []
    assert found["after_differs"] == []
    assert found["end_differs"] == []
    assert found["flags"] == [True, True, True]
    assert found["hooked"] == [True]
    assert found["grad_equal"]
    assert found["ortfx_matches_eager"]


def test_a_hundred_short_runs_exit_cleanly() -> None:
    """A script that creates and drops wrappers, then exits, exits 0: before, the arena's
    shrinker (a daemon thread) could be inside ORT when the interpreter ended, and about 2 exits
    in 100 aborted (SIGABRT, "terminate called without an active exception"). 100 children,
    each a full interpreter shutdown, at moments spread over the shrinker's window."""
    found = _worker("short_runs", "100", timeout=900)
    assert len(found["statuses"]) == 100
    assert [s for s in found["statuses"] if s != 0] == []


def test_two_threads_building_their_first_wrappers_at_once() -> None:
    """Each thread's first call flattens a dataclass ortfx has never registered and runs a
    custom Function (the PythonOp bridge's first setup): both at once, several times over
    (each time in a fresh process), no error, outputs and gradients equal eager's (1e-6)."""
    found = _worker("first_wrappers_at_once")
    assert found["errors"] == []
    assert found["rounds"] == 8
    assert found["max_diff"] <= 1e-6


# ---- the façade commits compare-and-swap ---------------------------------------------------------


class SwapsInEval(nn.Module):
    """In eval mode the forward returns what ortfx cannot carry (a set), so that call runs in
    PyTorch; while it runs there, it replaces its second layer (the registration hook tells
    the wrapper, which must not then forget it)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.second(self.first(x))
        if not self.training:
            self.second = nn.Linear(4, 4)
            return {"h": h, "tags": {"eval"}}
        return h


def test_an_invalidation_during_a_call_is_never_lost() -> None:
    """A registration hook firing inside a call that runs in PyTorch commits an invalidation;
    the call's own commit must keep it (the façade used to overwrite it with the shell the call
    started from, and the next training call ran the old layer's weights, silently)."""
    torch.manual_seed(0)
    eager = SwapsInEval()
    wrapped = ortfx.ORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    assert torch.allclose(wrapped(x), eager(x), atol=1e-6)
    wrapped.eval()
    wrapped(x)  # falls back; replaces .second inside
    wrapped.train()
    expected = wrapped.module.second(wrapped.module.first(x))
    assert torch.allclose(wrapped(x), expected, atol=1e-6)
    assert "'second' of SwapsInEval set to a Linear" in str(ortfx.explain(wrapped)[-1])


def test_configure_during_a_call_on_another_thread_is_kept() -> None:
    """``ortfx.configure`` from another thread while a call runs: the call's commit rebases
    onto it instead of overwriting the new options."""
    started, release = threading.Event(), threading.Event()

    class Slow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            started.set()
            release.wait(30)
            return self.lin(x)

    wrapped = ortfx.ORTModule(Slow())
    call = threading.Thread(target=lambda: wrapped(torch.randn(2, 4)))
    call.start()
    assert started.wait(30)
    ortfx.configure(wrapped, memory_opt_level=1)
    release.set()
    call.join()
    assert ortfx.options_of(wrapped).memory_opt_level == 1


def test_memory_report_commits_onto_an_invalidation_made_while_it_ran() -> None:
    """``memory_report`` builds a probe session; a layer replaced while it runs (here from the
    session-options seam, as another thread or a hook could) invalidates the graphs, and the
    report's commit keeps that: the next call exports again and matches eager (1e-6)."""
    from ortfx.runtime import events

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(2, 4)
    wrapped(x).sum().backward()
    swapped: list[bool] = []

    def swap(options: Any, training: bool) -> None:
        if not swapped:
            swapped.append(True)
            model[2] = nn.Linear(4, 1)  # the registration hook invalidates

    events.session_option_edits.append(swap)
    try:
        ortfx.memory_report(wrapped)
    finally:
        events.session_option_edits.remove(swap)
    assert swapped
    assert torch.allclose(wrapped(x), model(x), atol=1e-6)
    assert ortfx.stats(wrapped).exports == 2


# ---- what a red-team pass over the reshape found ------------------------------------------------


class Configurable(nn.Module):
    """Branches on attributes of every kind: a function, an enum member, a tuple, a float."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act: Any = torch.relu
        self.kind: Any = "plain"
        self.window = (0, 2)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.lin(x)) * self.scale
        if self.kind == "tripled":
            h = h * 3
        return h[:, self.window[0] : self.window[1]]


def test_any_public_attribute_replaced_outside_the_wrapper_exports_again() -> None:
    """A new object in a public attribute (a function, a string, a tuple, another float) is a
    change the trace may have read: exported again, outputs equal eager's (1e-6); an equal
    float set again is no change (no export); the reason names the attribute."""
    torch.manual_seed(0)
    eager = nn.Sequential(Configurable())
    wrapped = ortfx.ORTModule(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    assert torch.allclose(wrapped(x), eager(x), atol=1e-6)
    exports = 1
    for name, value in (("act", torch.tanh), ("kind", "tripled"), ("window", (1, 4))):
        setattr(eager[0], name, value)
        setattr(wrapped.module[0], name, value)
        assert torch.allclose(wrapped(x), eager(x), atol=1e-6), name
        exports += 1
        assert ortfx.stats(wrapped).exports == exports
        assert f"attribute {name!r} of Configurable set outside the wrapper" in str(
            ortfx.explain(wrapped)[-1]
        )
    wrapped.module[0].scale = float("1.0")  # another float object, equal
    wrapped(x)
    assert ortfx.stats(wrapped).exports == exports


def test_a_c_level_profiler_keeps_running_through_an_export() -> None:
    """cProfile (a C-level profile function no Python hook can call) stays installed and
    records the forward's functions; the export neither fails nor falls back; outputs equal
    eager's (1e-6)."""
    import cProfile

    torch.manual_seed(0)
    eager = Configurable()
    wrapped = ortfx.ORTModule(copy.deepcopy(eager), options=STRICT)
    x = torch.randn(3, 4)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        out = wrapped(x)
        still = sys.getprofile() is profiler
    finally:
        profiler.disable()
    assert still
    assert torch.allclose(out, eager(x), atol=1e-6)
    assert ortfx.stats(wrapped).fallback_calls == 0
    recorded = {function for _, _, function in pstats.Stats(profiler).stats}  # type: ignore[attr-defined]
    assert "forward" in recorded


def test_warnings_as_errors_do_not_break_the_export() -> None:
    """With every warning an error (``-W error``, pytest's ``filterwarnings = error``) the
    exporters' own deprecations and the tracer's notes do not fail the export; a warning the
    forward itself raises is still an error, as in eager."""
    import warnings

    class Warns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, loud: bool = False) -> torch.Tensor:
            if loud:
                warnings.warn("the forward's own", UserWarning, stacklevel=1)
            h = self.lin(x)
            return h * int(h.shape[0])

    wrapped = ortfx.ORTModule(Warns(), options=STRICT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped(torch.randn(3, 4)).sum().backward()
        assert ortfx.stats(wrapped).exports == 1
        with pytest.raises(UserWarning, match="the forward's own"):
            wrapped(torch.randn(3, 4), loud=True)


def test_warnings_torchs_passes_raise_in_cpp_do_not_break_the_export() -> None:
    """A warning torch's C++ raises inside a pass ortfx calls through its own code (the shape
    inference that ortfx scopes: "Constant folding - Only steps=1 can be constant folded" for a
    slice with a step, as GPT-2's attention mask has) is the exporter's, not the forward's:
    under warnings-as-errors the export still succeeds, with eager's values."""
    import warnings

    from tests.models import tiny_gpt2

    model = tiny_gpt2()
    wrapped = ortfx.ORTModule(model, options=STRICT)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = wrapped(input_ids=ids, labels=ids).loss
    assert ortfx.stats(wrapped).exports == 1
    torch.testing.assert_close(out, model(input_ids=ids, labels=ids).loss, rtol=0, atol=1e-5)


def test_backward_hooks_inside_the_module_are_refused_not_skipped() -> None:
    """A full backward hook on an inner module never ran under ORT (gradients off by 10x,
    silently): strict refuses with the typed error naming the module; the default policy runs
    PyTorch, gradients equal eager's (exactly) and the hook runs; a call without grad still
    runs in ORT."""
    from ortfx.errors import BACKWARD_HOOKS

    def times_ten(module: nn.Module, grad_in: Any, grad_out: Any) -> Any:
        return (grad_in[0] * 10,)

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    strict = ortfx.ORTModule(copy.deepcopy(eager), options=STRICT)
    default = ortfx.ORTModule(copy.deepcopy(eager))
    for model in (eager, strict.module, default.module):
        model[1].register_full_backward_hook(times_ten)
    x = torch.randn(3, 4)
    with pytest.raises(ortfx.OrtfxTorchModelError) as info:
        strict(x).sum().backward()
    assert str(info.value) == BACKWARD_HOOKS.format(modules="'1' (Linear)")
    eager(x).sum().backward()
    default(x).sum().backward()
    assert torch.equal(eager[0].weight.grad, default.module[0].weight.grad)
    with torch.no_grad():
        assert torch.allclose(strict(x), eager(x), atol=1e-6)


def test_a_users_dispatch_mode_sees_the_ops_of_that_call() -> None:
    """Under FlopCounterMode the call runs in PyTorch (the mode counts what eager counts),
    with one WARNING; later calls run in ORT again; ``with torch.device(...)`` is no such mode."""
    from torch.utils.flop_counter import FlopCounterMode

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    wrapped = ortfx.ORTModule(copy.deepcopy(model))
    x = torch.randn(4, 8)
    counted = []
    for m in (model, wrapped):
        counter = FlopCounterMode(display=False)
        with counter:
            m(x).sum().backward()
        counted.append(counter.get_total_flops())
    assert counted[0] == counted[1] > 0
    wrapped(x).sum().backward()
    with torch.device("cpu"):
        wrapped(x)
    stats = ortfx.stats(wrapped)
    assert (stats.exports, stats.fallback_calls, stats.calls) == (1, 1, 3)


def test_stats_count_every_call_of_concurrent_threads() -> None:
    """Four threads' calls on one wrapper: their commits are rebased onto each other, counts
    added (201 calls), gradients summed as eager's (1e-5)."""
    torch.manual_seed(0)
    eager = nn.Linear(4, 4)
    wrapped = ortfx.ORTModule(copy.deepcopy(eager))
    x = torch.randn(2, 4)
    wrapped(x).sum().backward()

    def work() -> None:
        for _ in range(50):
            wrapped(x).sum().backward()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ortfx.stats(wrapped).calls == 201
    eager(x).sum().backward()
    assert eager.weight.grad is not None
    assert torch.allclose(wrapped.module.weight.grad, eager.weight.grad * 201, rtol=1e-5)


class ImplicitSoftmax(nn.Module):
    """``F.softmax`` without ``dim`` warns (a Python warning on the caller's line)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softmax(self.lin(x))


def _raises_under(build: Any, module: str) -> str | None:
    import warnings

    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.filterwarnings("error", category=UserWarning, module=module)
        try:
            build()(torch.randn(2, 4))
        except UserWarning as e:
            return str(e)
    return None


@pytest.mark.parametrize("module", [__name__, "ortfx", "torch"])
def test_a_warning_the_forward_raises_while_exported_meets_the_filters_as_in_eager(
    module: str,
) -> None:
    """Filters by module see the forward's line and module during the export, as in eager
    (ortfx's watch sits between the forward and each op: the warning named ortfx's file)."""
    eager = _raises_under(ImplicitSoftmax, module)
    got = _raises_under(lambda: ortfx.ORTModule(ImplicitSoftmax(), options=STRICT), module)
    assert got == eager
    assert (eager is not None) == (module == __name__)


def test_torchs_shape_inference_pass_is_scoped_to_ortfxs_own_export() -> None:
    """ortfx gives torch's whole-graph ONNX shape inference no large weight values during its
    own export (memory, issue 31): another thread calling the pass meanwhile gets exactly what
    it passes, the pass is what it was again afterwards, and a replacement someone installs
    meanwhile stays."""
    name = SHAPE_INFERENCE
    original = getattr(torch._C, name)
    received: list[dict[str, tuple[int, ...]]] = []

    class Looks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(300, 300)  # a 90,000-element weight: over the limit

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not received:  # while traced, another thread runs the pass on its own graph

                def call() -> None:
                    with contextlib.suppress(RuntimeError):
                        getattr(torch._C, name)(torch._C.Graph(), {"w": torch.zeros(300, 300)}, 17)

                spy = threading.Thread(target=call)
                spy.start()
                spy.join()
            return self.lin(x)

    with shape_inference_recorded() as seen:
        received = seen  # the forward above looks at it while traced
        ortfx.ORTModule(Looks(), options=STRICT)(torch.randn(2, 300)).sum().backward()
    assert received[0] == {"w": (300, 300)}  # the other thread's call, whole
    # ortfx's own export, twice (torch runs the pass twice): the small bias only.
    assert received[1:] == [{"module.lin.bias": (300,)}] * 2, received

    def users(graph: Any, params: dict[str, Any], opset: int) -> Any:
        return original(graph, params, opset)

    class Replaces(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            setattr(torch._C, name, users)
            return self.lin(x)

    try:
        ortfx.ORTModule(Replaces(), options=STRICT)(torch.randn(2, 3))
        assert getattr(torch._C, name) is users
    finally:
        setattr(torch._C, name, original)


class Normalized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(16, 16), nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


def test_two_threads_calling_one_wrapper_lose_no_buffer_update() -> None:
    """Two threads calling one BatchNorm wrapper at once, first calls included: every call's
    running-statistics update lands, as in eager (each run read the old buffers and the last
    copy back won: 39 of 41 updates; the first calls' export put its trace's values back over
    the other thread's update)."""
    torch.manual_seed(0)
    model = Normalized()
    reference = copy.deepcopy(model)
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(8, 16)
    start = threading.Barrier(2)

    def calls() -> None:
        start.wait()
        for _ in range(10):
            wrapped(x)

    threads = [threading.Thread(target=calls) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for _ in range(20):
        reference(x)
    assert int(model.bn.num_batches_tracked) == 20
    # The same batch each time: the statistics do not depend on the calls' order.
    assert torch.allclose(model.bn.running_mean, reference.bn.running_mean, atol=1e-6)
    assert torch.allclose(model.bn.running_var, reference.bn.running_var, atol=1e-6)


def test_a_wrapper_inside_another_loses_no_buffer_update_across_threads() -> None:
    """An outer wrapper whose graph updates an inner wrapper's BatchNorm, called in one thread
    while the inner wrapper is called in another: the locks are the buffers' own, so every
    update lands (a lock per wrapper let the two write-backs race: 43-57 of 62)."""
    torch.manual_seed(0)
    inner = ortfx.ORTModule(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.bn = inner, nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.inner(x))

    outer = ortfx.ORTModule(Outer())

    def run(module: nn.Module, calls: int) -> None:
        for _ in range(calls):
            with torch.no_grad():
                module(torch.randn(3, 4))

    run(outer, 1)
    run(inner, 1)
    threads = [threading.Thread(target=run, args=(m, 30)) for m in (outer, inner)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    counts = [int(b) for n, b in inner.named_buffers() if n.endswith("num_batches_tracked")]
    assert counts == [62]
    assert int(outer.bn.num_batches_tracked) == 31
