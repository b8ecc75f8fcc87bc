"""Shapes in the graph: the user inputs' concrete sizes where a gradient kernel reads them
(:func:`mark_static_sizes` records where, :func:`pin_sizes` pins them), and symbolic
intermediate shapes for the memory optimizer (:func:`symbolic_shapes`)."""

from __future__ import annotations

import attrs
import onnx

from ortfx.model_info import PostExportProcessedModelInfo
from ortfx.passes.core import Pass, computed_from_inputs, graph_pass, is_standard

# Operators whose ORT 1.19 CPU gradient kernel reads its output sizes from the graph when the
# session is created (MaxPoolGrad, AveragePoolGrad): a symbolic dim reads as 0 and the kernel
# writes out of bounds (SIGSEGV) or divides by zero (SIGFPE). Found by tests/test_layer_sweep.
READS_GRAPH_SIZES = frozenset({"MaxPool", "AveragePool"})


def _shape_dependent_ifs(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    dependent = computed_from_inputs(model)
    return [
        node
        for node in model.graph.node
        if is_standard(node, "If") and node.input and node.input[0] not in dependent
    ]


def mark_static_sizes(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
    """Record the operators whose gradient needs concrete sizes in the graph.

    Those are :data:`READS_GRAPH_SIZES` and an ``If`` whose condition depends only on shapes
    (e.g. ``nn.LocalResponseNorm``): ORT's gradient builder aborts the process on an ``If``
    it cannot fold, and with concrete sizes its constant folding removes a shape-only one.
    """
    model = onnx.load_model_from_string(info.model)
    ops = sorted(
        {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")} & READS_GRAPH_SIZES
    )
    if _shape_dependent_ifs(model):
        ops.append("If")
    ops_t = tuple(ops)
    return info if ops_t == info.static_size_ops else attrs.evolve(info, static_size_ops=ops_t)


def pin_sizes(sizes: tuple[tuple[int, ...], ...]) -> Pass:
    """Make the user inputs' dims concrete (``sizes`` in graph order; ``()`` changes nothing),
    so that ORT infers concrete sizes for every node of the training graph."""

    @graph_pass
    def run(model: onnx.ModelProto) -> bool:
        if not sizes:
            return False
        for value, shape in zip(model.graph.input, sizes, strict=False):
            dims = value.type.tensor_type.shape.dim
            if len(dims) != len(shape):
                raise ValueError(f"pin_sizes: {value.name} has rank {len(dims)}, not {shape}")
            for dim, size in zip(dims, shape, strict=True):
                dim.Clear()
                dim.dim_value = size
        return True

    return run


def symbolic_shapes(info: PostExportProcessedModelInfo) -> PostExportProcessedModelInfo:
    """Annotate intermediate values with sizes in terms of the input dims, so that ORT's
    memory estimates are expressions of input sizes; unchanged if inference fails."""
    # ORT's tool, imported here so that importing the passes needs no ORT.
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        model = SymbolicShapeInference.infer_shapes(
            onnx.load_model_from_string(info.model), auto_merge=True, guess_output_rank=True
        )
    except Exception:
        return info
    return attrs.evolve(info, model=model.SerializeToString())
