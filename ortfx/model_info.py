"""The frozen record of a processed graph and the pure maps between user calls and graph I/O."""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from ortfx import io
from ortfx.errors import OrtfxIOError
from ortfx.schema import ModelSchema, StaticSpec, tensorize_scalars


class InputKind(enum.Enum):
    USER = "user input"
    PARAMETER = "parameter"
    BUFFER = "buffer"
    INTERNAL = "internal"
    # A fresh 0-dim leaf per call that pulls the parameters fed through PythonOps (see
    # ortfx.runtime.memgrad): torch's engine runs ORT's backward because it requires grad.
    TRIGGER = "gradient trigger"


@attrs.frozen
class InputSpec:
    """One graph input: its name, what kind of thing feeds it, and where that thing comes from.

    ``source`` is the flat leaf index for a user input, and the module-relative name for a
    parameter or buffer.
    """

    name: str
    kind: InputKind
    source: int | str
    requires_grad: bool = False


@attrs.frozen
class Update:
    """A graph output that is the new value of a tensor the forward changed in place.

    ``target`` is a parameter or buffer name (``kind`` "state") or a flat input leaf index
    (``kind`` "input"). After each run the shell copies the value into that tensor, so the
    module's state and the caller's tensors change exactly as they would in PyTorch.
    """

    kind: str
    target: str | int


@attrs.frozen
class Guard:
    """A Python value the trace took from a tensor, which the graph holds as a constant.

    The tensor it came from is an extra graph output (after the updates): after each run the
    shell converts that output the same way and compares it with ``value`` (in the canonical
    form of :func:`guard_value`); another value means the graph computed the call with the
    wrong constant, and the call is computed again (see :mod:`ortfx.runtime.execute`).
    """

    kind: str  # what the forward turned it into: boolean, integer, float, number, list, ...
    where: str  # file:line of the conversion
    value: Any  # the canonical form of the value the trace took
    origin: str  # "data" (tensor values) or "size" (only sizes)


def guard_value(kind: str, tensor: torch.Tensor) -> Any:
    """The canonical, hashable form of the Python value ``tensor`` converts to as ``kind``:
    ``(type name, repr)``, so that NaN equals NaN and ``1``, ``1.0`` and ``True`` differ, as
    :class:`~ortfx.schema.StaticSpec` compares static arguments."""
    if kind == "boolean":
        value: Any = bool(tensor)
    elif kind in ("integer", "index", "len", "iteration", "number of parts"):
        value = int(tensor)
    elif kind == "float":
        value = float(tensor)
    elif kind == "number":
        value = tensor.item()
    elif kind == "complex":
        value = complex(tensor)
    else:  # list, NumPy array: the whole tensor's values
        value = tensor.tolist()
    return (type(value).__name__, repr(value))


