"""Running a decided call's graph in ORT, and the checks around the run.

A runner is built if the entry has none for these sizes (:mod:`ortfx.runtime.runners`); the
graph runs through the autograd bridge (training) or an inference session; then the outputs are
checked once per runner (dtypes, empty outputs PyTorch would refuse) and the forward's in-place
updates are written back. An ORT failure is turned into PyTorch's own exception when PyTorch
raises too, or into a recovery (parameters changed behind the wrapper, the exporter switch).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, Final

import attrs
import torch

from ortfx import module_state
from ortfx.errors import (
    BACKWARD_HOOKS,
    INPUT_CHANGED_IN_PLACE,
    NO_GRADIENT_GRAPH,
    OUTPUT_DTYPE_CHANGED,
    PINNED_SIZES_CHANGED,
    VALUE_KEEPS_CHANGING,
    OrtfxExportError,
    OrtfxInitError,
    OrtfxIOError,
    OrtfxRuntimeError,
    OrtfxTorchModelError,
    OrtfxWarning,
)
from ortfx.export import (
    raise_if_pytorch_raises,
)
from ortfx.keys import Baked, Call, GuardHint
from ortfx.model_info import PostExportProcessedModelInfo
from ortfx.runtime import logs, watch
from ortfx.runtime.autograd import RunORT
from ortfx.runtime.records import Compiled, Outcome, Retry, Shell, invalidate
from ortfx.runtime.runners import said_ignored, training_for_sizes, with_inference_runner
from ortfx.runtime.watch import Tracked
from ortfx.schema import TensorSpec
from ortfx.transitions import (
    REPEATED_REEXPORT,
    ExportState,
    note_session,
    rekey,
    replace_payload,
)

# ---- execute: run the graph in ORT -------------------------------------------------------------


def execute(
    shell: Shell,
    module: torch.nn.Module,
    leaves: list[Any],
    tracked: Tracked,
    call: Call,
    compiled: Compiled,
    new_state: ExportState[Compiled],
    this_call: bool = False,
) -> Outcome:
    """Run ORT for a decided call; the shell to commit carries ``new_state``. ``this_call``:
    the graph was traced from this call, so its guards hold this call's values (as PyTorch
    computes them, which a run of ORT's may round otherwise): not checked."""
    repinned = _sizes_changed(shell, compiled, leaves, call)
    if repinned is not None:
        return repinned
    info = compiled.info
    if not info.output_names:
        # The forward returns no tensor and changes none (only Python values, or None): there
        # is nothing for ORT to compute, and its gradient builder refuses a graph without
        # outputs.
        return info.restore_outputs([], leaves), shell.with_state(new_state)
    if info.updates:
        _check_updated_inputs(info, leaves, call)
    # Runs that write the module's buffers back (BatchNorm's running statistics) are one at
    # a time per module: two threads' runs would each read the old values and the last copy
    # back would win (eager's in-place updates lose none).
    with _buffer_updates_serialized(tracked, info):
        inputs = info.construct_inputs_flat(leaves, tracked.named_tensors)
        needs_grad = call.grad.any_grad and torch.is_grad_enabled()
        built = compiled
        try:
            if needs_grad and not built.forward_only:
                sizes = info.user_sizes(leaves)
                if built.training is None:  # the entry's first backward: would hooks be skipped?
                    _refuse_backward_hooks(module)
                if built.training is None or built.sizes != sizes:
                    try:
                        built = training_for_sizes(
                            shell, built, tracked.device, call, leaves, sizes
                        )
                    except (OrtfxInitError, OrtfxExportError) as error:
                        if call.key.training:
                            raise
                        # Eval mode (a validation loop without no_grad): the forward is what the
                        # call needs; its outputs carry a backward that says why it cannot run.
                        built = attrs.evolve(built, forward_only=_first_line(error))
            if needs_grad and built.training is not None:
                if built.training.info.fed_params:  # memory-efficient gradients: own inputs
                    inputs = built.training.info.construct_inputs_flat(
                        leaves, tracked.named_tensors
                    )
                outputs = RunORT.apply(built.training, *inputs)  # type: ignore[no-untyped-call]
            else:
                if built.inference is None:
                    built = with_inference_runner(shell, built, tracked.device, call)
                assert built.inference is not None
                outputs = built.inference.run(inputs)
                if needs_grad:
                    # Anchored on an input that requires grad, so autograd records the outputs.
                    anchor = next(t for t in inputs if t.requires_grad)
                    outputs = NoGradientGraph.apply(  # type: ignore[no-untyped-call]
                        built.forward_only, anchor, *outputs
                    )
        except OrtfxRuntimeError as error:
            changed = watch.changed_tensor(compiled.fingerprint, watch.track(module).fingerprint())
            if changed is not None:
                # e.g. model.block.double() done on an inner module: ORT rejects the new dtype.
                return Retry(invalidate(shell, changed), changed)
            # A call PyTorch rejects too (a wrong width, a user check) is the input's fault: its
            # own exception, and no fallback or exporter switch for later, different calls.
            raise_if_pytorch_raises(module, leaves, call.key.schema, torch.is_grad_enabled())
            if info.guards:
                # A constant of the graph may be what it cannot run this call with (a length to
                # split into): another of the key's graphs, or a new export, computes it.
                hint = call.hint or GuardHint()
                baked = call.key.baked if call.key.baked is not None else info.baked
                failed = attrs.evolve(hint, failed=(*hint.failed, baked))
                return Retry(attrs.evolve(shell, fast=None), _first_line(error), hint=failed)
            if not (compiled.ran and call.key.options.exporter == "torchscript"):
                raise
            # The graph ran before on other sizes: the tracer baked a size in. The dynamo
            # exporter keeps sizes symbolic; switching re-exports (the log says why).
            logs.exporter_switch(shell.log, error)
            return Retry(attrs.evolve(shell, exporter="dynamo", fast=None), "exporter switched")
        if info.guards:
            observed = info.observed(outputs)
            expected = call.key.baked if call.key.baked is not None else info.baked
            if this_call:
                if observed != expected:
                    # The graph ran the call it was traced from: its values are right, and ORT's
                    # rounding of them (another summation order) is what later runs give for the
                    # same data. The entry is keyed by ORT's values, compared exactly from now
                    # on: a float a hair away may sit on the other side of a branch.
                    new_state = rekey(new_state, call.key, attrs.evolve(call.key, baked=observed))
            elif observed != expected:  # computed with the wrong constants
                return _guard_missed(shell, call, info, expected, observed)
        if not built.ran:
            _check_output_dtypes(info, outputs)
        if 0 in [o.numel() for o in outputs[: info.n_user_outputs]]:
            built = check_empty_outputs(built, module, leaves, call)
        if info.updates:
            _copy_back(info, outputs, leaves, tracked)
    if built is not compiled or not built.ran:
        new_state = replace_payload(new_state, call.key, attrs.evolve(built, ran=True))
    if _new_runner(compiled, built):
        new_state = note_session(new_state)
    if new_state.warned is not shell.state.warned:
        for path in sorted(new_state.warned - shell.state.warned):
            warnings.warn(
                REPEATED_REEXPORT.format(path=path, count=dict(new_state.streaks)[path]),
                OrtfxWarning,
                stacklevel=_user_stacklevel(),
            )
    after = shell.with_state(new_state)
    if built.training is not compiled.training and said_ignored(shell):
        after = attrs.evolve(after, said=after.said | {"memory config ignored"})
    return info.restore_outputs(outputs, leaves), after


