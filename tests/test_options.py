"""Options, environment variables, DebugOptions, logging, saved models and fallback policy."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch
from torch import nn

import ortfx
from ortfx import options as options_module
from ortfx.options import FallbackPolicy, LogLevel, Options
from tests import models
from tests.models import max_diff


@pytest.fixture(autouse=True)
def _fresh_env_warnings() -> None:
    options_module._warned.clear()


@pytest.mark.parametrize(
    ("variable", "raw", "field", "expected"),
    [
        ("ORTMODULE_LOG_LEVEL", "info", "log_level", LogLevel.INFO),
        ("ORTMODULE_LOG_LEVEL", "VERBOSE", "log_level", LogLevel.VERBOSE),
        (
            "ORTMODULE_FALLBACK_POLICY",
            "FALLBACK_DISABLE",
            "fallback_policy",
            FallbackPolicy.DISABLE,
        ),
        (
            "ORTMODULE_FALLBACK_POLICY",
            "FALLBACK_UNSUPPORTED_DATA|FALLBACK_UNSUPPORTED_DEVICE",
            "fallback_policy",
            FallbackPolicy.UNSUPPORTED_DATA | FallbackPolicy.UNSUPPORTED_DEVICE,
        ),
        ("ORTMODULE_FALLBACK_RETRY", "0", "fallback_retry", False),
        ("ORTMODULE_FALLBACK_RETRY", "true", "fallback_retry", True),
        ("ORTMODULE_ONNX_OPSET_VERSION", "18", "opset_version", 18),
        ("ORTMODULE_MEMORY_OPT_LEVEL", "1", "memory_opt_level", 1),
        ("ORTMODULE_MEMORY_OPT_CONFIG", "Gelu+:1:-1", "memory_opt_config", "Gelu+:1:-1"),
        ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "0", "enable_compute_optimizer", False),
        ("ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT", "1", "deepcopy_before_export", True),
        ("ORTFX_EXPORTER", "dynamo", "exporter", "dynamo"),
        ("ORTFX_INTRA_OP_THREADS", "3", "intra_op_threads", 3),
        ("ORTFX_ALLOW_SPINNING", "1", "allow_spinning", True),
        ("ORTFX_RELEASE_TORCH_THREADS", "0", "release_torch_threads", False),
        ("ORTFX_CPU_MEM_ARENA", "0", "cpu_mem_arena", False),
    ],
)
def test_environment_variables_set_options(
    variable: str, raw: str, field: str, expected: Any
) -> None:
    assert getattr(Options.from_env(environ={variable: raw}), field) == expected


def test_save_path_from_environment(tmp_path: Any) -> None:
    assert Options.from_env(environ={"ORTMODULE_SAVE_ONNX_PATH": str(tmp_path)}).save_path == str(
        tmp_path
    )


@pytest.mark.parametrize(
    ("variable", "raw", "choices"),
    [
        ("ORTMODULE_LOG_LEVEL", "LOUD", "VERBOSE, DEVINFO, INFO, WARNING, ERROR, FATAL"),
        (
            "ORTMODULE_FALLBACK_POLICY",
            "SOMETIMES",
            "FALLBACK_DISABLE | FALLBACK_UNSUPPORTED_DEVICE | FALLBACK_UNSUPPORTED_DATA | "
            "FALLBACK_UNSUPPORTED_TORCH_MODEL | FALLBACK_UNSUPPORTED_ONNX_MODEL | "
            "FALLBACK_BAD_INITIALIZATION (joined by |)",
        ),
        ("ORTMODULE_FALLBACK_RETRY", "maybe", "1/0, true/false"),
        ("ORTMODULE_ONNX_OPSET_VERSION", "11", "an int from 12 to 21"),
        ("ORTMODULE_ONNX_OPSET_VERSION", "22", "an int from 12 to 21"),
        ("ORTMODULE_MEMORY_OPT_LEVEL", "3", "0, 1 or 2"),
        ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER", "yes please", "1 or 0"),
        ("ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT", "2", "1 or 0"),
        ("ORTFX_EXPORTER", "onnxscript", "auto, torchscript, dynamo"),
        ("ORTFX_INTRA_OP_THREADS", "0", "a positive int"),
        ("ORTFX_ALLOW_SPINNING", "fast", "1 or 0"),
        ("ORTFX_CPU_MEM_ARENA", "maybe", "1 or 0"),
    ],
)
def test_invalid_environment_values_warn_once_and_keep_the_default(
    variable: str, raw: str, choices: str
) -> None:
    with pytest.warns(ortfx.OrtfxWarning) as record:
        got = Options.from_env(environ={variable: raw})
        Options.from_env(environ={variable: raw})  # the same value again: no second warning
    assert got == Options()
    assert [str(w.message) for w in record] == [
        f"ignoring {variable}={raw!r}: expected {choices}; keeping the default."
    ]


def test_unwritable_save_path_from_environment_raises_naming_variable_and_path(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = str(tmp_path / "missing")
    with pytest.raises(OSError, match="does not exist") as info:
        Options.from_env(environ={"ORTMODULE_SAVE_ONNX_PATH": missing})
    assert str(info.value) == (
        f"ORTMODULE_SAVE_ONNX_PATH={missing!r}: cannot save ONNX models to {missing!r}: it does "
        "not exist. Pass an existing, writable directory as DebugOptions(save_path=...) or "
        "ORTMODULE_SAVE_ONNX_PATH (or create it first)."
    )
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", missing)
    with pytest.raises(OSError, match="ORTMODULE_SAVE_ONNX_PATH="):
        ortfx.ORTModule(models.MLP(), ortfx.DebugOptions(save_onnx=True, onnx_prefix="m"))


@pytest.mark.parametrize("save_onnx", [False, True])
def test_unwritable_save_path_raises_at_construction(tmp_path: Any, save_onnx: bool) -> None:
    missing, a_file = str(tmp_path / "missing"), tmp_path / "file.onnx"
    a_file.write_text("")
    with pytest.raises(OSError, match="does not exist") as info:
        ortfx.DebugOptions(save_onnx=save_onnx, onnx_prefix="m", save_path=missing)
    assert str(info.value).startswith(f"cannot save ONNX models to {missing!r}: it does not exist.")
    with pytest.raises(OSError, match=r"it is not a directory\. Pass an existing, writable"):
        Options(save_onnx=save_onnx, onnx_prefix="m", save_path=str(a_file))


def test_debug_options_validation_messages(tmp_path: Any) -> None:
    with pytest.raises(TypeError) as info:
        ortfx.DebugOptions(log_level="INFO")  # type: ignore[arg-type]
    assert str(info.value) == (
        "'log_level' must be an ortfx.LogLevel (got 'INFO' that is a str); use e.g. ortfx.LogLevel.INFO."
    )
    with pytest.raises(TypeError) as info:
        ortfx.DebugOptions(save_onnx=True, onnx_prefix=3)  # type: ignore[arg-type]
    assert str(info.value) == (
        "'onnx_prefix' must be a str (got 3 that is a int); it starts the names of the saved ONNX files."
    )
    with pytest.raises(ValueError, match=r"^save_onnx=True needs a non-empty onnx_prefix"):
        ortfx.DebugOptions(save_onnx=True)
    missing = str(tmp_path / "missing")
    with pytest.raises(OSError, match="does not exist") as os_info:
        ortfx.DebugOptions(save_onnx=True, onnx_prefix="m", save_path=missing)
    assert str(os_info.value) == (
        f"cannot save ONNX models to {missing!r}: it does not exist. Pass an existing, writable "
        "directory as DebugOptions(save_path=...) or ORTMODULE_SAVE_ONNX_PATH (or create it first)."
    )


def test_debug_options_must_be_debug_options() -> None:
    with pytest.raises(TypeError, match=r"^debug_options must be an ortfx.DebugOptions, got dict"):
        ortfx.ORTModule(models.MLP(), {"log_level": "INFO"})  # type: ignore[arg-type]


def test_saved_onnx_files_per_mode(tmp_path: Any) -> None:
    debug = ortfx.DebugOptions(save_onnx=True, onnx_prefix="mlp", save_path=str(tmp_path))
    wrapped = ortfx.ORTModule(models.MLP(), debug)
    x = torch.randn(2, 8)
    wrapped(x).sum().backward()
    wrapped.eval()
    with torch.no_grad():
        wrapped(x)
    assert sorted(os.listdir(tmp_path)) == [
        "mlp_execution_model_inference.onnx",
        "mlp_execution_model_training.onnx",
        "mlp_optimized_inference.onnx",
        "mlp_optimized_pre_grad_training.onnx",
        "mlp_optimized_training.onnx",
        "mlp_post_processed_inference.onnx",
        "mlp_post_processed_training.onnx",
        "mlp_torch_exported_inference.onnx",
        "mlp_torch_exported_training.onnx",
    ]
    import onnx

    for name in os.listdir(tmp_path):
        onnx.load(str(tmp_path / name))  # each is a readable ONNX model


def test_environment_log_level_overrides_the_constructor(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "ERROR")
    wrapped = ortfx.ORTModule(models.MLP(), ortfx.DebugOptions(log_level=LogLevel.INFO))
    assert ortfx.options_of(wrapped).log_level == LogLevel.ERROR
    with caplog.at_level(logging.DEBUG, logger="ortfx"):
        wrapped(torch.randn(2, 8)).sum().backward()
    assert [r for r in caplog.records if r.name == "ortfx"] == []


def test_info_logs_transition_costs_and_feature_table(caplog: pytest.LogCaptureFixture) -> None:
    wrapped = ortfx.ORTModule(models.MLP(), ortfx.DebugOptions(log_level=LogLevel.INFO))
    with caplog.at_level(logging.DEBUG, logger="ortfx"):
        wrapped(torch.randn(2, 8)).sum().backward()
        wrapped(torch.randn(3, 8)).sum().backward()
    messages = [r.getMessage() for r in caplog.records if r.name == "ortfx"]
    assert len(messages) == 3  # one transition, one session line, one feature table
    assert messages[0].startswith(
        "export: module was never exported, now called (first call) [export "
    )
    assert messages[1].startswith("training session ready [one-time cost: export ")
    assert "gradient build" in messages[1] and "session" in messages[1]
    table = messages[2]
    assert table.startswith("features:\n")
    for feature in (
        "Exporter",
        "Compute optimizer",
        "Memory optimizer",
        "Fallback to PyTorch",
        "Save ONNX",
        "Deterministic compute",
        "Threads",
        "torch's OpenMP threads",
    ):
        assert f"  {feature}" in table
    assert "ORTMODULE_FALLBACK_POLICY" in table


@pytest.mark.parametrize(
    ("policy", "release", "threads", "shown"),
    [
        ("", True, 2, "released while ORT runs"),
        ("", False, 2, "spinning (release off)"),
        ("passive", True, 2, "sleeping (OMP_WAIT_POLICY=PASSIVE)"),
        ("", True, 1, "spinning (one thread: nothing to release)"),
    ],
)
def test_feature_table_says_what_happens_to_torchs_openmp_threads(
    monkeypatch: pytest.MonkeyPatch, policy: str, release: bool, threads: int, shown: str
) -> None:
    """With several threads, spinning OpenMP workers of torch take ORT's cores: the table
    says whether ortfx releases them, and how to change it."""
    from ortfx.runtime import logs, openmp

    assert openmp.available()  # torch's Linux CPU wheel: libgomp, OpenMP 4.5 API + 5.0 pause
    monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    options = ortfx.Options(intra_op_threads=threads, release_torch_threads=release)
    table = logs.feature_table(options, "torchscript", deterministic=False)
    row = next(line for line in table.splitlines() if "OpenMP" in line)
    assert shown in row
    assert "ORTFX_RELEASE_TORCH_THREADS=0/1" in row
    assert openmp.wanted(options, threads) == (shown == "released while ORT runs")


class Odd:
    """Not a supported leaf or container."""


class TakesAnything(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, extra: Any = None, use_i0: bool = False) -> torch.Tensor:
        y = self.lin(x)
        return torch.special.i0(y) if use_i0 else y  # i0: no ONNX export


X = torch.randn(3, 4)


@pytest.mark.parametrize(
    ("call", "flag", "error"),
    [
        ({"extra": Odd()}, FallbackPolicy.UNSUPPORTED_DATA, ortfx.OrtfxIOError),
        ({"use_i0": True}, FallbackPolicy.UNSUPPORTED_ONNX_MODEL, ortfx.OrtfxExportError),
    ],
)
def test_fallback_under_each_policy(
    call: dict[str, Any],
    flag: FallbackPolicy,
    error: type[Exception],
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = TakesAnything()
    # Allowed: the result is exactly PyTorch's, with a WARNING naming the exception and the fix.
    wrapped = ortfx.ORTModule(model, options=Options(fallback_policy=flag))
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        out = wrapped(X, **call)
    assert torch.equal(out, model(X, **call))
    warning = [r.getMessage() for r in caplog.records if r.name == "ortfx"]
    assert len(warning) == 1
    assert warning[0].startswith(
        f"falling back to PyTorch (policy {flag.name} allows it): {error.__name__}: "
    )
    assert "FallbackPolicy.DISABLE" in warning[0]
    stats = ortfx.stats(wrapped)
    assert stats.fallback is not None and stats.fallback.startswith(error.__name__)
    assert stats.fallback_calls == 1
    # The next ORT-able call runs in ORT again, and the stats say fallback is no longer active.
    assert max_diff(wrapped(X), model(X)) <= 1e-6
    assert ortfx.stats(wrapped).fallback is None
    # Disabled, or a policy without this flag: the typed error reaches the user.
    for policy in (FallbackPolicy.DISABLE, FallbackPolicy.UNSUPPORTED_DEVICE):
        strict = ortfx.ORTModule(model, options=Options(fallback_policy=policy))
        with pytest.raises(error):
            strict(X, **call)


def test_data_parallel_falls_back_for_good_under_the_default_policy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inner = models.MLP()
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        wrapped = ortfx.ORTModule(nn.DataParallel(inner))
    x = torch.randn(2, 8)
    assert torch.equal(wrapped(x), inner(x))
    assert "UNSUPPORTED_TORCH_MODEL" in caplog.records[0].getMessage()
    assert "Every later call runs in PyTorch" in caplog.records[0].getMessage()
    assert ortfx.stats(wrapped).fallback_calls == 1 and ortfx.stats(wrapped).exports == 0


def test_retry_tries_ort_again_for_a_new_schema_and_not_for_the_failed_one() -> None:
    model = TakesAnything()
    wrapped = ortfx.ORTModule(model)
    wrapped(X, use_i0=True)  # export fails: fallback for this schema
    wrapped(X, use_i0=True)  # same schema: straight to PyTorch, no new export attempt
    wrapped(X)  # new schema: ORT again
    s = ortfx.stats(wrapped)
    assert (s.exports, s.fallback_calls, s.calls) == (1, 2, 3)
    assert [t.kind for t in ortfx.explain(wrapped)] == ["fallback", "export"]


def test_without_retry_every_later_call_runs_in_pytorch() -> None:
    model = TakesAnything()
    wrapped = ortfx.ORTModule(model, options=Options(fallback_retry=False))
    wrapped(X, use_i0=True)
    assert torch.equal(wrapped(X), model(X))
    s = ortfx.stats(wrapped)
    assert (s.exports, s.fallback_calls) == (0, 2)


def test_without_the_cpu_memory_arena_training_matches() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    wrapped = ortfx.ORTModule(models.MLP(), options=Options(cpu_mem_arena=False))
    from ortfx.runtime import events
    from tests.models import check_parity

    with events.recording() as seen:
        check_parity(wrapped.module, (x,), loss=lambda y: y.square().sum(), wrapped=wrapped)
    runners = [args[1] for name, args in seen if name == "session" and args[0] == "training"]
    assert len(runners) == 1
    assert runners[0].session.get_session_options().enable_cpu_mem_arena is False


def _levels(seen: list[tuple[str, tuple[Any, ...]]], kind: str) -> list[Any]:
    return [
        args[1].session.get_session_options().graph_optimization_level
        for name, args in seen
        if name == "session" and args[0] == kind
    ]


def test_training_sessions_skip_ort_graph_optimizations_only_where_nothing_needs_them() -> None:
    """The gradient builder already optimized the graph: a plain CPU training session skips
    ORT's own passes (0.1 s of session creation, no step time). Memory plans (recompute) and
    memory-efficient gradients keep them, and so do inference sessions."""
    import onnxruntime as ort

    from ortfx.runtime import events
    from tests.models import check_parity

    level = ort.GraphOptimizationLevel
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    wrapped = ortfx.ORTModule(models.MLP())
    with events.recording() as seen:
        check_parity(wrapped.module, (x,), loss=lambda y: y.square().sum(), wrapped=wrapped)
        with torch.no_grad():
            wrapped(x)
    assert _levels(seen, "training") == [level.ORT_DISABLE_ALL]
    assert _levels(seen, "inference") == [level.ORT_ENABLE_ALL]

    block = models.GPTBlock()
    tokens = torch.randn(2, 16, 32)
    # Plans are discovered on, and applied to, the graph ORT's passes make (their names follow
    # the fused ops): the probe sessions keep the passes too, at level 1 and for memory_report.
    asked: list[Any] = []
    events.session_option_edits.append(lambda so, training: asked.append(so))
    try:
        recompute = ortfx.ORTModule(block, options=Options(memory_opt_level=1))
        recompute(tokens).sum().backward()
        assert any(plan.enabled for plan in ortfx.memory_report(recompute))
        plain = ortfx.ORTModule(models.GPTBlock())
        plain(tokens).sum().backward()
        ortfx.memory_report(plain)  # its own probe session
    finally:
        events.session_option_edits.pop()
    assert [so.graph_optimization_level for so in asked] == [
        level.ORT_ENABLE_ALL,  # level 1: discovery
        level.ORT_ENABLE_ALL,  # level 1: the plans applied
        level.ORT_DISABLE_ALL,  # plain training
        level.ORT_ENABLE_ALL,  # memory_report's probe
    ]

    efficient = ortfx.ORTModule(
        models.MLP(), options=Options(enable_mem_efficient_grad_management=True)
    )
    with events.recording() as seen:
        efficient(x).sum().backward()
    assert _levels(seen, "training") == [level.ORT_ENABLE_ALL]


def test_cpu_sessions_share_one_arena_unless_the_arena_is_off() -> None:
    """Training and inference sessions allocate from one arena in ORT's environment (an eval
    run reuses the training run's free blocks); ``cpu_mem_arena=False`` keeps them off it."""
    from ortfx.runtime import events

    def entry(runner: Any) -> str | None:
        try:
            value: str = runner.session.get_session_options().get_session_config_entry(
                "session.use_env_allocators"
            )
        except RuntimeError:  # ORT: no such entry
            return None
        return value

    def entries(wrapped: Any) -> list[str | None]:
        x = torch.randn(4, 8, requires_grad=True)
        with events.recording() as seen:
            wrapped(x).sum().backward()
            with torch.no_grad():
                wrapped(x)
        return [entry(args[1]) for name, args in seen if name == "session"]

    assert entries(ortfx.ORTModule(models.MLP())) == ["1", "1"]
    assert entries(ortfx.ORTModule(models.MLP(), options=Options(cpu_mem_arena=False))) == [
        None,
        None,
    ]


