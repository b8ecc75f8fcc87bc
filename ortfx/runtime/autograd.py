"""The bridge between torch autograd and ORT's forward/backward runs."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ortfx._torch import backward_keeps_graph, gradient_watched
from ortfx.errors import HIGHER_ORDER_GRADIENTS, WATCHED_INNER_OUTPUT, OrtfxRuntimeError
from ortfx.runtime.training import TrainingRunner

# torch's own message for a second backward through a freed graph.
GRAPH_FREED = (
    "Trying to backward through the graph a second time (or directly access saved tensors "
    "after they have already been freed). Saved intermediate values of the graph are freed "
    "when you call .backward() or autograd.grad(). Specify retain_graph=True if you need to "
    "backward through the graph a second time or if you need to access saved tensors after "
    "calling backward."
)


class RunORT(torch.autograd.Function):
    """``RunORT.apply(runner, *graph_inputs)`` runs ORT's forward; its backward runs ORT's."""

    @staticmethod
    def forward(
        ctx: Any, runner: TrainingRunner, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        outputs, run_state = runner.forward(inputs)
        ctx.runner = runner
        ctx.run_state = run_state
        ctx.n_inputs = len(inputs)
        ctx.outputs_meta = [(o.shape, o.dtype, o.device) for o in outputs]
        # Unused outputs arrive as None; the runner feeds zeros of the right kind itself.
        ctx.set_materialize_grads(False)
        # The outputs the graph also uses inside: a hook on one would see part of its
        # gradient (checked in backward, when the user has had the chance to add one).
        ctx.inner = [(k, weakref.ref(outputs[k])) for k in runner.inner_outputs]
        frozen = [outputs[k] for k in runner.non_differentiable]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        # ORT's backward reads these inputs (the weights, the activations it was fed) and
        # outputs: saving them makes torch raise on an in-place change between forward and
        # backward (e.g. optimizer.step() in between), as it would for the eager ops.
        ctx.save_for_backward(
            *(inputs[k] for k in runner.guarded_inputs),
            *(outputs[k] for k in runner.saved_outputs),
        )
        # A second backward (retain_graph=True) runs the forward again on the same inputs:
        # the saved ones above, and these (dropped by a backward that frees the graph).
        guarded = set(runner.guarded_inputs)
        ctx.unsaved = (
            None
            if runner.replay_refused is not None
            else {k: t for k, t in enumerate(inputs) if k not in guarded}
        )
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            # backward(create_graph=True) / autograd.grad(create_graph=True): ORT's gradient
            # graph is not itself differentiable by torch.
            raise OrtfxRuntimeError(HIGHER_ORDER_GRADIENTS)
        for k, ref in ctx.inner:
            watched = ref()
            if watched is not None and gradient_watched(watched):
                raise OrtfxRuntimeError(WATCHED_INNER_OUTPUT.format(position=k))
        saved = ctx.saved_tensors  # torch's in-place modification check, as for eager ops
        runner: TrainingRunner = ctx.runner
        if ctx.run_state is None:
            # A second backward: ORT's first one consumed the forward's state.
            if runner.replay_refused is not None:
                raise OrtfxRuntimeError(runner.replay_refused)
            if ctx.unsaved is None:  # freed by a backward without retain_graph (torch's text)
                raise RuntimeError(GRAPH_FREED)
            inputs = dict(zip(runner.guarded_inputs, saved, strict=False))
            inputs.update(ctx.unsaved)
            _, ctx.run_state = runner.forward([inputs[k] for k in range(ctx.n_inputs)])
        grads = runner.backward(ctx.run_state, grad_outputs, ctx.outputs_meta)
        ctx.run_state = None
        if not backward_keeps_graph():
            ctx.unsaved = None  # no backward can follow: let the inputs go
        result: list[torch.Tensor | None] = [None] * (ctx.n_inputs + 1)
        for slot, grad in zip(runner.grad_slots, grads, strict=True):
            result[slot + 1] = grad
        return tuple(result)