def tensor_sizes(leaves: Sequence[Any], call: Call) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(leaves[i].shape) for i in call.key.schema.tensor_indices())


def _sizes_changed(
    shell: Shell, compiled: Compiled, leaves: Sequence[Any], call: Call
) -> Retry | None:
    """A graph pinned to its export's sizes, called with others: export again for these."""
    pinned = compiled.pinned_sizes
    if pinned is None:
        return None
    sizes = tensor_sizes(leaves, call)
    if sizes == pinned:
        return None
    cause = PINNED_SIZES_CHANGED.format(before=list(map(list, pinned)), now=list(map(list, sizes)))
    return Retry(invalidate(shell, cause), cause)


# How many different values one guarded location may give before its calls are refused (the
# policy then runs them in PyTorch): a branch (two values) or a few sizes each get a graph; a
# value that changes every call (a token count) would export forever. Sizes vary more (batch
# and sequence lengths) and each graph for one is used by every batch of that length.
MAX_GUARD_VALUES = {"data": 4, "size": 8}


def _guard_missed(
    shell: Shell,
    call: Call,
    info: PostExportProcessedModelInfo,
    expected: Baked,
    observed: Baked,
) -> Retry:
    """A run's guards gave other values than the graph baked in: the outputs are discarded and
    the call computed again with the graph for these values (found or exported); a location
    that has given more values than :data:`MAX_GUARD_VALUES` allows is refused instead (the
    policy then runs such calls in PyTorch)."""
    # Only the first difference is the call's own: later conversions ran on values computed
    # with the wrong constant.
    first, guard, was, now = next(
        (k, g, was, now)
        for k, (g, (_, was), (_, now)) in enumerate(
            zip(info.guards, expected, observed, strict=True)
        )
        if now != was
    )
    values = dict(shell.guard_values)
    seen = values.get(guard.where, frozenset({was})) | {now}
    values[guard.where] = seen
    if len(seen) > MAX_GUARD_VALUES[guard.origin]:
        shown = ", ".join(sorted(v[1] for v in seen)[:5])
        raise OrtfxTorchModelError(
            VALUE_KEEPS_CHANGING.format(
                where=guard.where, kind=guard.kind, count=len(seen), values=shown
            )
        )
    cause = f"{guard.kind} at {guard.where} was {was[1]}, now {now[1]}"
    shell = attrs.evolve(shell, guard_values=tuple(values.items()), fast=None)
    failed = call.hint.failed if call.hint is not None else ()
    return Retry(shell, cause, hint=GuardHint(observed[: first + 1], failed))


