"""The bridge between torch autograd and ORT's forward/backward runs."""

from __future__ import annotations

from typing import Any

import torch

from ortfx.errors import HIGHER_ORDER_GRADIENTS, OrtfxRuntimeError
from ortfx.runtime.training import TrainingRunner


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
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if ctx.run_state is None:
            raise RuntimeError(
                "ortfx: backward through the same ORT forward twice is not supported; "
                "ORT frees its saved activations after the first backward. "
                "Run the forward again instead of retain_graph=True."
            )
        if torch.is_grad_enabled():
            # backward(create_graph=True) / autograd.grad(create_graph=True): ORT's gradient
            # graph is not itself differentiable by torch.
            raise OrtfxRuntimeError(HIGHER_ORDER_GRADIENTS)
        ctx.saved_tensors  # noqa: B018 - triggers torch's in-place modification check
        grads = ctx.runner.backward(ctx.run_state, grad_outputs, ctx.outputs_meta)
        ctx.run_state = None
        result: list[torch.Tensor | None] = [None] * (ctx.n_inputs + 1)
        for slot, grad in zip(ctx.runner.grad_slots, grads, strict=True):
            result[slot + 1] = grad
        return tuple(result)
