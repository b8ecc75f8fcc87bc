"""The two torch exporters ortfx drives, and what the TorchScript tracer says it baked in.

* ``torchscript``: ``torch.onnx.export(..., dynamo=False)``. Fast (about 0.5 s for a 5M-parameter
  GPT); parameters and buffers become graph inputs named by their module path. ortfx's symbolics
  (:mod:`ortfx.export.symbolics`, the PythonOp one) are registered for the export only.
* ``dynamo``: ``torch.export`` of a functional wrapper that takes parameters and buffers as
  explicit inputs (``torch.func.functional_call``), then ``torch.onnx.export`` of that program at
  opset 18 with ortfx's translation table for that call. Slower, but survives graphs the tracer
  bakes sizes into. Needs ``onnxscript``.
"""

from __future__ import annotations

import contextlib
import io as _io
import linecache
import os
import re
import sys
import threading
import types
import warnings
from collections.abc import Iterator
from typing import Any, Protocol

import onnx
import torch

from ortfx import _torch
from ortfx.errors import OrtfxExportError
from ortfx.export import functions, reads

DYNAMO_NEEDS_ONNXSCRIPT = (
    "the dynamo exporter needs the onnxscript package, which is not installed. "
    "Install it (`pip install ortfx[dynamo]`) or use Options(exporter='torchscript')."
)
NO_TORCHSCRIPT_EXPORTER = (
    "Options(exporter='torchscript') was requested, but this torch ({version}) no longer ships "
    "the TorchScript ONNX exporter (torch.jit tracing and torch.onnx.export(..., dynamo=False)). "
    "Use Options(exporter='dynamo'), or 'auto', which picks dynamo on this torch."
)


def torchscript_available() -> bool:
    """Whether this torch still ships the TorchScript exporter (moved in 2.9, deprecated)."""
    return _torch.torchscript_exporter_available()


def resolve_exporter(requested: str) -> str:
    """Turn ``"auto"`` into a real exporter: TorchScript while torch ships it."""
    if requested != "auto":
        return requested
    return "torchscript" if torchscript_available() else "dynamo"


class Traceable(Protocol):
    """The flat call an exporter traces (:class:`ortfx.export.trace.FlatCall`)."""

    def __call__(self, *tensors: torch.Tensor) -> Any: ...

    def named_parameters(self) -> Any: ...

    def named_buffers(self) -> Any: ...


def torchscript(
    flat: Traceable,
    tensors: tuple[torch.Tensor, ...],
    input_names: list[str],
    opset: int,
) -> onnx.ModelProto:
    try:
        _torch.tracer_warning()
    except ImportError as e:
        raise OrtfxExportError(NO_TORCHSCRIPT_EXPORTER.format(version=torch.__version__)) from e
    # Imported here: it imports torch.onnx's TorchScript modules, which a torch without
    # TorchScript lacks (ortfx still imports there and exports with dynamo).
    from ortfx.export import symbolics

    table = [("prim::PythonOp", functions.pythonop_symbolic, 1), *symbolics.table(opset)]
    buffer = _io.BytesIO()
    dynamic_axes = {
        name: {d: f"{name}_dim{d}" for d in range(t.dim())}
        for name, t in zip(input_names, tensors, strict=True)
    }
    with quiet(), _torch.symbolics_registered(table), _torch.shape_inference_without_weights():
        _export(flat, tensors, buffer, opset, input_names, dynamic_axes)
    return onnx.load_model_from_string(buffer.getvalue())