def _refuse_backward_hooks(module: torch.nn.Module) -> None:
    """Module backward hooks inside the tree (``register_full_backward_hook``, pre-hooks,
    torch's global ones) never run when ORT computes the backward: refused, not skipped."""
    hooked = watch.backward_hooks(module)
    if hooked:
        raise OrtfxTorchModelError(BACKWARD_HOOKS.format(modules=", ".join(hooked)))


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_empty_outputs(
    built: Compiled, module: torch.nn.Module, leaves: list[Any], call: Call
) -> Compiled:
    """ORT returned an empty output from non-empty inputs (user inputs are never empty here).

    ORT computes some sizes PyTorch rejects as empty results (``MaxPool2d(4)`` of a 2x2 input):
    if PyTorch raises for this call, raise its exception. Checked once per input sizes, so a
    model whose outputs are legitimately empty (no detections) pays one eager forward.
    """
    sizes = tuple(tuple(leaves[i].shape) for i in call.key.schema.tensor_indices())
    if sizes in built.empty_checked:
        return built
    raise_if_pytorch_raises(module, leaves, call.key.schema, torch.is_grad_enabled())
    return attrs.evolve(built, empty_checked=built.empty_checked | {sizes})


class NoGradientGraph(torch.autograd.Function):
    """Outputs of an eval-mode call whose gradient graph ORT could not build: a backward
    through them raises a clear error instead of torch's "does not require grad"."""

    @staticmethod
    def forward(
        ctx: Any, why: str, anchor: torch.Tensor, *outputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.why = why
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise OrtfxRuntimeError(NO_GRADIENT_GRAPH.format(why=ctx.why))


def _new_runner(before: Compiled, after: Compiled) -> bool:
    """Whether ``after`` holds a runner built by this call (not one taken from the per-size
    cache of ``before``)."""
    if after.inference is not before.inference:
        return True
    if after.training is None or after.training is before.training:
        return False
    return all(runner is not after.training for _, runner in before.sized)


def _check_updated_inputs(
    info: PostExportProcessedModelInfo, leaves: list[Any], call: Call
) -> None:
    """An input the forward changes in place must not require grad (PyTorch raises for a leaf;
    for a non-leaf, autograd would have to see the in-place op, which runs inside ORT)."""
    for update in info.updates:
        if update.kind == "input" and leaves[update.target].requires_grad:  # type: ignore[index]
            path = call.key.schema.paths[update.target]  # type: ignore[index]
            raise OrtfxIOError(INPUT_CHANGED_IN_PLACE.format(path=path))


def _buffer_updates_serialized(
    tracked: Tracked, info: PostExportProcessedModelInfo
) -> contextlib.AbstractContextManager[None]:
    """The locks of the buffers a graph updates, held while it runs and writes them back (an
    export holds them too: its trace changes the buffers and puts them back); nothing to hold
    for a graph that updates none (the common call: no generator frame on the fast path)."""
    if not info.updates:
        return _NOTHING
    updated = [
        tracked.named_tensors[update.target]  # type: ignore[index]
        for update in info.updates
        if update.kind == "state"
    ]
    return module_state.buffers_locked(updated) if updated else _NOTHING


_NOTHING: Final = contextlib.nullcontext()


def _copy_back(
    info: PostExportProcessedModelInfo,
    outputs: Sequence[torch.Tensor],
    leaves: list[Any],
    tracked: Tracked,
) -> None:
    """Write the forward's in-place changes into the module's tensors and the caller's."""
    first = info.n_user_outputs
    new = outputs[first : first + len(info.updates)]
    with torch.no_grad():
        for update, value in zip(info.updates, new, strict=True):
            target = (
                tracked.named_tensors[update.target]  # type: ignore[index]
                if update.kind == "state"
                else leaves[update.target]  # type: ignore[index]
            )
            target.copy_(value)


def _check_output_dtypes(
    info: PostExportProcessedModelInfo, outputs: Sequence[torch.Tensor]
) -> None:
    """ORT must return each output in the dtype the module returns (checked once per runner:
    e.g. ORT's CPU training graph hands float16 outputs back as float32)."""
    specs = [s for s in info.output_schema.leaves if isinstance(s, TensorSpec)]
    for k, (spec, out) in enumerate(zip(specs, outputs, strict=False)):
        if out.dtype != spec.dtype:
            raise OrtfxRuntimeError(
                OUTPUT_DTYPE_CHANGED.format(
                    path=info.output_schema.paths[info.output_schema.tensor_indices()[k]],
                    expected=str(spec.dtype).removeprefix("torch."),
                    given=str(out.dtype).removeprefix("torch."),
                )
            )


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside ortfx and torch."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


_INTERNAL_DIRS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    os.path.dirname(os.path.abspath(torch.__file__)),
)