def _run_script(code: str, *argv: str) -> list[str]:
    """Run ``code`` in a fresh interpreter from the repository root; its stdout lines."""
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()


_ALLOCATOR_ORDER = """
import sys
import onnxruntime as ort
import torch
import ortfx
from ortfx.runtime import events
from tests import models
from tests.models import check_parity

info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
def register():
    try:
        ort.create_and_register_allocator(info, ort.OrtArenaCfg({"arena_extend_strategy": 1}))
        return "registered"
    except RuntimeError as e:
        return "refused" if "already been registered" in str(e) else str(e)

user_first = sys.argv[1] == "user-first"
if user_first:
    print(register())
torch.manual_seed(0)
x = torch.randn(4, 8, requires_grad=True)
wrapped = ortfx.ORTModule(models.MLP())
with events.recording() as seen:
    check_parity(wrapped.module, (x,), loss=lambda y: y.square().sum(), wrapped=wrapped)
(runner,) = [args[1] for name, args in seen if name == "session"]
print(runner.session.get_session_options().get_session_config_entry("session.use_env_allocators"))
if not user_first:
    print(register())
"""


@pytest.mark.parametrize("order", ["user-first", "ortfx-first"])
def test_the_cpu_allocator_slot_with_a_user_allocator(order: str) -> None:
    """One CPU allocator can be registered in ORT's environment: a user's registered first
    serves ortfx's sessions (which train as in PyTorch); once ortfx has registered its arena,
    ORT refuses the user's."""
    lines = _run_script(_ALLOCATOR_ORDER, order)
    assert lines[-2:] == (["registered", "1"] if order == "user-first" else ["1", "refused"])


