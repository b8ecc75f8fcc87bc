"""The named pipelines: every graph ORT runs comes out of one of these, in this order.

1. :func:`for_export`, once per export: the exporter's graph made trainable by ORT.
2. :func:`for_session`, once per ORT training session: what it differentiates, random seeds,
   the refusal of unsafe gradients, concrete sizes, parameter feeds, symbolic shapes.
3. :func:`for_gradient`, on the gradient model ORT builds for that session: gradient kernels
   run by torch, reductions that never reduce dropped, parameter feeds ordered after their
   readers and (ZeRO-3) gathered per layer.
4. :func:`for_inference`, once per ORT inference session: random seeds.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from ortfx import aten
from ortfx.passes import (
    activations,
    cross_entropy,
    dropout,
    embedding,
    feeds,
    gradients,
    interface,
    reductions,
    shapes,
    speed,
    workarounds,
)
from ortfx.passes.core import Pass, chain
from ortfx.passes.layerwise import gather_per_layer
from ortfx.runtime import memgrad


def after_export(padding: Mapping[str, int]) -> Pass:
    """The graph edits applied once per export (see :func:`for_export`)."""
    return chain(
        interface.add_pythonop_ctx,
        workarounds.stop_edges_behind_identity,
        workarounds.guard_integer_division,
        workarounds.reductions_keep_dims,
        workarounds.hard_activations_differentiable,
        workarounds.where_gradients_reduce,
        workarounds.conv1d_grouped_as_2d,
        # a hand-written tanh GELU by torch's fused kernels, when the bridge can run them
        *([activations.tanh_gelu_in_torch] if aten.install() else []),
        speed.tanh_as_sigmoid,
        speed.weights_untransposed,
        interface.add_layernorm_stats,
        # torch's cross-entropy kernels when the bridge can run them, ONNX ops otherwise
        *([cross_entropy.cross_entropy_in_torch] if aten.install() else []),
        cross_entropy.split_cross_entropy,
        interface.add_cross_entropy_log_prob,
        dropout.add_dropout_masks,
        interface.separate_outputs,
        embedding.embedding_padding(padding),
        interface.user_inputs_first,
        shapes.mark_static_sizes,
    )


def for_export(padding: Mapping[str, int], dynamic_scalars: frozenset[str]) -> Pass:
    """Pipeline 1, once per export: make the exporter's graph trainable by ORT.

    ``padding`` maps embedding weights to their ``padding_idx``; ``dynamic_scalars`` are the
    scalar leaves fed as tensors.
    """
    return chain(after_export(padding), interface.with_dynamic_scalars(dynamic_scalars))


def for_session(
    inputs_requiring_grad: frozenset[int],
    params_requiring_grad: frozenset[str],
    *,
    seed: int,
    symbolic: bool = False,
    sizes: tuple[tuple[int, ...], ...] = (),
    feed_params_through: str | None = None,
) -> Pass:
    """Pipeline 2, once per ORT training session: what this session differentiates, the
    seeds of its random nodes from the session's ``seed`` (:func:`dropout.session_seed`), the
    refusal of graphs whose gradient build would kill the process, the user inputs' concrete
    ``sizes`` when the graph needs them (``static_size_ops``), the parameters fed through the
    autograd.Function named ``feed_params_through`` (memory-efficient gradients,
    :func:`~ortfx.passes.feeds.feed_parameters`), and (for the memory optimizer) symbolic
    intermediate shapes."""
    stages: list[Pass] = [
        gradients.with_grad_requirements(inputs_requiring_grad, params_requiring_grad),
        dropout.seed_random_nodes(seed),
        gradients.refuse_unsafe_gradients,
        shapes.pin_sizes(sizes),
    ]
    if feed_params_through is not None:
        stages.append(feeds.feed_parameters(feed_params_through))
    if symbolic:
        stages.append(shapes.symbolic_shapes)
    return chain(*stages)


def for_gradient(
    model: bytes, *, fed_params: bool, forward: bytes = b"", layerwise: bool = False
) -> bytes:
    """Pipeline 3, on the gradient model ORT builds for a training session (bytes in and out):

    - broadcast reductions that never reduce, dropped
      (``reductions.drop_empty_broadcast_reductions``, with ``forward``'s inferred shapes);
    - ``ReluGrad`` as torch's ``threshold_backward`` (``relu_grad_in_torch``; without the
      bridge, torch's NaN semantics in ONNX ops, ``relu_grad_passes_nan``);
    - torch's log-softmax gradient (``log_softmax_grad_in_torch``);
    - the scores' fed gradient added by the cross-entropy's gradient node
      (``cross_entropy_grads_summed``);
    - a tied embedding's row gradients added into its other gradient
      (``embedding_grads_scattered``);
    - for memory-efficient gradients (``fed_params``), ``feeds_after_readers``, then for ZeRO-3
      phase 2 (``layerwise``) ``layerwise.gather_per_layer``.

    The model is parsed only if one applies."""
    # The gradient kernels are looked up on the package, where a benchmark may turn one off
    # (bench/session_settings.py).
    from ortfx import passes

    relu = b"ReluGrad" in model
    tied = b"GatherGrad" in model and b"AccumulateGrad_" in model
    # torch's log-softmax gradient through the ATen executor, when the bridge is built
    log_softmax = b"LogSoftmaxGrad_13" in model and aten.install()
    broadcasts = b"BroadcastGradientArgs" in model
    cross_entropy = b"ortfx_cross_entropy_backward" in model
    if not (relu or log_softmax or fed_params or broadcasts or tied or cross_entropy):
        return model
    proto = onnx.load_model_from_string(model)
    inferred = reductions.forward_shapes(forward) if broadcasts and forward else {}
    changed = broadcasts and reductions.drop_empty_broadcast_reductions(proto, inferred) > 0
    # torch's ReluGrad through the ATen executor; without it (no bridge), torch's NaN rule
    # in ONNX ops for every ReluGrad left
    changed = (relu and aten.install() and passes.relu_grad_in_torch(proto)) or changed
    changed = (relu and passes.relu_grad_passes_nan(proto)) or changed
    changed = (log_softmax and passes.log_softmax_grad_in_torch(proto)) or changed
    changed = (tied and passes.embedding_grads_scattered(proto)) or changed
    changed = (cross_entropy and passes.cross_entropy_grads_summed(proto)) or changed
    if fed_params:
        changed = feeds.feeds_after_readers(proto, memgrad.FUNCTION_NAME) or changed
        if layerwise:
            changed = gather_per_layer(proto, memgrad.FUNCTION_NAME) or changed
    if not changed:
        return model
    edited: bytes = proto.SerializeToString()
    return edited


def for_inference(seed: int) -> Pass:
    """Pipeline 4, once per ORT inference session: the seeds of its random nodes from the
    session's ``seed`` (:func:`dropout.session_seed`)."""
    return dropout.seed_random_nodes(seed)
