"""Building ORT runners for a cache entry: training runners (per input sizes where the gradient
needs them, with the memory optimizer's plans), inference runners, and ``memory_report``.

Every graph a session gets comes out of a named pipeline of :mod:`ortfx.passes`.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from ortfx import memory, passes
from ortfx.errors import (
    NO_TRAINING_GRAPH,
    STATIC_SIZES_SESSION,
)
from ortfx.keys import Call, GradState, Reason, Transition
from ortfx.memory import MemoryPlan
from ortfx.model_info import InputKind, PostExportProcessedModelInfo
from ortfx.runtime import events, logs, memgrad
from ortfx.runtime.inference import InferenceRunner, open_inference
from ortfx.runtime.records import Compiled, Shell
from ortfx.runtime.training import TrainingRunner, open_training
from ortfx.transitions import replace_payload

# Training sessions kept per graph whose gradient needs concrete sizes (one per input size).
SIZED_RUNNERS = 4


def said_ignored(shell: Shell) -> bool:
    options = shell.options
    return bool(options.memory_opt_level and options.memory_opt_config)


def _input_dims(
    info: PostExportProcessedModelInfo, leaves: list[Any]
) -> tuple[tuple[str, int], ...]:
    """Each user input's dim names (as exported: ``{name}_dim{d}``) with their current sizes."""
    return tuple(
        (f"{spec.name}_dim{d}", size)
        for spec in info.inputs
        if spec.kind is InputKind.USER
        for d, size in enumerate(leaves[spec.source].shape)  # type: ignore[index]
    )


def session_seed(shell: Shell) -> int:
    """The seed of the next session's random nodes: torch's CPU generator state, read (a draw
    would shift the user's stream), and how many sessions this wrapper made before (a re-process
    must not replay the masks of earlier steps). See docs/runtime.md, Dropout."""
    state = torch.random.get_rng_state().numpy().tobytes()
    return passes.session_seed(state, shell.state.stats.sessions)


def _session_pipeline(
    grad: GradState, *, seed: int, symbolic: bool, sizes: tuple[tuple[int, ...], ...] = ()
) -> passes.Pass:
    pipeline = passes.for_session(
        frozenset(i for i, rg in enumerate(grad.inputs) if rg),
        frozenset(n for n, rg in zip(grad.param_names, grad.params, strict=True) if rg),
        seed=seed,
        symbolic=symbolic,
        sizes=sizes,
        feed_params_through=memgrad.FUNCTION_NAME if grad.mem_efficient_grad else None,
    )
    return passes.chain(pipeline, *events.session_passes) if events.session_passes else pipeline


def training_for_sizes(
    shell: Shell,
    compiled: Compiled,
    device: torch.device,
    call: Call,
    leaves: list[Any],
    sizes: tuple[tuple[int, ...], ...],
) -> Compiled:
    """The entry with a training runner for these input sizes: the dynamic one (``sizes``
    empty), one kept from an earlier call of the same sizes, or a new one (logged)."""
    if not sizes:
        return _with_training_runner(shell, compiled, device, call, leaves, sizes)
    kept = dict(compiled.sized)
    if sizes in kept:
        return attrs.evolve(compiled, training=kept[sizes], sizes=sizes)
    _log_sized_session(shell, compiled, call, sizes)
    built = _with_training_runner(shell, compiled, device, call, leaves, sizes)
    assert built.training is not None
    cache = (*((k, r) for k, r in compiled.sized if k != sizes), (sizes, built.training))
    return attrs.evolve(built, sizes=sizes, sized=cache[-SIZED_RUNNERS:])


def _log_sized_session(
    shell: Shell, compiled: Compiled, call: Call, sizes: tuple[tuple[int, ...], ...]
) -> None:
    """One transition line: which input sizes the new training session is built for, and why."""
    info = compiled.info
    why = STATIC_SIZES_SESSION.format(ops=", ".join(info.static_size_ops))
    paths = [
        info.input_schema.paths[spec.source]  # type: ignore[index]
        for spec in info.inputs
        if spec.kind is InputKind.USER
    ]
    before = compiled.sizes or (None,) * len(sizes)
    reasons = tuple(
        Reason(path, "any size" if was is None else str(list(was)), str(list(now)), why)
        for path, was, now in zip(paths, before, sizes, strict=True)
        if was != now
    )
    line = str(Transition(shell.state.stats.calls, "new session", reasons))
    logs.transition(shell.log, line, "")