# The exporters' own warnings, by the module they are attributed to: deprecations inside
# torch.onnx and torch.export and their helpers (torch.fx, pytree notices through copyreg),
# onnxscript's, torch.onnx.export's about its caller (ortfx's exporter module), and what torch's
# C++ passes raise when ortfx calls them through ortfx._torch (the scoped shape inference: a
# C++ warning is attributed to the Python frame that called the pass).
_EXPORTER_MODULES = re.compile(
    r"(torch\.(onnx|export|_export|jit|fx|_subclasses|_functorch|_dynamo|_higher_order_ops"
    r"|_library|_guards|_ops|utils\._pytree)|onnxscript|onnx_ir|onnx\b|copyreg"
    r"|ortfx\.export\.(exporters|trace)|ortfx\._torch)"
)
_QUIET = threading.local()  # .depth: exports running on this thread


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """While exporting, the exporters' own warnings are not shown, not even turned into errors
    (``-W error``, pytest's ``filterwarnings = error``): the tracer's notes on values it bakes
    in (ortfx reports them itself) and what the exporters' modules warn about themselves. The
    forward's own warnings are shown as in eager, on the forward's line.

    Two filters (by category, and by the module a warning is attributed to) sit in front of the
    process's filters for the export's duration: another thread's warnings attributed to those
    modules are ignored meanwhile too (docs/architecture.md). On the exporting thread a
    shown-warning hook drops what is raised outside the forward and puts a warning an op of the
    forward raised inside ortfx's watch back on the forward's line; it acts only while this
    thread exports, so a copy of it kept by someone else's ``catch_warnings`` does nothing."""
    tracer_warning = _torch.tracer_warning()
    ours = [
        ("ignore", None, tracer_warning, None, 0),
        ("ignore", None, Warning, _EXPORTER_MODULES, 0),
    ]
    filters: list[Any] = warnings.filters  # type: ignore[assignment]  # a list at run time
    added = [f for f in ours if f not in filters]
    for f in reversed(added):
        filters.insert(0, f)
    _filters_changed()
    previous = warnings.showwarning
    show = _shown_through(previous, tracer_warning)
    warnings.showwarning = show
    _QUIET.depth = getattr(_QUIET, "depth", 0) + 1
    try:
        yield
    finally:
        _QUIET.depth -= 1
        if warnings.showwarning is show:  # else someone replaced it meanwhile: theirs stays
            warnings.showwarning = previous
        for f in added:
            with contextlib.suppress(ValueError):
                filters.remove(f)
        _filters_changed()


def _filters_changed() -> None:
    """Tell the warnings machinery its filters changed (it caches decisions per version)."""
    changed = getattr(warnings, "_filters_mutated", None)
    if changed is not None:
        changed()


def _shown_through(previous: Any, tracer_warning: type[Warning]) -> Any:
    def show(message: Any, category: type[Warning], filename: str, lineno: int, *rest: Any) -> None:
        if getattr(_QUIET, "depth", 0):  # this thread is exporting
            if issubclass(category, tracer_warning) or not reads.IN_FORWARD.get():
                return  # the exporters' own (ortfx reports baked values itself)
            if filename in _HANDLERS:  # an op the forward ran, through ortfx's watch
                filename, lineno = _caller_outside(sys._getframe(1))
        previous(message, category, filename, lineno, *rest)

    return show


# ortfx's files an op of the user's forward passes through while traced: a warning the op
# raises names them (torch's stacklevel counts frames), and is put on the user's line instead.
_HANDLERS = frozenset({reads.__file__})


def _caller_outside(frame: types.FrameType | None) -> tuple[str, int]:
    """The file and line of the first frame outside the warnings machinery, torch and ortfx."""
    skipped = ("warnings", "torch.", "ortfx.")
    while frame is not None and frame.f_globals.get("__name__", "").startswith(skipped):
        frame = frame.f_back
    if frame is None:
        return "<unknown>", 0
    return frame.f_code.co_filename, frame.f_lineno


def baked(conversions: list[tuple[str, str, int]]) -> tuple[tuple[str, ...], bool]:
    """The log lines for the Python values the trace took from tensors, each marked
    ``BRANCH`` when a boolean in the user's own code on a line that reads no sizes, and whether
    the user's own code took a number (not a boolean) from a tensor."""
    lines = tuple(
        dict.fromkeys(
            _baked_kind(filename, lineno, kind)
            + f"{_CONVERTED[kind] if kind in _CONVERTED else _CONVERTING.format(kind=kind)} "
            f"({os.path.basename(filename)}:{lineno})"
            for kind, filename, lineno in conversions
        )
    )
    numbers = any(
        kind != "boolean" and not any(lib in filename for lib in _LIBRARIES)
        for kind, filename, _ in conversions
    )
    return lines, numbers


