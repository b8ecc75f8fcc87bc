"""TorchScript-exporter symbolics for indexed reads and writes: PyTorch's bounds, and
accumulating writes that accumulate.

ONNX's ``Gather``, ``GatherElements`` and ``ScatterElements`` take an index of -1 as the last
position, ``OneHot`` writes a row of zeros for a class outside ``[0, num_classes)``, and
ORT's loss kernels read a negative target (and, with class weights, one past the last class)
as if it were a class; PyTorch raises for all of them. ``torch.gather(x, 1, tensor([[-1]]))``
returned the last column and ``F.cross_entropy(logits, tensor([-1]))`` a loss, silently.

Each symbolic here puts a check in front of the exporter's own form: a ``Reshape`` whose target
shape grows by one element when an index is out of PyTorch's bounds, which ORT rejects, so the
run fails; the shell then finds that the call raises in PyTorch and raises PyTorch's own error
(:mod:`ortfx.runtime.failures`). The exporter's form runs unchanged on the checked indices
(the check adds an integer zero). Tensor indexing (``x[index]``), which PyTorch lets wrap, is
left alone.

Writes that add at repeated indices (``scatter_add``, ``scatter_reduce("sum")``,
``index_put(accumulate=True)``): the exporter writes the latter (and, below opset 16, the first
two) as a plain ``ScatterND``/``ScatterElements`` into zeros plus the input, where a repeated
index keeps one update instead of their sum (``x.index_put((tensor([0, 0]),), v, True)``
added ``v[1]`` alone, silently); at opset 16 and above it writes ``scatter_add`` as a reducing
``ScatterElements`` of the input, whose ORT gradient for that input is wrong. Here each is a
reducing scatter into zeros plus the input (both values and gradients PyTorch's); below opset 16,
where ONNX has no reducing scatter, the export is refused.

A scatter's source larger than its index: PyTorch writes the first ``index.shape`` elements, and
its backward then raises for a source that needs a gradient; the exporter's slice of the source
trained on. A check fails such a run, so the call falls back and PyTorch raises in its backward.

Registered with the other symbolics of :mod:`ortfx.export.symbolics`, for ortfx's exports only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Final

import torch
import torch.onnx.symbolic_helper as helper

from ortfx import _torch
from ortfx.errors import OrtfxExportError

_parse_arg = _torch.symbolic_helper("_parse_arg")
_tensor_rank = _torch.symbolic_helper("_get_tensor_rank")

_INT64: Final = 7  # TensorProto.INT64
_ONNX_INTS: Final[dict[torch.dtype, int]] = {
    torch.uint8: 2,
    torch.int8: 3,
    torch.int16: 5,
    torch.int32: 6,
    torch.int64: _INT64,
}


def stock(name: str, opset: int) -> Callable[..., Any]:
    """The exporter's own symbolic for ``aten::name`` at ``opset`` (the newest at or below it),
    from the modules that define them (the public ``torch.onnx.symbolic_opsetN`` re-export only
    some: opset 18's ``amax`` is not among them)."""
    for version in range(opset, 8, -1):
        for module_name in _torch.symbolic_modules(version):
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            found = vars(module).get(name)
            if callable(found):
                return found  # type: ignore[no-any-return]
    raise LookupError(f"torch.onnx has no symbolic for aten::{name} at opset {opset}")


def _int64(g: Any, value: int | list[int]) -> Any:
    return g.op("Constant", value_t=torch.tensor(value, dtype=torch.int64))


def _zero_unless(g: Any, bad: Any) -> Any:
    """An int64 scalar 0 whose computation fails the run when any element of ``bad`` is true.

    The failing op is a ``Reshape`` of a one-element tensor to ``[1 + any(bad)]``; an empty
    ``bad`` never fails (its sum is 0)."""
    count = g.op("ReduceSum", g.op("Cast", bad, to_i=_INT64), keepdims_i=0)
    flag = g.op("Cast", g.op("Greater", count, _int64(g, 0)), to_i=_INT64)
    shape = g.op("Add", _int64(g, [1]), g.op("Reshape", flag, _int64(g, [1])))
    checked = g.op("Reshape", _int64(g, [0]), shape)
    return g.op("ReduceSum", checked, keepdims_i=0)


def _plus(g: Any, indices: Any, zero: Any) -> Any:
    """``indices + zero`` in the indices' own integer type (int32 indices stay int32)."""
    dtype = indices.type().dtype() if indices.type().kind() == "TensorType" else torch.int64
    kind = _ONNX_INTS.get(dtype, _INT64)
    return g.op("Add", indices, zero if kind == _INT64 else g.op("Cast", zero, to_i=kind))


def nonnegative(g: Any, indices: Any) -> Any:
    """``indices``, with a check that fails the run if one is negative."""
    return _plus(g, indices, _zero_unless(g, g.op("Less", indices, _zero_like(g, indices))))


def _zero_like(g: Any, indices: Any) -> Any:
    return g.op("CastLike", _int64(g, 0), indices) if g.opset >= 15 else _int64(g, 0)


def _within(g: Any, indices: Any, size: Any, skip: Any | None = None) -> Any:
    """``indices``, with a check that fails the run if one (other than those equal to
    ``skip``) is outside ``[0, size)``; ``size`` an int64 scalar value."""
    as_int64 = g.op("Cast", indices, to_i=_INT64)
    outside = g.op(
        "Or",
        g.op("Less", as_int64, _int64(g, 0)),
        g.op("GreaterOrEqual", as_int64, size),
    )
    if skip is not None:
        outside = g.op("And", outside, g.op("Not", g.op("Equal", as_int64, skip)))
    return _plus(g, indices, _zero_unless(g, outside))


def _size(g: Any, x: Any, axis: int) -> Any:
    """``x.shape[axis]`` as an int64 scalar."""
    return g.op("Gather", g.op("Shape", x), _int64(g, axis), axis_i=0)


# ---- the symbolics ------------------------------------------------------------------------------


def gather(g: Any, x: Any, dim: Any, index: Any, *rest: Any) -> Any:
    """``torch.gather``: ``GatherElements`` wraps a negative index."""
    return stock("gather", g.opset)(g, x, dim, nonnegative(g, index), *rest)


def scatter(g: Any, x: Any, dim: Any, index: Any, src: Any, *rest: Any) -> Any:
    """``Tensor.scatter`` (tensor or scalar source): ``ScatterElements`` wraps a negative index
    and takes no source larger than the index (PyTorch writes its first ``index.shape``
    elements, as the exporter's ``scatter_add`` does)."""
    checked = nonnegative(g, index)
    if helper._is_value(src) and helper._is_tensor(src) and not _is_constant(src):
        checked = _src_as_large_as_index(g, checked, src)
        rank = _tensor_rank(index)
        if rank is not None and _tensor_rank(src) == rank and not _same_sizes(index, src):
            src = g.op("Slice", src, _int64(g, [0] * rank), g.op("Shape", checked))
    return stock("scatter", g.opset)(g, x, dim, checked, src, *rest)


def _is_constant(value: Any) -> bool:
    return value.node().kind() in ("onnx::Constant", "prim::Constant")


def _same_sizes(a: Any, b: Any) -> bool:
    """Whether the graph knows both sizes and they are equal."""
    sizes = helper._get_tensor_sizes(a)
    return sizes is not None and None not in sizes and sizes == helper._get_tensor_sizes(b)


ACCUMULATION_NEEDS_OPSET_16 = (
    "{op} adds the updates at repeated indices, which ONNX can express only from opset 16 on "
    "(a reducing ScatterElements/ScatterND); this export uses opset {opset}, where the update "
    "written last would replace the others. Export at opset 16 or newer "
    "(Options(opset_version=17)), or let ortfx fall back to PyTorch."
)


def _zeros_like(g: Any, x: Any) -> Any:
    dtype = x.type().dtype() if x.type().kind() == "TensorType" else torch.float32
    zeros = g.op("ConstantOfShape", g.op("Shape", x), value_t=torch.zeros(1, dtype=dtype))
    zeros.setType(x.type())
    return zeros


def _accumulating(g: Any, op: str) -> None:
    if g.opset < 16:
        raise OrtfxExportError(ACCUMULATION_NEEDS_OPSET_16.format(op=op, opset=g.opset))


def _src_as_large_as_index(g: Any, index: Any, src: Any) -> Any:
    """``index``, with a check that fails the run if ``src`` is larger than ``index``.
    PyTorch takes the first ``index.shape`` elements of a larger ``src``, but its backward then
    raises for a ``src`` that needs a gradient ("ScatterAddBackward0 returned an invalid
    gradient"), where the exporter's form (a slice of ``src``) would train on. The call falls
    back to PyTorch, whose backward raises or not as eager's does. Checked whatever the grad
    mode of the exporting call: its graph may serve calls of the other mode."""
    if _same_sizes(index, src):
        return index
    differ = g.op("Not", g.op("Equal", g.op("Shape", src), g.op("Shape", index)))
    return _plus(g, index, _zero_unless(g, differ))


def scatter_add(g: Any, x: Any, dim: Any, index: Any, src: Any) -> Any:
    """``Tensor.scatter_add``: ``x`` plus a reducing scatter into zeros (module docstring)."""
    checked = _src_as_large_as_index(g, nonnegative(g, index), src)
    _accumulating(g, "Tensor.scatter_add")
    return g.op("Add", x, stock("scatter_add", g.opset)(g, _zeros_like(g, x), dim, checked, src))


def scatter_reduce(
    g: Any, x: Any, dim: Any, index: Any, src: Any, reduce: Any, include_self: Any
) -> Any:
    """``Tensor.scatter_reduce``: ``"sum"`` with the input included as :func:`scatter_add`,
    the others as the exporter writes them (ORT cannot differentiate those correctly: the
    session pipeline refuses their gradients, ``passes.refuse_unsafe_gradients``)."""
    how = helper._maybe_get_const(reduce, "s")
    if how == "sum" and helper._maybe_get_const(include_self, "b") is True:
        return scatter_add(g, x, dim, index, src)  # checks the index itself
    checked = nonnegative(g, index)
    return stock("scatter_reduce", g.opset)(g, x, dim, checked, src, reduce, include_self)


def index_put(g: Any, x: Any, indices: Any, values: Any, accumulate: Any = None) -> Any:
    """``Tensor.index_put``: with ``accumulate=True``, the exporter's zeros-plus-input form
    with its ``ScatterND`` made reducing (module docstring), and for one bool mask (which the
    exporter writes as a replacing ``masked_fill``/``masked_scatter``) the masked write into
    zeros plus the input."""
    exporters = stock("index_put", g.opset)
    adds = accumulate is not None and helper._maybe_get_const(accumulate, "b") is True
    if not adds:
        return exporters(g, x, indices, values, accumulate)
    listed = helper._unpack_list(indices) if helper._is_packed_list(indices) else [indices]
    if len(listed) == 1 and helper._is_bool(listed[0]):
        # The exporter's form for one mask (masked_fill / masked_scatter) replaces; a mask
        # names each position once, so the masked write into zeros plus x adds.
        unset = g.op("Constant", value_t=torch.tensor(False))
        return g.op("Add", x, exporters(g, _zeros_like(g, x), indices, values, unset))
    _accumulating(g, "Tensor.index_put(accumulate=True)")
    out = exporters(g, x, indices, values, accumulate)
    scatter = _producer(out, "onnx::ScatterND")
    if scatter is None:
        raise OrtfxExportError(
            "Tensor.index_put(accumulate=True): torch's exporter wrote no ScatterND for it, so "
            "ortfx cannot make it add at repeated indices; let ortfx fall back to PyTorch."
        )
    scatter.s_("reduction", "add")
    return out


def _producer(value: Any, kind: str, depth: int = 4) -> Any:
    """The node of ``kind`` among the few nodes that produce ``value``, or None."""
    node = value.node()
    if node.kind() == kind:
        return node
    if depth == 0:
        return None
    for inner in node.inputs():
        found = _producer(inner, kind, depth - 1)
        if found is not None:
            return found
    return None


def index_select(g: Any, x: Any, dim: Any, index: Any) -> Any:
    """``torch.index_select``: ``Gather`` wraps a negative index."""
    return stock("index_select", g.opset)(g, x, dim, nonnegative(g, index))


def index_copy(g: Any, x: Any, dim: Any, index: Any, source: Any) -> Any:
    """``Tensor.index_copy``: its ``ScatterElements`` wraps a negative index."""
    return stock("index_copy", g.opset)(g, x, dim, nonnegative(g, index), source)


def one_hot(g: Any, indices: Any, num_classes: Any) -> Any:
    """``F.one_hot``: ``OneHot`` writes zeros for a class outside ``[0, num_classes)``, and
    takes a negative one from the end; PyTorch raises for both."""
    classes = helper._maybe_get_const(num_classes, "i")
    if isinstance(classes, int) and classes < 0:  # inferred as max + 1: only negatives are out
        checked = nonnegative(g, indices)
        # ONNX's OneHot takes no -1 for the depth: max + 1, as PyTorch infers it
        largest = g.op("ReduceMax", g.op("Cast", checked, to_i=_INT64), keepdims_i=0)
        depth = g.op("Add", largest, _int64(g, 1))
        return stock("one_hot", g.opset)(g, checked, depth)
    else:
        dynamic = not isinstance(classes, int)
        size = g.op("Cast", num_classes, to_i=_INT64) if dynamic else _int64(g, classes)
        checked = _within(g, indices, size)
    return stock("one_hot", g.opset)(g, checked, num_classes)


def embedding_bag(g: Any, weight: Any, indices: Any, *rest: Any) -> Any:
    """``F.embedding_bag`` / ``nn.EmbeddingBag``: the ``Gather`` in the exporter's loop takes
    an index of -1 as the last row; PyTorch raises for an index outside ``[0, rows)``."""
    checked = _within(g, indices, _size(g, weight, 0))
    return stock("embedding_bag", g.opset)(g, weight, checked, *rest)


def _checked_target(g: Any, scores: Any, target: Any, ignore_index: Any) -> Any:
    """A loss target whose classes (other than ``ignore_index``) must be in ``[0, C)``, ``C``
    the scores' class dimension (dim 1, or dim 0 for unbatched scores)."""
    rank = _tensor_rank(scores)
    classes = _size(g, scores, 0 if rank == 1 else 1)
    ignore = _parse_arg(ignore_index, "i")
    return _within(g, target, classes, skip=_int64(g, ignore))


def _loss(name: str) -> Callable[..., Any]:
    def symbolic(
        g: Any, scores: Any, target: Any, weight: Any, reduction: Any, ignore_index: Any, *rest: Any
    ) -> Any:
        checked = _checked_target(g, scores, target, ignore_index)
        return stock(name, g.opset)(g, scores, checked, weight, reduction, ignore_index, *rest)

    symbolic.__name__ = symbolic.__qualname__ = name
    symbolic.__doc__ = (
        f"``aten::{name}``: a target outside ``[0, C)`` other than ``ignore_index`` raises."
    )
    return symbolic


INDEX_CHECKS: Final[dict[str, tuple[Callable[..., Any], int]]] = {
    "aten::gather": (gather, 9),
    "aten::embedding_bag": (embedding_bag, 9),
    "aten::scatter": (scatter, 9),
    "aten::scatter_add": (scatter_add, 9),
    "aten::scatter_reduce": (scatter_reduce, 16),
    "aten::index_select": (index_select, 9),
    "aten::index_copy": (index_copy, 9),
    "aten::index_put": (index_put, 11),
    "aten::one_hot": (one_hot, 9),
    "aten::nll_loss": (_loss("nll_loss"), 12),
    "aten::nll_loss2d": (_loss("nll_loss2d"), 12),
    "aten::nll_loss_nd": (_loss("nll_loss_nd"), 12),
    "aten::cross_entropy_loss": (_loss("cross_entropy_loss"), 12),
}
"""``name -> (symbolic, lowest opset)``: the ops whose indices get PyTorch's bounds and whose
writes accumulate as PyTorch's do."""