@attrs.frozen
class PostExportProcessedModelInfo:
    """A processed ONNX model and everything needed to feed it and read it back.

    ``model`` is the serialized ONNX model (immutable bytes). ``inputs`` lists the graph inputs
    in graph order. ``output_schema`` is the user's output structure; its tensor leaves map, in
    order, onto ``output_names``; its static leaves (ints, strs, None) are restored as they were.
    """

    model: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    inputs: tuple[InputSpec, ...]
    input_schema: ModelSchema
    output_schema: ModelSchema
    output_names: tuple[str, ...]
    dynamic_scalars: frozenset[str] = frozenset()
    # After the user's outputs: len(updates) in-place changes to copy back (see Update), then
    # len(guards) tensors behind values the trace baked in (see Guard).
    updates: tuple[Update, ...] = ()
    guards: tuple[Guard, ...] = ()
    # (tensor output position, input leaf index) of outputs that are the caller's own input
    # tensor returned as is: PyTorch returns that very object.
    returned_inputs: tuple[tuple[int, int], ...] = ()
    # The operators whose ORT gradient needs concrete sizes in the graph (MaxPool, AveragePool,
    # a shape-dependent If): when set, every training session is built for the call's input
    # sizes (see passes.mark_static_sizes and passes.pin_sizes).
    static_size_ops: tuple[str, ...] = ()
    # Parameters that are no graph inputs but PythonOp outputs (memory-efficient gradients),
    # in the PythonOps' index order; the autograd bridge takes them after the graph inputs.
    fed_params: tuple[InputSpec, ...] = ()

    @property
    def n_user_outputs(self) -> int:
        return len(self.output_names) - len(self.updates) - len(self.guards)

    @functools.cached_property
    def baked(self) -> tuple[tuple[str, Any], ...]:
        """``(where, value)`` of each guard, as the export took them."""
        return tuple((g.where, g.value) for g in self.guards)

    def observed(self, outputs: Sequence[torch.Tensor], /) -> tuple[tuple[str, Any], ...]:
        """``(where, value)`` of each guard as this run's outputs give them."""
        first = len(self.output_names) - len(self.guards)
        return tuple(
            (g.where, guard_value(g.kind, t))
            for g, t in zip(self.guards, outputs[first:], strict=True)
        )

    @property
    def user_inputs_requiring_grad(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs if i.kind is InputKind.USER and i.requires_grad)

    def user_sizes(self, leaves: Sequence[Any], /) -> tuple[tuple[int, ...], ...]:
        """The sizes of the user inputs, in graph order, when the training graph needs concrete
        sizes (``static_size_ops``); ``()`` otherwise."""
        if not self.static_size_ops:
            return ()
        return tuple(
            tuple(leaves[i.source].shape)  # type: ignore[index]
            for i in self.inputs
            if i.kind is InputKind.USER
        )

    @property
    def params_to_train(self) -> tuple[str, ...]:
        return tuple(
            i.name
            for i in self.inputs
            if i.kind in (InputKind.PARAMETER, InputKind.TRIGGER) and i.requires_grad
        )

    def construct_inputs(
        self, args: Sequence[Any], kwargs: dict[str, Any], /, named_tensors: Mapping[str, Any]
    ) -> tuple[torch.Tensor, ...]:
        """Graph inputs, in graph order, for ``module(*args, **kwargs)``.

        ``named_tensors`` maps parameter and buffer names (as in ``named_parameters()``) to
        their tensors.
        """
        leaves, spec = io.flatten(io.call_tree(args, kwargs))
        if spec != self.input_schema.treespec:
            raise OrtfxIOError(
                f"construct_inputs was given a call of structure {spec}, but this graph was "
                f"built for {self.input_schema.treespec}; decide() must pick the graph first."
            )
        leaves = tensorize_scalars(leaves, spec, paths=self.dynamic_scalars)
        return self.construct_inputs_flat(leaves, named_tensors)

    def construct_inputs_flat(
        self, leaves: Sequence[Any], named_tensors: Mapping[str, Any], /
    ) -> tuple[torch.Tensor, ...]:
        """Like :meth:`construct_inputs`, from already flattened (and tensorized) leaves.

        With :attr:`fed_params`, a tuple of those parameters follows the graph inputs: one
        argument autograd does not look into, so they are no inputs of the ORT autograd node
        (their gradients reach torch from inside ORT's backward instead).
        """
        if not self.fed_params:
            return tuple(
                leaves[i.source] if i.kind is InputKind.USER else named_tensors[i.source]  # type: ignore[index]
                for i in self.inputs
            )
        fed = tuple(named_tensors[str(i.source)] for i in self.fed_params)
        trigger = torch.zeros((), device=fed[0].device, requires_grad=True)
        graph = tuple(
            leaves[i.source]  # type: ignore[index]
            if i.kind is InputKind.USER
            else trigger
            if i.kind is InputKind.TRIGGER
            else named_tensors[str(i.source)]
            for i in self.inputs
        )
        return (*graph, fed)  # type: ignore[arg-type]

    def restore_outputs(
        self, flat: Sequence[torch.Tensor], /, leaves: Sequence[Any] | None = None
    ) -> Any:
        """The user's output structure from the graph's outputs (in ``output_names`` order;
        the trailing update outputs are ignored). With the call's ``leaves``, an output that
        is a returned input is that input object itself."""
        if len(flat) != len(self.output_names):
            raise ValueError(
                f"restore_outputs needs the {len(self.output_names)} graph outputs "
                f"{self.output_names}, got {len(flat)} tensors"
            )
        user = list(flat[: self.n_user_outputs])
        if leaves is not None:
            for position, leaf in self.returned_inputs:
                user[position] = leaves[leaf]
        tensors = iter(user)
        leaves = [
            s.value if isinstance(s, StaticSpec) else next(tensors)
            for s in self.output_schema.leaves
        ]
        return io.unflatten(self.output_schema.treespec, leaves)