_CONVERTING = "Converting a tensor to a Python {kind} might cause the trace to be incorrect."
_CONVERTED = {
    "len": "Using len to get tensor shape might cause the trace to be incorrect.",
    "iteration": "Iterating over a tensor might cause the trace to be incorrect.",
}


def _export(
    flat: Traceable,
    tensors: tuple[torch.Tensor, ...],
    buffer: _io.BytesIO,
    opset: int,
    input_names: list[str],
    dynamic_axes: dict[str, dict[int, str]],
) -> None:
    torch.onnx.export(
        flat,  # type: ignore[arg-type]
        tensors,
        buffer,  # type: ignore[arg-type]  # file-like objects are accepted
        dynamo=False,
        do_constant_folding=False,
        export_params=False,
        keep_initializers_as_inputs=True,
        opset_version=opset,
        # PRESERVE follows module.training; the default (EVAL) would silently drop dropout.
        training=torch.onnx.TrainingMode.PRESERVE,
        input_names=input_names,
        dynamic_axes=dynamic_axes,
        # Keep each custom autograd.Function a prim::PythonOp (exported as ORT's PythonOp)
        # instead of inlining its forward, whose traced gradient would replace its backward.
        autograd_inlining=False,
    )


# A source line that reads sizes: a Python value computed there comes from shapes, which the
# graph sees as dynamic. Installed libraries (torch's MultiheadAttention, transformers) branch on
# sizes they computed lines before; a boolean in the user's own code is taken as a branch on
# tensor values.
_SIZE_WORDS = ("shape", "size(", "dim(", "len(", "numel", "ndim")
_LIBRARIES = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
BRANCH = "branch: "


def _baked_kind(filename: str, lineno: int, kind: str) -> str:
    """``BRANCH`` for a tensor turned into a Python boolean in the user's own code, on a line
    that reads no sizes."""
    if kind != "boolean" or any(lib in filename for lib in _LIBRARIES):
        return ""
    line = linecache.getline(filename, lineno)
    return "" if any(word in line for word in _SIZE_WORDS) else BRANCH


def dynamo(
    flat: Traceable,
    tensors: tuple[torch.Tensor, ...],
    input_names: list[str],
    opset: int,
) -> onnx.ModelProto:
    try:
        from ortfx.export import translations  # imports onnxscript
    except ImportError as e:
        raise OrtfxExportError(DYNAMO_NEEDS_ONNXSCRIPT) from e
    from ortfx.export import dynamo_bounds

    state = {
        **{n: p for n, p in flat.named_parameters()},
        **{n: b for n, b in flat.named_buffers()},
    }
    names = list(state)

    class Functional(torch.nn.Module):
        def forward(self, *flat_inputs: torch.Tensor) -> Any:
            user, weights = flat_inputs[: len(tensors)], flat_inputs[len(tensors) :]
            return torch.func.functional_call(
                flat,  # type: ignore[arg-type]
                dict(zip(names, weights, strict=True)),
                tuple(user),
            )

    weights = tuple(state[n].detach() for n in names)
    # Every dim of a user input is dynamic; parameters are fixed-size.
    dims: list[dict[int, Any] | None] = [
        {d: torch.export.Dim.AUTO for d in range(t.dim())} for t in tensors
    ]
    dims += [None] * len(weights)
    with quiet():
        with dynamo_bounds.checked():  # PyTorch's index bounds (TorchScript: indexing.py)
            program = torch.export.export(
                Functional(), (*tensors, *weights), dynamic_shapes=(tuple(dims),)
            )
        onnx_program = torch.onnx.export(
            program,
            dynamo=True,
            custom_translation_table={**translations.table(), **dynamo_bounds.translations()},
            opset_version=max(opset, 18),
            optimize=True,
            input_names=[*input_names, *names],
            verbose=False,
        )
    assert onnx_program is not None
    model = onnx_program.model_proto
    dynamo_bounds.expand(model)
    return model