def test_sessions_keep_their_own_arenas_when_orts_environment_refuses_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ortfx.runtime import arena, events
    from ortfx.runtime.ort import ort

    def refuse(*args: Any) -> None:
        raise RuntimeError("no allocator for you")

    monkeypatch.setattr(arena, "_registered", False)
    monkeypatch.setattr(arena, "_failed", False)
    monkeypatch.setattr(ort, "create_and_register_allocator", refuse)
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    wrapped = ortfx.ORTModule(models.MLP())
    with (
        pytest.warns(ortfx.OrtfxWarning, match=r"could not register one CPU arena .*no allocator"),
        events.recording() as seen,
    ):
        out = wrapped(x).sum()
    out.backward()
    (runner,) = [args[1] for name, args in seen if name == "session"]
    with pytest.raises(RuntimeError):  # no such entry: the session's own arena
        runner.session.get_session_options().get_session_config_entry("session.use_env_allocators")
    assert torch.allclose(out, wrapped.module(x).sum(), atol=1e-6)


_ARENA_RETURNED = """
import gc
import torch
import ortfx
from ortfx.runtime import events

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))

shrunk = []
events.listen(lambda name, *args: shrunk.append(name) if name == "arena_shrunk" else None)
torch.manual_seed(0)
x = torch.randn(8192, 1024)  # 32 MB per activation: the arena grows by well over 100 MB
def model():
    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8))
before = rss()
a, b = ortfx.ORTModule(model()), ortfx.ORTModule(model())
for m in (a, b):
    m(x).square().sum().backward()
    with torch.no_grad():
        m.eval()(x)
grown = rss()
del a
gc.collect()
print("one left", len(shrunk))
del m, b
gc.collect()
import time
for _ in range(200):  # the shrink runs on a thread of its own, right after the collection
    if shrunk:
        break
    time.sleep(0.05)
print("none left", len(shrunk), grown - before, rss() - before)
"""


def test_the_shared_arena_gives_memory_back_when_the_last_model_is_gone() -> None:
    one_left, none_left = _run_script(_ARENA_RETURNED)[-2:]
    assert one_left == "one left 0"  # b's sessions still use the arena: nothing shrunk
    _, _, count, grown, kept = none_left.split()
    assert count == "1"
    assert int(grown) > 100, none_left
    assert int(kept) < int(grown) // 2, none_left  # most of what the steps took came back


_FORK_WHILE_LOCKED = """
import os
import threading
import ortfx
from ortfx.runtime import arena

held, release = threading.Event(), threading.Event()
def hold():
    with arena._lock:
        held.set()
        release.wait()
threading.Thread(target=hold, daemon=True).start()
held.wait()
pid = os.fork()
if pid == 0:
    os._exit(0 if arena._lock.acquire(timeout=5) and arena._live == 0 else 1)
_, status = os.waitpid(pid, 0)
release.set()
print("child", os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_does_not_inherit_the_arenas_lock_held() -> None:
    """A DataLoader worker forked while another thread holds the arena's lock (a shrink) would
    hang on its first session; the child gets a fresh lock and count."""
    assert _run_script(_FORK_WHILE_LOCKED)[-1] == "child 0"
