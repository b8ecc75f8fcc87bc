"""PyTorch's index bounds for the dynamo exporter (the TorchScript exporter's are in
:mod:`ortfx.export.indexing`).

ONNX's ``Gather``, ``GatherElements``, ``ScatterElements`` and ``ScatterND`` take an index of -1
as the last position, and the dynamo exporter writes ``F.one_hot`` as a comparison with a range
(a row of zeros for a class it does not have) and ``F.nll_loss`` as ``NegativeLogLikelihoodLoss``
(which reads a negative target as a class); PyTorch raises for each. While ``torch.export``
traces the forward, :func:`checked` (a ``TorchFunctionMode`` on the exporting thread) passes the
index of each such op through ``ortfx::checked_index(index, size, skip)``: the index itself,
whose ONNX translation (:func:`checked_index_onnx`) adds a zero computed by a ``Reshape`` that
fails the run when an index is outside ``[0, size)`` (other than ``skip``). The shell then
replays the call in PyTorch and raises PyTorch's own error, as for the TorchScript exporter.
Tensor indexing (``x[index]``, ``take``, ``take_along_dim``, ``index_fill``, ``index_put``),
where PyTorch takes negative indices from the end too, is left alone.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import onnx
import torch
import torch.nn.functional as F

# No index is skipped (a target class equal to it is not exempt).
NONE: Final = -(2**62)
# The class count of F.one_hot(x) without num_classes: only negative classes are out.
UNBOUNDED: Final = 2**62

_lock = threading.Lock()
_op: list[Any] = []


def _checked_op() -> Any:
    """``torch.ops.ortfx.checked_index``, defined once per process (torch's op registry)."""
    with _lock:
        if not _op:

            @torch.library.custom_op("ortfx::checked_index", mutates_args=())
            def checked_index(index: torch.Tensor, size: int, skip: int) -> torch.Tensor:
                outside = (index < 0) | (index >= size)
                if skip != NONE:
                    outside &= index != skip
                if bool(outside.any()):
                    raise IndexError(f"index out of [0, {size}) in an ortfx-checked op")
                return index.clone()

            @checked_index.register_fake
            def _(index: torch.Tensor, size: int, skip: int) -> torch.Tensor:
                return torch.empty_like(index)

            _op.append(torch.ops.ortfx.checked_index.default)
        return _op[0]


DOMAIN: Final = "ortfx.bounds"


def _marker_schema() -> onnx.defs.OpSchema:
    """``ortfx.bounds::CheckedIndex(index, size)``: a node only :func:`expand` reads."""
    Param, Attr = onnx.defs.OpSchema.FormalParameter, onnx.defs.OpSchema.Attribute
    return onnx.defs.OpSchema(
        "CheckedIndex",
        DOMAIN,
        1,
        inputs=[Param("index", "T"), Param("size", "tensor(int64)")],
        outputs=[Param("checked", "T")],
        type_constraints=[("T", [f"tensor({t})" for t in ("int64", "int32")], "")],
        attributes=[Attr("skip", onnx.defs.OpSchema.AttrType.INT, "")],
    )


def checked_index_onnx(index: Any, size: Any, skip: int) -> Any:
    """The ONNX form of ``ortfx::checked_index``: an opaque ``CheckedIndex`` node that the
    exporter's optimizer keeps (it would fold a failing ``Reshape`` away, taking the zero it
    sums for the count of bad indices); :func:`expand` writes the check after it."""
    import onnxscript
    from onnxscript import opset18 as op

    marker = onnxscript.values.Op(
        onnxscript.values.Opset(DOMAIN, 1), "CheckedIndex", _marker_schema()
    )
    return marker(index, op.Cast(size, to=7), skip=skip)


def expand(model: onnx.ModelProto) -> None:
    """Write each ``CheckedIndex`` node as ``index + zero``, where computing the zero fails the
    run for an index outside ``[0, size)`` other than ``skip`` (a ``Reshape`` of one element
    to ``[1 + any(bad)]``, as :mod:`ortfx.export.indexing` does); ORT's optimizers keep it."""
    make = onnx.helper.make_node
    int64 = onnx.TensorProto.INT64

    def constant(name: str, values: list[int], dims: list[int]) -> onnx.NodeProto:
        return make(
            "Constant", [], [name], value=onnx.helper.make_tensor(name, int64, dims, values)
        )

    nodes: list[onnx.NodeProto] = []
    for k, node in enumerate(model.graph.node):
        if node.domain != DOMAIN:
            nodes.append(node)
            continue
        index, size = node.input
        skip = next((a.i for a in node.attribute if a.name == "skip"), NONE)
        v = f"ortfx_checked_{k}"
        nodes += [
            make("Cast", [index], [f"{v}_i64"], to=int64),
            constant(f"{v}_0", [0], []),
            make("Less", [f"{v}_i64", f"{v}_0"], [f"{v}_neg"]),
            make("GreaterOrEqual", [f"{v}_i64", size], [f"{v}_big"]),
            make("Or", [f"{v}_neg", f"{v}_big"], [f"{v}_out"]),
        ]
        bad = f"{v}_out"
        if skip != NONE:
            nodes += [
                constant(f"{v}_skip", [skip], []),
                make("Equal", [f"{v}_i64", f"{v}_skip"], [f"{v}_is_skip"]),
                make("Not", [f"{v}_is_skip"], [f"{v}_not_skip"]),
                make("And", [bad, f"{v}_not_skip"], [f"{v}_bad"]),
            ]
            bad = f"{v}_bad"
        nodes += [
            make("Cast", [bad], [f"{v}_bad64"], to=int64),
            make("ReduceSum", [f"{v}_bad64"], [f"{v}_count"], keepdims=0),
            make("Greater", [f"{v}_count", f"{v}_0"], [f"{v}_any"]),
            make("Cast", [f"{v}_any"], [f"{v}_flag"], to=int64),
            constant(f"{v}_one", [1], [1]),
            make("Reshape", [f"{v}_flag", f"{v}_one"], [f"{v}_flag1"]),
            make("Add", [f"{v}_one", f"{v}_flag1"], [f"{v}_shape"]),
            constant(f"{v}_zero1", [0], [1]),
            make("Reshape", [f"{v}_zero1", f"{v}_shape"], [f"{v}_fails"]),
            make("ReduceSum", [f"{v}_fails"], [f"{v}_zero"], keepdims=0),
            make("CastLike", [f"{v}_zero", index], [f"{v}_zero_t"]),
            make("Add", [index, f"{v}_zero_t"], [node.output[0]]),
        ]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    kept = [o for o in model.opset_import if o.domain != DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend(kept)


def _get(args: Sequence[Any], kwargs: dict[str, Any], position: int, name: str) -> Any:
    if len(args) > position:
        return args[position]
    return kwargs.get(name)


def _set(
    args: Sequence[Any], kwargs: dict[str, Any], position: int, name: str, value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if len(args) > position:
        return (*args[:position], value, *args[position + 1 :]), kwargs
    return tuple(args), {**kwargs, name: value}


# func -> (index position and name, a function of (args, kwargs) giving (size, skip)); None
# for a size: leave the call alone.
Bounds = Callable[[Sequence[Any], dict[str, Any]], tuple[Any, int] | None]


def _along_dim(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, int] | None:
    x, dim = _get(args, kwargs, 0, "input"), _get(args, kwargs, 1, "dim")
    if not isinstance(x, torch.Tensor) or not isinstance(dim, int):
        return None
    return x.size(dim), NONE


def _rows(position: int, name: str) -> Bounds:
    def bounds(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, int] | None:
        weight = _get(args, kwargs, position, name)
        return (weight.size(0), NONE) if isinstance(weight, torch.Tensor) else None

    return bounds


def _classes(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, int] | None:
    count = _get(args, kwargs, 1, "num_classes")
    count = -1 if count is None else count
    return (UNBOUNDED if count < 0 else count), NONE


def _target(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, int] | None:
    scores, target = _get(args, kwargs, 0, "input"), _get(args, kwargs, 1, "target")
    if not isinstance(scores, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    if target.is_floating_point():  # class probabilities, not class indices
        return None
    ignore = kwargs.get("ignore_index", -100)
    return scores.size(1 if scores.dim() > 1 else 0), int(ignore)


def _table() -> dict[Any, tuple[int, str, Bounds]]:
    along = {
        torch.gather: 2, torch.Tensor.gather: 2,
        torch.scatter: 2, torch.Tensor.scatter: 2, torch.Tensor.scatter_: 2,
        torch.scatter_add: 2, torch.Tensor.scatter_add: 2, torch.Tensor.scatter_add_: 2,
        torch.scatter_reduce: 2, torch.Tensor.scatter_reduce: 2,
        torch.Tensor.scatter_reduce_: 2,
        torch.index_select: 2, torch.Tensor.index_select: 2,
        torch.index_copy: 2, torch.Tensor.index_copy: 2, torch.Tensor.index_copy_: 2,
        torch.index_add: 2, torch.Tensor.index_add: 2, torch.Tensor.index_add_: 2,
    }  # fmt: skip
    table: dict[Any, tuple[int, str, Bounds]] = {
        func: (position, "index", _along_dim) for func, position in along.items()
    }
    table[F.embedding] = (0, "input", _rows(1, "weight"))
    table[F.embedding_bag] = (0, "input", _rows(1, "weight"))
    table[F.one_hot] = (0, "tensor", _classes)
    table[F.nll_loss] = (1, "target", _target)
    table[F.cross_entropy] = (1, "target", _target)
    return table


_TABLE: Final = _table()


class _Bounds(torch.overrides.TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        entry = _TABLE.get(func)
        if entry is not None:
            position, name, bounds = entry
            index = _get(args, kwargs, position, name)
            found = bounds(args, kwargs) if isinstance(index, torch.Tensor) else None
            if found is not None and not index.is_floating_point():
                size, skip = found
                checked_index = _checked_op()(index, size, skip)
                args, kwargs = _set(args, kwargs, position, name, checked_index)
        return func(*args, **kwargs)


@contextlib.contextmanager
def checked() -> Iterator[None]:
    """Index checks in front of the index ops the forward calls while ``torch.export``
    traces it on this thread (torch keeps function modes per thread)."""
    _checked_op()
    with _Bounds():
        yield


def translations() -> dict[Any, Any]:
    """The ``custom_translation_table`` entry of ``ortfx::checked_index``."""
    return {_checked_op(): checked_index_onnx}