def _with_training_runner(
    shell: Shell,
    compiled: Compiled,
    device: torch.device,
    call: Call,
    leaves: list[Any],
    sizes: tuple[tuple[int, ...], ...] = (),
) -> Compiled:
    options = shell.options
    level = options.memory_opt_level
    plans = memory.parse_config(options.memory_opt_config) if level == 0 else ()
    info = _session_pipeline(
        call.grad, seed=session_seed(shell), symbolic=bool(level or plans), sizes=sizes
    )(compiled.info)
    prefix = logs.save_prefix(options)
    dims = _input_dims(compiled.info, leaves)

    def build(plans_on: tuple[str, ...] | None, probe: str) -> TrainingRunner:
        return open_training(
            info,
            device,
            options,
            deterministic=call.session.deterministic,
            save_prefix=prefix,
            memory=None if plans_on is None else (probe, plans_on),
            mode="training" if call.key.training else "inference",
            probe=bool(level or plans),
        )

    runner = build(None, "1:0")
    report = compiled.memory
    if level or plans:
        # Discover the plans of this graph, choose per level (or the user's), rebuild.
        probe = "1:1" if level else "1:0"
        discovered = runner.memory_stat(probe)
        enabled = memory.select(discovered, level, plans)
        if enabled:
            runner = build(enabled, probe)
        report = memory.report(discovered, enabled, dict(dims))
        logs.memory_plans(
            shell.log,
            options,
            memory.render(report, level),
            discovered,
            plans,
            say_ignored=said_ignored(shell) and "memory config ignored" not in shell.said,
        )
    if runner.compute_optimizer_failure:
        logs.compute_optimizer_failed(shell.log, runner.compute_optimizer_failure)
    if options.enable_mem_efficient_grad_management:
        logs.restricted_backwards(shell.log)
    built = attrs.evolve(compiled, training=runner, memory=report, dims=dims)
    _log_ready(shell, "training", built, runner, call)
    return built


def with_inference_runner(
    shell: Shell, compiled: Compiled, device: torch.device, call: Call
) -> Compiled:
    info = passes.for_inference(session_seed(shell))(compiled.info)
    runner = open_inference(
        info,
        device,
        shell.options,
        deterministic=call.session.deterministic,
        save_prefix=logs.save_prefix(shell.options),
    )
    built = attrs.evolve(compiled, inference=runner)
    _log_ready(shell, "inference", built, runner, call)
    return built


def _log_ready(
    shell: Shell,
    kind: str,
    compiled: Compiled,
    runner: TrainingRunner | InferenceRunner,
    call: Call,
) -> None:
    events.emit("session", kind, runner)
    timings = attrs.evolve(
        compiled.timings,
        gradient_build=runner.gradient_build_seconds,
        session=runner.session_seconds,
    )
    logs.runner_ready(
        shell.log,
        kind,
        timings.render(),
        shell.options,
        call.key.options.exporter,
        call.session.deterministic,
    )


def memory_report(shell: Shell) -> tuple[tuple[MemoryPlan, ...], Shell]:
    """The recompute plans of the most recent training graph, discovered on demand (a probe
    session is built and dropped); the shell keeps the report for next time."""
    for entry in reversed(shell.state.entries):
        compiled = entry.payload
        if compiled.training is None:
            continue
        if compiled.memory is not None:
            return compiled.memory, shell
        # a probe, never run: its seeds do not matter
        info = _session_pipeline(entry.grad, seed=0, symbolic=True, sizes=compiled.sizes)(
            compiled.info
        )
        probe = open_training(
            info,
            torch.device(entry.session.device),
            shell.options,
            deterministic=entry.session.deterministic,
            probe=True,
        )
        report = memory.report(probe.memory_stat("1:0"), (), dict(compiled.dims))
        state = replace_payload(shell.state, entry.key, attrs.evolve(compiled, memory=report))
        return report, attrs.evolve(shell, state=state)
    raise RuntimeError(NO_TRAINING_GRAPH)
