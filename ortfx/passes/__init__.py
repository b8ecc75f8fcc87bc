"""Post-export processing: pure passes over a model record, composed with :func:`chain`.

Each pass takes a :class:`PostExportProcessedModelInfo` and returns a new one; none mutates its
input (graph edits happen on a private copy of the decoded model). Every graph ORT runs comes out
of one of four named pipelines, all in :mod:`~ortfx.passes.pipelines`: :func:`for_export` (once
per export), :func:`for_session` (once per ORT training session), :func:`for_gradient` (on the
gradient model ORT builds for it) and :func:`for_inference` (once per ORT inference session).

The passes, one family a file:

- ``core``: the :data:`Pass` type, :func:`graph_pass`, :func:`chain`, shared graph queries;
- ``interface``: node outputs ORT's gradients read (layer-norm stats, cross-entropy log-prob,
  PythonOp ctx), one value per graph output, user inputs first, dynamic scalars;
- ``dropout``: dropout masks, and the seeds of random nodes;
- ``workarounds``: graphs rewritten around ORT faults (stop edges, integer division by zero,
  ``keepdims=0`` reductions, ``Where`` broadcasts, grouped 1-d convolutions);
- ``speed``: faster equal forms (tanh as sigmoid, cross-entropy split);
- ``embedding``: ``padding_idx`` kept through export;
- ``gradients``: grad requirements, and the refusal of unsafe gradients;
- ``shapes``: static sizes where a gradient kernel reads them, symbolic shapes;
- ``feeds``: memory-efficient gradients (parameter feeds, their order, owned gradients);
- ``layerwise``: ZeRO-3's per-layer gathering; ``reductions``: broadcast reductions that never
  reduce; ``grad_kernels``: gradient kernels as torch's, run by torch or in ONNX ops (all
  three on ORT's gradient model).
"""

from ortfx.passes.activations import tanh_gelu_in_torch
from ortfx.passes.core import Edit, Pass, chain, graph_pass
from ortfx.passes.cross_entropy import cross_entropy_in_torch, split_cross_entropy
from ortfx.passes.dropout import add_dropout_masks, random_ops, seed_random_nodes, session_seed
from ortfx.passes.embedding import (
    PADDED_GATHER,
    PADDED_GATHER_DOMAIN,
    PADDING_ON_COMPUTED_WEIGHT,
    embedding_padding,
)
from ortfx.passes.feeds import TRIGGER, feed_parameters, feeds_after_readers, owned_gradients
from ortfx.passes.grad_kernels import (
    cross_entropy_grads_summed,
    embedding_grads_scattered,
    log_softmax_grad_in_torch,
    relu_grad_in_torch,
    relu_grad_passes_nan,
)
from ortfx.passes.gradients import refuse_unsafe_gradients, with_grad_requirements
from ortfx.passes.interface import (
    add_cross_entropy_log_prob,
    add_layernorm_stats,
    add_pythonop_ctx,
    separate_outputs,
    user_inputs_first,
    with_dynamic_scalars,
)
from ortfx.passes.pipelines import (
    after_export,
    for_export,
    for_gradient,
    for_inference,
    for_session,
)
from ortfx.passes.shapes import READS_GRAPH_SIZES, mark_static_sizes, pin_sizes, symbolic_shapes
from ortfx.passes.speed import tanh_as_sigmoid, weights_untransposed
from ortfx.passes.workarounds import (
    ZERO_DIVISION_GUARD,
    conv1d_grouped_as_2d,
    guard_integer_division,
    reductions_keep_dims,
    stop_edges_behind_identity,
    where_gradients_reduce,
)

__all__ = [
    "PADDED_GATHER",
    "PADDED_GATHER_DOMAIN",
    "PADDING_ON_COMPUTED_WEIGHT",
    "READS_GRAPH_SIZES",
    "TRIGGER",
    "ZERO_DIVISION_GUARD",
    "Edit",
    "Pass",
    "add_cross_entropy_log_prob",
    "add_dropout_masks",
    "add_layernorm_stats",
    "add_pythonop_ctx",
    "after_export",
    "chain",
    "conv1d_grouped_as_2d",
    "cross_entropy_grads_summed",
    "cross_entropy_in_torch",
    "embedding_grads_scattered",
    "embedding_padding",
    "feed_parameters",
    "feeds_after_readers",
    "for_export",
    "for_gradient",
    "for_inference",
    "for_session",
    "graph_pass",
    "guard_integer_division",
    "log_softmax_grad_in_torch",
    "mark_static_sizes",
    "owned_gradients",
    "pin_sizes",
    "random_ops",
    "reductions_keep_dims",
    "refuse_unsafe_gradients",
    "relu_grad_in_torch",
    "relu_grad_passes_nan",
    "seed_random_nodes",
    "separate_outputs",
    "session_seed",
    "split_cross_entropy",
    "stop_edges_behind_identity",
    "symbolic_shapes",
    "tanh_as_sigmoid",
    "tanh_gelu_in_torch",
    "user_inputs_first",
    "weights_untransposed",
    "where_gradients_reduce",
    "with_dynamic_scalars",
    "with_grad_requirements",
]
