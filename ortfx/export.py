"""Export a module, for one call schema, to an ONNX model over flat tensors.

This is the only module that touches the torch ONNX exporter, and so the only place where torch's
private or deprecated exporter API may be used; if torch moves it again, the error is raised here
with the fix.

Two exporters sit behind :func:`export`:

* ``torchscript``: ``torch.onnx.export(..., dynamo=False)``. Fast (about 0.5 s for a 5M-parameter
  GPT); parameters and buffers become graph inputs named by their module path.
* ``dynamo``: ``torch.export`` of a functional wrapper that takes parameters and buffers as
  explicit inputs (``torch.func.functional_call``), then ``torch.onnx.export`` of that program at
  opset 18. Slower, but survives graphs the tracer bakes sizes into. Needs ``onnxscript``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io as _io
import linecache
import os
import random
import re
import sys
import threading
import time
import types
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
import onnx
import optree
import torch

from ortfx import io
from ortfx.errors import OrtfxExportError, OrtfxIOError
from ortfx.model_info import InputKind, InputSpec, PostExportProcessedModelInfo, Update
from ortfx.options import ExportOptions
from ortfx.schema import ModelSchema, TensorSpec

E = TypeVar("E", bound=BaseException)

# torch's exporters keep process-wide state (GLOBALS.in_onnx_export, the tracing state): one
# export at a time in the process. Reentrant: a module exported inside another's export.
_EXPORT_LOCK = threading.RLock()
_EXPORTING = threading.local()


def exporting() -> bool:
    """Whether this thread is inside :func:`export` (a wrapper called from a forward being
    exported runs its module as plain code, so the outer graph takes it in)."""
    return bool(getattr(_EXPORTING, "depth", 0))


@contextlib.contextmanager
def _one_export_at_a_time() -> Iterator[None]:
    with _EXPORT_LOCK:
        _EXPORTING.depth = getattr(_EXPORTING, "depth", 0) + 1
        try:
            yield
        finally:
            _EXPORTING.depth -= 1


EXPORT_FAILED = (
    "exporting {module} to ONNX with the {exporter} exporter failed for inputs {schema}: "
    "{error_type}: {error}. If the model uses an operation this exporter cannot express, try the "
    "other exporter (Options(exporter={other!r})), or let ortfx fall back to PyTorch."
)

DYNAMO_NEEDS_ONNXSCRIPT = (
    "the dynamo exporter needs the onnxscript package, which is not installed. "
    "Install it (`pip install ortfx[dynamo]`) or use Options(exporter='torchscript')."
)

GRADIENT_HOOK_IN_FORWARD = (
    "the forward of {module} registers a gradient hook on an intermediate tensor "
    "(Tensor.register_hook at {where}); ONNX Runtime computes the backward of the exported "
    "graph without it, so the gradients would differ from PyTorch's. Write the change to the "
    "gradient as a custom torch.autograd.Function (ortfx runs it inside the graph with its "
    "backward), or run the module in PyTorch (the default fallback policy does)."
)
INTERMEDIATE_REQUIRES_GRAD = (
    "the forward of {module} reads {attribute} of {what} ({where}); ortfx traces "
    "the forward without autograd, where it reads as for a tensor without gradient, while in "
    "PyTorch it can say the tensor was computed from one that requires grad, so the graph "
    "could take another branch than PyTorch. Read requires_grad of the module's inputs or "
    "parameters, or torch.is_grad_enabled(), instead, or run the module in PyTorch (the "
    "default fallback policy does)."
)
COMPUTED = "a tensor it computed"
AN_INPUT = (
    "an input (whether the caller's tensor is a leaf, or has a grad_fn, is not part of what "
    "ortfx keys its graphs on)"
)
COMPUTED_OR_COPY = (
    "a tensor it computed or an input (the dynamo exporter traces copies that do not say "
    "whether the caller's tensors require grad)"
)
CUSTOM_FUNCTIONS_DISABLED = (
    "the module calls the custom torch.autograd.Function(s) {names}, and custom Functions are "
    "turned off (Options(enable_custom_autograd_function=False) or "
    "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0). Exporting would inline their forward and train with "
    "its traced gradient instead of their backward. Turn the option on to run them inside the "
    "ORT graph as PythonOp nodes, or run the module in PyTorch."
)

NO_TORCHSCRIPT_EXPORTER = (
    "Options(exporter='torchscript') was requested, but this torch ({version}) no longer ships "
    "the TorchScript ONNX exporter (torch.jit tracing and torch.onnx.export(..., dynamo=False)). "
    "Use Options(exporter='dynamo'), or 'auto', which picks dynamo on this torch."
)


def torchscript_available() -> bool:
    """Whether this torch still ships the TorchScript exporter (moved in 2.9, deprecated)."""
    try:
        _tracer_warning()
        importlib.import_module("torch.onnx._internal.torchscript_exporter")
    except ImportError:
        try:  # before torch 2.9 the exporter lived in torch.onnx.utils
            return hasattr(importlib.import_module("torch.onnx.utils"), "_export")
        except ImportError:
            return False
    return True


def _tracer_warning() -> type[Warning]:
    """TorchScript's TracerWarning, imported on use: ``import ortfx`` must survive a torch
    without TorchScript, where the dynamo exporter takes over."""
    from torch.jit._trace import TracerWarning  # the public alias is untyped

    return TracerWarning


def resolve_exporter(requested: str) -> str:
    """Turn ``"auto"`` into a real exporter: TorchScript while torch ships it."""
    if requested != "auto":
        return requested
    return "torchscript" if torchscript_available() else "dynamo"


@contextlib.contextmanager
def preserved_random_state() -> Iterator[None]:
    """Export runs the module; the user's Python, numpy and torch RNG streams must not move."""
    py_state = random.getstate()
    np_state = np.random.get_state()
    torch_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


@attrs.frozen
class Exported:
    """What one export produced."""

    info: PostExportProcessedModelInfo
    seconds: float
    checkpoint_calls: int  # torch.utils.checkpoint calls traced directly
    tracer_warnings: tuple[str, ...] = ()  # values the tracer baked in, with their location
    # Graph names of the custom autograd.Functions exported as PythonOp nodes.
    custom_functions: tuple[str, ...] = ()
    # The module asked torch.is_grad_enabled() while traced: its graph can depend on grad mode
    # (transformers' checkpointed layers take the checkpoint branch only with grad enabled).
    reads_grad_mode: bool = False
    # The forward read requires_grad of an input or a parameter while traced: its graph can
    # depend on which of them require grad.
    reads_grad_flags: bool = False
    # The user's own code turned a tensor (often a size) into a Python number while traced.
    numbers_from_tensors: bool = False


# The keywords torch.utils.checkpoint.checkpoint takes for itself; the rest go to the function.
_CHECKPOINT_KEYWORDS = frozenset(
    {
        "use_reentrant",
        "preserve_rng_state",
        "context_fn",
        "determinism_check",
        "debug",
        "early_stop",
        "respect_saved_tensors_hooks",
    }
)


def _rebind(
    namespace: dict[str, Any], original: Any, replacement: Any
) -> list[tuple[dict[str, Any], str, Any]]:
    """Point every name in ``namespace`` bound to ``original`` (or a ``functools.partial`` of
    it, as transformers stores) at ``replacement``; return what to put back."""
    undo = []
    for name, value in list(namespace.items()):
        if value is original:
            namespace[name] = replacement
        elif isinstance(value, functools.partial) and value.func is original:
            namespace[name] = functools.partial(replacement, *value.args, **value.keywords)
        else:
            continue
        undo.append((namespace, name, value))
    return undo


# Modules whose questions about grad mode are torch's bookkeeping, not the model's branches.
_TORCH_MACHINERY = ("torch.autograd", "torch.onnx", "torch.jit", "torch._")


class _NoGradRegion(torch.overrides.TorchFunctionMode):
    """On while the forward's own ``torch.no_grad()`` region runs in the export of a call made
    with grad enabled: an op there that reads a tensor which may carry a gradient gives its
    outputs through ``detach``, which the exporter keeps as a gradient stop (ATen ``detach``).
    Eager gives such outputs no gradient; without this, ORT differentiated through them.

    May carry a gradient: parameters and user inputs that require grad, and any tensor made
    before the region (the export runs under ``no_grad``, so which of those derive from
    parameters is unknown: a needless stop changes no gradient). Not: buffers, and what the
    region made itself.
    """

    def __init__(self, buffers: set[int], inputs: dict[int, bool]) -> None:
        super().__init__()
        self.buffers, self.inputs = buffers, inputs
        self.made: dict[int, torch.Tensor] = {}  # kept alive, so that ids stay unique
        self.handling = 0  # inside a handler torch has popped this mode: never push or pop

    def _carries(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return False
        if id(t) in self.made or id(t) in self.buffers:
            return False
        if isinstance(t, torch.nn.Parameter):
            return t.requires_grad
        return self.inputs.get(id(t), True)

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        self.handling += 1
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.handling -= 1
        given: Any = (args, kwargs or {})
        stop = func not in _NOT_DETACHED and any(
            self._carries(a) for a in optree.tree_leaves(given, namespace=io.NAMESPACE)
        )
        in_place = getattr(func, "__name__", "").endswith("_")

        def mark(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if stop and not in_place and value.is_floating_point():
                    value = value.detach()
                self.made[id(value)] = value
            return value

        return optree.tree_map(mark, out, namespace=io.NAMESPACE)


_NOT_DETACHED = frozenset({torch.Tensor.detach, torch.Tensor.requires_grad_})


@contextlib.contextmanager
def grad_mode_as_called(enabled: bool, region: _NoGradRegion | None = None) -> Iterator[list[int]]:
    """Trace with autograd off, while the module sees the call's grad mode.

    Code may branch on grad mode: transformers' checkpointed layers take the checkpoint branch,
    and drop their cache arguments, only with grad enabled. On the exporting thread, grad-mode
    changes become virtual (autograd itself stays off: tracing records no backward graph) and
    ``torch.is_grad_enabled()`` answers the virtual mode, starting from ``enabled``. With
    ``region``, the forward's own no-grad regions become gradient stops (:class:`_NoGradRegion`,
    entered and left with them, so that outside them the tracer's warnings keep pointing at
    the model's lines). Yields a one-item list counting the module's questions.
    """
    asked = [0]
    real, set_real = torch.is_grad_enabled, torch._C._set_grad_enabled
    exporting = threading.get_ident()
    virtual = [enabled]
    active = [False]

    def answer() -> bool:
        if threading.get_ident() != exporting:
            return real()  # a concurrent inference call on another thread
        # Grad-mode contexts saving the mode to restore, and the exporter, are not the model.
        if not sys._getframe(1).f_globals.get("__name__", "").startswith(_TORCH_MACHINERY):
            asked[0] += 1
        return virtual[0]

    def setting(mode: bool) -> None:
        if threading.get_ident() != exporting:
            set_real(mode)
            return
        virtual[0] = mode
        want = region is not None and enabled and not mode
        if region is None or region.handling or want == active[0]:
            return  # (inside a handler: the region's mode is popped; it stays as it is)
        if want:
            region.__enter__()  # type: ignore[no-untyped-call]
        else:
            region.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        active[0] = want

    with torch.no_grad():
        torch.is_grad_enabled = answer
        torch._C._set_grad_enabled = setting  # type: ignore[assignment]
        try:
            yield asked
        finally:
            torch._C._set_grad_enabled = set_real
            torch.is_grad_enabled = real
            if active[0] and region is not None:
                region.__exit__(None, None, None)  # type: ignore[no-untyped-call]


@attrs.define
class GradFlagReads:
    """What the forward read of autograd attributes while traced (:func:`grad_flags_watched`)."""

    leaves: bool = False  # the graph depends on the call's requires_grad flags
    mode: bool = False  # ... and on grad mode
    # (attribute, file:line, what was read): a read the trace cannot answer as eager
    refused: tuple[str, str, str] | None = None


_AUTOGRAD_ATTRIBUTES = ("requires_grad", "grad_fn", "is_leaf")
# Code whose reads are bookkeeping, not the model's branches (checked by module name).
_TRUSTED_MODULES = ("torch.", "ortfx.")


def _inherited(name: str) -> Any:
    """``torch.Tensor``'s own ``name`` (a C descriptor or method), found through the public
    class's MRO, not by a private class name; read before any watcher shadows it."""
    return next(vars(k)[name] for k in torch.Tensor.__mro__ if name in vars(k))


_DESCRIPTORS = {name: _inherited(name) for name in _AUTOGRAD_ATTRIBUTES}
_REQUIRES_GRAD_ = _inherited("requires_grad_")


def _line_of(frame: Any) -> str:
    """``file:line`` of a frame, for messages that point at the user's code."""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


@contextlib.contextmanager
def grad_flags_watched(
    grad_enabled: bool,
    any_grad: bool,
    inputs: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    *,
    dynamo: bool = False,
) -> Iterator[GradFlagReads]:
    """Watch reads of ``requires_grad``, ``grad_fn`` and ``is_leaf`` on the exporting thread.

    The export runs under ``no_grad``, so a tensor the forward computes reads as one without
    gradient; in eager, with grad enabled and some input, parameter or buffer requiring grad
    (``any_grad``, or a tensor the forward itself makes require grad), it may not. Such a read
    from code outside torch and ortfx (which read them for bookkeeping) is recorded and the
    export refused. Otherwise the answer is eager's, but the graph depends on the flags and grad
    mode it was traced with (``leaves``, ``mode``): the entry must not serve calls with others.
    ``requires_grad`` of the inputs (traced clones carrying the caller's flags), buffers and
    parameters answers as in eager, wherever it is read; ``is_leaf`` and ``grad_fn`` of an input
    depend on how the caller made it, which no key holds: refused. The dynamo exporter traces
    copies: there a True answer marks a leaf, and a False one cannot be trusted when a flag is
    set, in either mode. Shadowing attributes on ``torch.Tensor`` for the export's duration;
    other threads get the plain answer."""
    reads = GradFlagReads()
    given = {id(t) for t in inputs}
    known = given | {id(t) for t in buffers}
    exporting = threading.get_ident()
    # A False answer may not be eager's: with grad (computed tensors), and with the dynamo
    # exporter in any mode (its copies of inputs and parameters all read False).
    unsure = [any_grad and (grad_enabled or dynamo)]

    def refuse(name: str, caller: Any, what: str) -> None:
        if reads.refused is None:
            reads.refused = (name, _line_of(caller), what)

    def made_to_require_grad() -> None:
        # The forward makes a tensor require grad: what it computes from it would in eager.
        reads.leaves = reads.mode = True
        unsure[0] = unsure[0] or grad_enabled or dynamo

    def watcher(name: str) -> property:
        descriptor = _DESCRIPTORS[name]

        def get(self: torch.Tensor) -> Any:
            value = descriptor.__get__(self)
            if threading.get_ident() != exporting:
                return value
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith((*_TORCH_MACHINERY, *_TRUSTED_MODULES)):
                return value  # the exporter's, autograd's, torch's and ortfx's bookkeeping
            if name != "requires_grad" and id(self) in given:
                refuse(name, caller, AN_INPUT)
                return value
            if name == "requires_grad" and (
                id(self) in known or isinstance(self, torch.nn.Parameter) or (dynamo and value)
            ):
                reads.leaves = True  # answers as in eager, for these flags
                return value
            if not (self.is_floating_point() or self.is_complex()):
                return value  # never requires grad, in eager either
            if unsure[0]:
                refuse(name, caller, COMPUTED_OR_COPY if dynamo else COMPUTED)
            else:  # eager reads it so too: for these flags and this grad mode
                reads.leaves = reads.mode = True
            return value

        def put(self: torch.Tensor, value: Any) -> None:
            if value and name == "requires_grad" and threading.get_ident() == exporting:
                made_to_require_grad()
            descriptor.__set__(self, value)

        return property(get, put)

    def requires_grad_(self: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
        if requires_grad and threading.get_ident() == exporting:
            made_to_require_grad()
        changed: torch.Tensor = _REQUIRES_GRAD_(self, requires_grad)
        return changed

    names = (*_AUTOGRAD_ATTRIBUTES, "requires_grad_")
    saved = {name: torch.Tensor.__dict__.get(name) for name in names}
    for name in _AUTOGRAD_ATTRIBUTES:
        setattr(torch.Tensor, name, watcher(name))
    torch.Tensor.requires_grad_ = requires_grad_  # type: ignore[method-assign,assignment]
    try:
        yield reads
    finally:
        for name, before in saved.items():
            if before is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, before)


@contextlib.contextmanager
def gradient_hooks_watched(grad_enabled: bool) -> Iterator[list[str]]:
    """For a call with grad enabled, record where the forward calls ``Tensor.register_hook``
    while traced (exporting thread only), as ``file:line``; the call does nothing then (under
    the export's ``no_grad`` it would raise, and the graph could not honour it anyway). For a
    call without grad it raises as in eager."""
    found: list[str] = []
    real = torch.Tensor.register_hook
    exporting = threading.get_ident()

    def watched(self: torch.Tensor, hook: Any) -> Any:
        if not grad_enabled or threading.get_ident() != exporting:
            return real(self, hook)  # type: ignore[no-untyped-call]
        found.append(_line_of(sys._getframe(1)))
        return _NoHandle()

    torch.Tensor.register_hook = watched  # type: ignore[method-assign]
    try:
        yield found
    finally:
        torch.Tensor.register_hook = real  # type: ignore[method-assign]


class _NoHandle:
    """What ``register_hook`` returns while traced: removing it does nothing."""

    def remove(self) -> None:
        pass


@contextlib.contextmanager
def checkpoints_traced_directly(module: torch.nn.Module) -> Iterator[list[int]]:
    """Trace the function inside ``torch.utils.checkpoint.checkpoint`` as plain code.

    The reentrant variant is an autograd.Function the exporter cannot express; recompute is
    ORT's job (the memory optimizer). Yields a one-item list counting the calls.

    Counted through public names only (torch moves checkpoint's internals between releases):
    ``checkpoint`` itself, every binding of it that ``module``'s code holds (a module-level
    ``from torch.utils.checkpoint import checkpoint`` in the files defining its submodules'
    classes, a ``functools.partial`` of it stored on a submodule), and ``CheckpointFunction``,
    which the original reentrant variant still reaches from any other binding.
    """
    from torch.utils import checkpoint as ckpt

    calls = [0]
    public, reentrant = ckpt.checkpoint, ckpt.CheckpointFunction

    def direct(function: Any = None, *args: Any, **kwargs: Any) -> Any:
        if function is None:  # the decorator form, checkpoint(use_reentrant=False)(fn)
            return functools.partial(direct, **kwargs)
        own = {k: kwargs.pop(k) for k in _CHECKPOINT_KEYWORDS & kwargs.keys()}
        if kwargs and own.get("use_reentrant") is not False:
            # as torch: only the non-reentrant variant passes keywords on to the function
            raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
        calls[0] += 1
        return function(*args, **kwargs)

    class Direct:
        @staticmethod
        def apply(function: Any, _preserve: bool, *args: Any) -> Any:
            calls[0] += 1
            return function(*args)

    undo = _rebind(vars(ckpt), public, direct)
    undo += _rebind(vars(ckpt), reentrant, Direct)
    try:
        for m in module.modules():
            undo += _rebind(vars(m), public, direct)
            for klass in type(m).__mro__:
                code = sys.modules.get(klass.__module__)
                if code is not None and code is not ckpt:
                    undo += _rebind(vars(code), public, direct)
        yield calls
    finally:
        for namespace, name, value in reversed(undo):
            namespace[name] = value


# ---- custom autograd.Functions as ORT PythonOp nodes ------------------------------------------

# Graph name -> Function class, and back. The graph name is the fully qualified class name; a
# second class with the same name (a class defined again by a factory) gets a "#n" suffix, so
# ORT never runs the wrong one.
_FUNCTIONS: dict[str, type] = {}
_FUNCTION_NAMES: dict[type, str] = {}
# Non-numeric constant arguments reach ORT as object addresses: keep the objects alive.
_CONSTANTS: dict[int, Any] = {}

# ONNX element types of the TorchScript scalar types a PythonOp input or output can have.
_ONNX_TYPES = {
    "Float": onnx.TensorProto.FLOAT,
    "Double": onnx.TensorProto.DOUBLE,
    "Half": onnx.TensorProto.FLOAT16,
    "BFloat16": onnx.TensorProto.BFLOAT16,
    "Long": onnx.TensorProto.INT64,
    "Int": onnx.TensorProto.INT32,
    "Short": onnx.TensorProto.INT16,
    "Char": onnx.TensorProto.INT8,
    "Byte": onnx.TensorProto.UINT8,
    "Bool": onnx.TensorProto.BOOL,
}


def function_graph_name(cls: type) -> str:
    """The name ``cls`` has in exported graphs and in ORT's function registry."""
    name = _FUNCTION_NAMES.get(cls)
    if name is None:
        base = name = f"{cls.__module__}.{cls.__qualname__}"
        n = 1
        while name in _FUNCTIONS:
            n += 1
            name = f"{base}#{n}"
        _FUNCTIONS[name] = cls
        _FUNCTION_NAMES[cls] = name
    return name


def pythonop_functions(model: bytes) -> dict[str, type]:
    """The Function classes the PythonOp nodes of a serialized model run, by graph name."""
    if b"PythonOp" not in model:
        return {}
    names = {
        onnx.helper.get_attribute_value(a).decode()
        for node in onnx.load_model_from_string(model).graph.node
        if node.op_type == "PythonOp" and node.domain == "com.microsoft"
        for a in node.attribute
        if a.name == "func_name"
    }
    missing = names - _FUNCTIONS.keys()
    if missing:
        raise OrtfxExportError(
            f"the graph runs autograd.Function(s) {sorted(missing)} that this process never "
            "exported; PythonOp graphs can only run in the process that exported them."
        )
    return {name: _FUNCTIONS[name] for name in names}


def _is_custom(cls: type) -> bool:
    # ortfx's own Functions (a nested ORTModule's) are not the user's.
    return not cls.__module__.startswith("ortfx.")


# The innermost running export's record of the custom Functions it met.
_RECORDING: list[dict[str, type]] = []
_APPLY_CODE = torch.autograd.Function.__dict__["apply"].__func__.__code__


def _record(cls: type) -> None:
    if _RECORDING and _is_custom(cls):
        _RECORDING[-1].setdefault(function_graph_name(cls), cls)


@contextlib.contextmanager
def functions_called(*, profile: bool) -> Iterator[dict[str, type]]:
    """Record the custom ``torch.autograd.Function`` classes an export meets.

    The TorchScript exporter reports each one to the ``prim::PythonOp`` symbolic. Exporters that
    inline Functions silently are watched with ``profile=True``: a profile hook sees every call
    of ``Function.apply``, however the user bound it (``f = MyFunction.apply`` included).
    """
    found: dict[str, type] = {}
    _RECORDING.append(found)
    previous = sys.getprofile()

    def hook(frame: types.FrameType, event: Any, arg: Any) -> None:
        if event == "call" and frame.f_code is _APPLY_CODE:
            cls = frame.f_locals.get("cls")
            if isinstance(cls, type):
                _record(cls)
        if previous is not None:
            previous(frame, event, arg)

    if profile:
        sys.setprofile(hook)
    try:
        yield found
    finally:
        if profile:
            sys.setprofile(previous)
        _RECORDING.pop()


def _pythonop_symbolic(g: Any, *args: Any, **kwargs: Any) -> Any:
    """``prim::PythonOp`` -> ``com.microsoft::PythonOp`` with the attributes ORT 1.19 reads."""
    node = g.original_node
    cls = node.pyobj().__self__
    _record(cls)
    cconv = node.cconv()
    tensors: list[Any] = []
    attributes: dict[str, Any] = {"input_tensor_types_i": [], "input_tensor_ranks_i": []}

    def add(kind: str, value: Any, position: int, suffix: str = "i") -> None:
        attributes.setdefault(f"input_{kind}s_{suffix}", []).append(value)
        attributes.setdefault(f"input_{kind}_positions_i", []).append(position)

    def add_tuple(kind: str, values: list[Any], position: int, suffix: str) -> None:
        begins = attributes.setdefault(f"input_{kind}_tuple_begins_i", [])
        begins.append(len(attributes.get(f"input_{kind}_tuples_{suffix}", [])))
        attributes.setdefault(f"input_{kind}_tuples_{suffix}", []).extend(values)
        attributes.setdefault(f"input_{kind}_tuple_positions_i", []).append(position)

    for position, (arg, convention) in enumerate(zip(args, cconv, strict=True)):
        if convention == "d":
            tensors.append(arg)
            attributes["input_tensor_types_i"].append(_onnx_type(arg, cls))
            attributes["input_tensor_ranks_i"].append(arg.type().dim())
        elif isinstance(arg, bool):  # before int: bool is an int
            add("bool_scalar", int(arg), position)
        elif isinstance(arg, int):
            add("int_scalar", arg, position)
        elif isinstance(arg, float):
            add("float_scalar", arg, position, "f")
        elif isinstance(arg, tuple) and arg and all(type(v) is bool for v in arg):
            add_tuple("bool", [int(v) for v in arg], position, "i")
        elif isinstance(arg, tuple) and arg and all(type(v) is int for v in arg):
            add_tuple("int", list(arg), position, "i")
        elif isinstance(arg, tuple) and arg and all(type(v) is float for v in arg):
            add_tuple("float", list(arg), position, "f")
        else:
            # str, None, mixed tuples, other objects: ORT passes the object itself.
            _CONSTANTS[id(arg)] = arg
            add("pointer_scalar", id(arg), position)
    outputs = list(node.outputs())
    return g.op(
        "com.microsoft::PythonOp",
        *tensors,
        outputs=len(outputs),
        func_name_s=function_graph_name(cls),
        input_convention_s=cconv,
        output_tensor_types_i=[_onnx_type(o, cls) for o in outputs],
        output_tensor_ranks_i=[o.type().dim() for o in outputs],
        # ortfx decides per run whether a backward follows (see runtime/pythonop.py).
        training_mode_i=1,
        **attributes,
    )


def _onnx_type(value: Any, cls: type) -> int:
    scalar = value.type().scalarType()
    if scalar not in _ONNX_TYPES:
        raise OrtfxExportError(
            f"the autograd.Function {cls.__qualname__} takes or returns a tensor of type "
            f"{scalar}, which ORT's PythonOp cannot carry; supported: {', '.join(_ONNX_TYPES)}."
        )
    return _ONNX_TYPES[scalar]


_symbolic_registered: list[bool] = []


def _register_pythonop_symbolic() -> None:
    if not _symbolic_registered:
        torch.onnx.register_custom_op_symbolic(  # type: ignore[attr-defined]
            "prim::PythonOp", _pythonop_symbolic, 1
        )
        _symbolic_registered.append(True)


def graph_name(path: str, taken: set[str]) -> str:
    """A tidy ONNX value name from a leaf path: ``args[1]['mask']`` -> ``args_1_mask``."""
    base = re.sub(r"[^0-9A-Za-z_.]+", "_", path).strip("_") or "value"
    name, n = base, 1
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    taken.add(name)
    return name


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by canonical name (a tied weight under its first name)."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


class _FlatCall(torch.nn.Module):
    """Calls the user's module from flat tensors and returns flat tensor outputs.

    Static leaves of the call are put back from the schema; the output structure and the
    static output leaves are recorded on the way out. Tensors the forward changes in place
    (parameters, buffers, inputs: seen through their version counters, or a buffer replaced
    by a new tensor) are returned after the user's outputs, so the graph computes their new
    values (``updates``); an output that is an input tensor itself is noted
    (``returned_inputs``). An exception the forward raises is kept in ``raised``.
    """

    def __init__(self, module: torch.nn.Module, leaves: Sequence[Any], schema: ModelSchema):
        super().__init__()
        self.module = module
        self._leaves = list(leaves)
        self._schema = schema
        self._tensor_positions = schema.tensor_indices()
        self.output_schema: ModelSchema | None = None
        self.output_leaves: list[Any] = []
        self.tracer_warnings: tuple[str, ...] = ()
        self.numbers_from_tensors = False
        self.updates: tuple[Update, ...] = ()
        self.returned_inputs: tuple[tuple[int, int], ...] = ()
        self.raised: BaseException | None = None

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self._leaves)
        for pos, t in zip(self._tensor_positions, tensors, strict=True):
            leaves[pos] = t
        args, kwargs = io.unflatten(self._schema.treespec, leaves)
        state = _state(self.module)
        versions = {name: t._version for name, t in state.items()}
        input_versions = [t._version for t in tensors]
        try:
            out = self.module(*args, **kwargs)
        except BaseException as e:
            self.raised = e
            raise
        with io.state_sources(io.call_tree(args, kwargs)):  # caches returned are the inputs'
            out_leaves, out_spec = io.flatten(out)
        io.check_leaves(out_leaves, out_spec, root="output", where="output")
        self.output_schema = ModelSchema.from_flat(out_leaves, out_spec, root="output")
        self.output_leaves = out_leaves
        outputs = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        by_id = {id(t): pos for pos, t in zip(self._tensor_positions, tensors, strict=True)}
        self.returned_inputs = tuple(
            (k, by_id[id(x)]) for k, x in enumerate(outputs) if id(x) in by_id
        )
        after = _state(self.module)
        updates: list[Update] = []
        extra: list[torch.Tensor] = []
        for name, t in after.items():
            if name in state and (state[name] is not t or t._version != versions[name]):
                updates.append(Update("state", name))
                extra.append(t)
        for pos, t, version in zip(self._tensor_positions, tensors, input_versions, strict=True):
            if t._version != version:
                updates.append(Update("input", pos))
                extra.append(t)
        self.updates = tuple(updates)
        return (*outputs, *extra)


def _batch_norm_train(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``_BatchNorm.forward`` in train mode with the running statistics updated by explicit
    tensor ops, which the exporter keeps in the graph (its own BatchNormalization would update
    them with the biased variance, and ``momentum=None`` is a Python value computed from
    ``num_batches_tracked``, which a trace would bake in)."""
    assert self.num_batches_tracked is not None
    self.num_batches_tracked.add_(1)
    factor = (1.0 / self.num_batches_tracked) if self.momentum is None else self.momentum
    dims = [0, *range(2, x.dim())]
    self.running_mean.mul_(1 - factor).add_(x.mean(dims) * factor)
    self.running_var.mul_(1 - factor).add_(x.var(dims, unbiased=True) * factor)
    channels = x.shape[1]
    # Placeholder statistics: in training mode the output uses the batch's own.
    mean, var = torch.zeros(channels, dtype=x.dtype), torch.ones(channels, dtype=x.dtype)
    out: torch.Tensor = torch.nn.functional.batch_norm(
        x, mean, var, self.weight, self.bias, True, 0.0, self.eps
    )
    return out


def _batch_norm_eval(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``_BatchNorm.forward`` with running statistics, as plain arithmetic: ORT's training
    graph turns a BatchNormalization node into its training form, which would normalize an
    eval-mode call with gradients by the batch's statistics instead of the running ones."""
    shape = [1, -1, *([1] * (x.dim() - 2))]
    scale = torch.rsqrt(self.running_var + self.eps)
    y: torch.Tensor = (x - self.running_mean.reshape(shape)) * scale.reshape(shape)
    if self.weight is not None:
        y = y * self.weight.reshape(shape) + self.bias.reshape(shape)
    return y


@contextlib.contextmanager
def batch_norm_updates_in_graph(module: torch.nn.Module) -> Iterator[None]:
    """Export each BatchNorm with running statistics through :func:`_batch_norm_train` (train
    mode) or :func:`_batch_norm_eval` (eval mode); set on the instances for the export only, so
    other modules and threads are untouched."""
    from torch.nn.modules.batchnorm import _BatchNorm  # the base class is private

    patched = [
        m
        for m in module.modules()
        if type(m).forward is _BatchNorm.forward
        and m.running_mean is not None
        and (m.track_running_stats or not m.training)
        and "forward" not in vars(m)
    ]
    for m in patched:
        body = _batch_norm_train if m.training else _batch_norm_eval
        m.forward = types.MethodType(body, m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


PARAMETER_CHANGED_IN_EXPORT = (
    "the forward of {module} changes parameter {name!r} in place (e.g. under torch.no_grad()); "
    "ortfx ran that forward once to export it, and the graph applies the change again on every "
    "call, so the parameter would be changed twice on this call. ortfx put back its value from "
    "before the export where it could not: make the change outside forward (e.g. after "
    "optimizer.step()), or call the module outside ortfx."
)


@contextlib.contextmanager
def state_preserved(module: torch.nn.Module) -> Iterator[None]:
    """Export runs the forward: buffers it changes (in place or by replacing the tensor) are
    put back afterwards, so export never changes the module. Parameters are not copied (that
    would double a large model's memory at export): one changed in place raises."""
    buffers = [
        (m, name, t, t._version, t.detach().clone())
        for m in module.modules()
        for name, t in m._buffers.items()
        if t is not None
    ]
    params = [
        (m, name, p, p._version)
        for m in module.modules()
        for name, p in m._parameters.items()
        if p is not None
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, t, version, saved in buffers:
                m._buffers[name] = t
                if t._version != version:
                    t.copy_(saved)
            for m, name, p, _ in params:
                m._parameters[name] = p
    changed = [n for m, n, p, version in params if p._version != version]
    if changed:
        raise OrtfxExportError(
            PARAMETER_CHANGED_IN_EXPORT.format(module=type(module).__name__, name=changed[0])
        )


def _parameter_sources(module: torch.nn.Module) -> dict[str, tuple[InputKind, str]]:
    """Graph name -> (kind, canonical name). Aliases of tied weights map to one canonical name."""
    sources: dict[str, tuple[InputKind, str]] = {}
    canonical: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
        sources["module." + name] = (InputKind.PARAMETER, canonical[id(p)])
    for name, b in module.named_buffers(remove_duplicate=False):
        canonical.setdefault(id(b), name)
        sources["module." + name] = (InputKind.BUFFER, canonical[id(b)])
    return sources


def _export_torchscript(
    flat: _FlatCall,
    tensors: tuple[torch.Tensor, ...],
    input_names: list[str],
    opset: int,
) -> onnx.ModelProto:
    try:
        tracer_warning = _tracer_warning()
    except ImportError as e:
        raise OrtfxExportError(NO_TORCHSCRIPT_EXPORTER.format(version=torch.__version__)) from e
    buffer = _io.BytesIO()
    dynamic_axes = {
        name: {d: f"{name}_dim{d}" for d in range(t.dim())}
        for name, t in zip(input_names, tensors, strict=True)
    }
    with warnings.catch_warnings(record=True) as caught:
        # The exporter is deprecated and warns on every trace: silence that. TracerWarnings
        # (a tensor turned into a Python value, baked into the graph) are kept for the log.
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", tracer_warning)
        _register_pythonop_symbolic()
        # Imported here: it imports torch.onnx's TorchScript modules, which a torch without
        # TorchScript lacks (ortfx still imports there and exports with dynamo).
        from ortfx import symbolics

        symbolics.register()  # aten::diff, grouped-query attention, ops run by torch (ATen)
        torch.onnx.export(
            flat,
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
    flat.numbers_from_tensors = any(
        _number_from_tensor(w.filename, str(w.message))
        for w in caught
        if issubclass(w.category, tracer_warning)
    )
    flat.tracer_warnings = tuple(
        dict.fromkeys(
            _baked_kind(w.filename, w.lineno, str(w.message))
            + f"{str(w.message).splitlines()[0]} ({os.path.basename(w.filename)}:{w.lineno})"
            for w in caught
            if issubclass(w.category, tracer_warning)
        )
    )
    return onnx.load_model_from_string(buffer.getvalue())


# A source line that reads sizes: a Python value computed there comes from shapes, which the
# graph sees as dynamic. Installed libraries (torch's MultiheadAttention, transformers) branch on
# sizes they computed lines before; a boolean in the user's own code is taken as a branch on
# tensor values.
_SIZE_WORDS = ("shape", "size(", "dim(", "len(", "numel", "ndim")
_LIBRARIES = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
BRANCH = "branch: "


def _number_from_tensor(filename: str, message: str) -> bool:
    """A tensor (``int(x.shape[0])``, ``len(x)``, ``x.sum().item()``) became a Python number in
    the user's own code."""
    converted = "Converting a tensor to a Python" in message and "boolean" not in message
    if not (converted or "Using len to get tensor shape" in message):
        return False
    return not any(lib in filename for lib in _LIBRARIES)


def _baked_kind(filename: str, lineno: int, message: str) -> str:
    """``BRANCH`` for a tensor turned into a Python boolean in the user's own code, on a line
    that reads no sizes."""
    if "Python boolean" not in message or any(lib in filename for lib in _LIBRARIES):
        return ""
    line = linecache.getline(filename, lineno)
    return "" if any(word in line for word in _SIZE_WORDS) else BRANCH


def _export_dynamo(
    flat: _FlatCall,
    tensors: tuple[torch.Tensor, ...],
    input_names: list[str],
    opset: int,
) -> onnx.ModelProto:
    try:
        from ortfx import translations  # imports onnxscript
    except ImportError as e:
        raise OrtfxExportError(DYNAMO_NEEDS_ONNXSCRIPT) from e
    state = {
        **{n: p for n, p in flat.named_parameters()},
        **{n: b for n, b in flat.named_buffers()},
    }
    names = list(state)

    class Functional(torch.nn.Module):
        def forward(self, *flat_inputs: torch.Tensor) -> Any:
            user, weights = flat_inputs[: len(tensors)], flat_inputs[len(tensors) :]
            return torch.func.functional_call(
                flat, dict(zip(names, weights, strict=True)), tuple(user)
            )

    weights = tuple(state[n].detach() for n in names)
    # Every dim of a user input is dynamic; parameters are fixed-size.
    dims: list[dict[int, Any] | None] = [
        {d: torch.export.Dim.AUTO for d in range(t.dim())} for t in tensors
    ]
    dims += [None] * len(weights)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(
            Functional(), (*tensors, *weights), dynamic_shapes=(tuple(dims),)
        )
        onnx_program = torch.onnx.export(
            program,
            dynamo=True,
            custom_translation_table=translations.table(),
            opset_version=max(opset, 18),
            optimize=True,
            input_names=[*input_names, *names],
        )
    assert onnx_program is not None
    return onnx_program.model_proto


def _in_chain(error: BaseException, kind: type[E]) -> E | None:
    """The first exception of type ``kind`` in ``error``'s cause/context chain."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def raise_if_pytorch_raises(
    module: torch.nn.Module, leaves: Sequence[Any], schema: ModelSchema
) -> None:
    """The forward raised while traced, or ORT could not run a call. If the call raises in
    plain PyTorch too, the exception is the input's or the user's (a check in their forward, a
    shape PyTorch rejects): raise PyTorch's own, with its type and message, instead of an
    export or run failure, so that nothing (fallback, exporter) changes for later calls."""
    tensor_leaves = list(leaves)
    for i in schema.tensor_indices():
        tensor_leaves[i] = leaves[i].detach().clone()
    args, kwargs = io.unflatten(schema.treespec, tensor_leaves)
    try:
        with preserved_random_state(), state_preserved(module), torch.no_grad():
            module(*args, **kwargs)
    except Exception as eager:
        eager.add_note(
            "ortfx: the module raises this in plain PyTorch too, so ortfx neither falls back "
            "nor switches exporters for it."
        )
        raise eager.with_traceback(eager.__traceback__) from None


def _with_flag(clone: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """The caller's ``requires_grad`` on the traced clone of an input: a forward that reads
    ``x.requires_grad`` takes the branch eager takes (a leaf keeps its flag under the export's
    ``no_grad``; the ops on it still record no backward)."""
    if requires_grad and (clone.is_floating_point() or clone.is_complex()):
        clone.requires_grad_(True)
    return clone


def export(
    module: torch.nn.Module,
    leaves: Sequence[Any],
    schema: ModelSchema,
    options: ExportOptions,
    grad_enabled: bool = False,
) -> Exported:
    """Export ``module`` for calls of ``schema`` (example ``leaves``) made with grad mode
    ``grad_enabled``; return the raw record.

    The record's ``inputs`` are the graph's inputs as exported (user tensors by path, then
    parameters and buffers by module path); grad flags are filled in by processing.
    """
    if torch.is_inference_mode_enabled():
        # The tracer cannot record inference tensors (they have no version counter): a call
        # under torch.inference_mode() is traced outside it, on normal copies of them.
        # inference_mode(False) turns grad mode on: the call's own mode (off) is put back.
        with torch.inference_mode(False), torch.no_grad():
            normal = [
                t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t for t in leaves
            ]
            return export(module, normal, schema, options, grad_enabled)
    start = time.perf_counter()
    taken: set[str] = set()
    positions = schema.tensor_indices()
    input_names = [graph_name(schema.paths[i], taken) for i in positions]
    # Clones: the forward may change its inputs in place, and export must not touch the
    # caller's tensors (the graph's run does, as PyTorch would).
    tensors = tuple(
        _with_flag(leaves[i].detach().clone(), schema.requires_grad[i]) for i in positions
    )
    flat = _FlatCall(module, leaves, schema)
    exporter = _export_torchscript if options.exporter == "torchscript" else _export_dynamo
    traced = checkpoints_traced_directly(module)
    region = None
    if grad_enabled and exporter is _export_torchscript:
        # The dynamo exporter traces through its own modes: its no-grad regions stay a gap.
        region = _NoGradRegion(
            {id(b) for b in module.buffers()},
            {id(t): schema.requires_grad[i] for t, i in zip(tensors, positions, strict=True)},
        )
    dynamo = exporter is _export_dynamo
    try:
        with (
            _one_export_at_a_time(),
            preserved_random_state(),
            state_preserved(module),
            batch_norm_updates_in_graph(module),
            grad_mode_as_called(grad_enabled, region) as asked,
            traced as calls,
            functions_called(profile=dynamo) as functions,
            gradient_hooks_watched(grad_enabled) as hooks,
            grad_flags_watched(
                grad_enabled,
                any(schema.requires_grad[i] for i in positions)
                or any(t.requires_grad for t in (*module.parameters(), *module.buffers())),
                tensors,
                tuple(module.buffers()),
                dynamo=dynamo,
            ) as flags,
        ):
            retry = False
            try:
                model = exporter(flat, tensors, input_names, options.opset_version)
            except Exception as e:
                # Likely a custom Function's forward using a tensor that requires grad without
                # taking it as an input: trace again without Function bodies (only then: the
                # profile hook slows tracing by about a tenth).
                retry = not dynamo and _CONSTANT_NEEDS_GRAD in str(e)
                if not (retry or (dynamo and functions)):
                    raise
            if retry:
                # The first attempt's exception holds its frames, whose locals hold `flat`,
                # which holds the exception: break that cycle, or the frames of this whole call
                # (with the call's outputs and their autograd contexts) live until a GC pass.
                flat.raised = None
                flat = _FlatCall(module, leaves, schema)
                calls[0] = 0
                with function_bodies_untraced():
                    model = exporter(flat, tensors, input_names, options.opset_version)
            if hooks:  # only recorded for calls with grad
                raise OrtfxExportError(
                    GRADIENT_HOOK_IN_FORWARD.format(module=type(module).__name__, where=hooks[0])
                )
            if flags.refused is not None:
                attribute, where, what = flags.refused
                raise OrtfxExportError(
                    INTERMEDIATE_REQUIRES_GRAD.format(
                        module=type(module).__name__, attribute=attribute, where=where, what=what
                    )
                )
            if functions and not options.enable_custom_autograd_function:
                raise OrtfxExportError(CUSTOM_FUNCTIONS_DISABLED.format(names=_names(functions)))
            if functions and dynamo:
                # The dynamo exporter inlines Functions (their backward would be lost): only
                # the TorchScript exporter keeps them, as PythonOp nodes.
                flat = _FlatCall(module, leaves, schema)
                calls[0] = 0
                model = _export_torchscript(flat, tensors, input_names, options.opset_version)
    except OrtfxExportError:
        raise
    except Exception as e:
        unsupported = _in_chain(e, OrtfxIOError)
        if unsupported is not None:
            raise unsupported from None  # data ortfx cannot carry: the data policy decides
        refused = _in_chain(e, OrtfxExportError)
        if refused is not None:
            raise refused from None  # ortfx's own refusal from a symbolic or a translation
        if flat.raised is not None:
            raise_if_pytorch_raises(module, leaves, schema)
        other = "dynamo" if options.exporter == "torchscript" else "torchscript"
        rendered = ", ".join(
            f"{p}: {s.render()}" for p, s in zip(schema.paths, schema.leaves, strict=True)
        )
        raise OrtfxExportError(
            EXPORT_FAILED.format(
                module=type(module).__name__,
                exporter=options.exporter,
                schema="{" + rendered + "}",
                error_type=type(e).__name__,
                error=str(e).strip().splitlines()[0] if str(e).strip() else "",
                other=other,
            )
        ) from e
    if flat.output_schema is None:
        raise OrtfxExportError(f"the {options.exporter} exporter never ran the module's forward")

    by_name = dict(zip(input_names, positions, strict=True))
    params = _parameter_sources(module)
    if options.exporter == "dynamo" and not functions:
        params.update({k.removeprefix("module."): v for k, v in params.items()})
    inputs = []
    for value in model.graph.input:
        if value.name in by_name:
            inputs.append(InputSpec(value.name, InputKind.USER, by_name[value.name]))
        elif value.name in params:
            kind, source = params[value.name]
            inputs.append(InputSpec(value.name, kind, source))
        else:
            raise OrtfxExportError(
                f"the exported graph has an input {value.name!r} that is neither a user input nor "
                "a parameter or buffer of the module; this is an ortfx bug, please report it."
            )
    output_names = tuple(o.name for o in model.graph.output)
    info = PostExportProcessedModelInfo(
        model=model.SerializeToString(),
        inputs=tuple(inputs),
        input_schema=schema,
        output_schema=flat.output_schema,
        output_names=output_names,
        updates=flat.updates,
        returned_inputs=flat.returned_inputs,
    )
    tensor_outputs = [s for s in flat.output_schema.leaves if isinstance(s, TensorSpec)]
    if len(tensor_outputs) + len(flat.updates) != len(output_names):
        raise OrtfxExportError(
            f"the module returned {len(tensor_outputs)} tensors and changed "
            f"{len(flat.updates)} in place, but the exported graph has {len(output_names)} "
            "outputs; this is an ortfx bug, please report it."
        )
    return Exported(
        info,
        time.perf_counter() - start,
        calls[0],
        flat.tracer_warnings,
        tuple(sorted(functions)),
        reads_grad_mode=asked[0] > 0 or flags.mode,
        reads_grad_flags=flags.leaves,
        numbers_from_tensors=flat.numbers_from_tensors,
    )


def _names(functions: dict[str, type]) -> str:
    return ", ".join(sorted(functions))


QUEUE_CALLBACK_MISSING = (
    "this torch ({version}) no longer offers torch.autograd.Variable._execution_engine"
    ".queue_callback, which ortfx uses to run code once the running backward pass has finished "
    "(ZeRO-3 releases gathered parameters there); please report this with your torch version."
)


def queue_after_backward(callback: Any) -> None:
    """Run ``callback()`` when the backward pass now running has finished, after every
    gradient accumulation and every callback queued before it. Call it from inside backward."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        raise RuntimeError(QUEUE_CALLBACK_MISSING.format(version=torch.__version__))
    queue(callback)


WILL_EXECUTE_MISSING = (
    "this torch ({version}) no longer offers torch._C._will_engine_execute_node, which ortfx "
    "uses to tell a full backward from torch.autograd.grad / backward(inputs=...) under "
    "Options(enable_mem_efficient_grad_management=True); turn that option off, and please "
    "report this with your torch version."
)


def engine_accumulates(leaf: torch.Tensor) -> bool:
    """During a backward: whether torch's engine will run ``leaf``'s AccumulateGrad (False
    when the backward was restricted to other tensors: ``autograd.grad``, ``inputs=``)."""
    check = getattr(torch._C, "_will_engine_execute_node", None)
    if check is None:
        raise RuntimeError(WILL_EXECUTE_MISSING.format(version=torch.__version__))
    return bool(check(torch.autograd.graph.get_gradient_edge(leaf).node))


# torch's hook tables (private attribute names) of a module, and the process-wide ones.
_MODULE_HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
)
_GLOBAL_HOOK_TABLES = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def hook_tables(module: torch.nn.Module | None) -> tuple[Mapping[int, Any], ...]:
    """``module``'s hook dicts (forward pre-hooks, forward hooks, backward pre-hooks,
    backward hooks), or torch's global ones for ``None``; a table torch no longer has reads as
    empty."""
    from torch.nn.modules import module as torch_module

    owner: Any = torch_module if module is None else module
    names = _GLOBAL_HOOK_TABLES if module is None else _MODULE_HOOK_TABLES
    return tuple(getattr(owner, name, None) or {} for name in names)


def in_functorch_transform() -> bool:
    """Whether this call runs inside a torch.func transform (vmap, grad, ...): torch's
    private level query; without it, never (torch's own error then speaks)."""
    level = _FUNCTORCH_LEVEL
    return level is not None and level() is not None


# Looked up once: the question is asked on every call.
_FUNCTORCH_LEVEL = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", None)


def any_autocast() -> bool:
    """Whether torch.autocast is on for any device type (torch's private one-call question;
    without it, the public per-device checks answer, about ten times slower)."""
    check = _ANY_AUTOCAST
    if check is not None:
        return bool(check())
    return any(torch.is_autocast_enabled(kind) for kind in ("cpu", "cuda", "xpu", "mps"))


_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


# The frames of nn.Module.__call__ (private names; none found: every write counts as outside).
_MODULE_CALL_CODES = frozenset(
    f.__code__
    for f in (
        getattr(torch.nn.Module, "_call_impl", None),
        getattr(torch.nn.Module, "_wrapped_call_impl", None),
    )
    if f is not None and hasattr(f, "__code__")
)


def inside_module_call(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` or a caller of it runs a module's ``__call__`` (a forward)."""
    while frame is not None:
        if frame.f_code in _MODULE_CALL_CODES:
            return True
        frame = frame.f_back
    return False


_CONSTANT_NEEDS_GRAD = "Cannot insert a Tensor that requires grad as a constant"
TRACING_STATE_MISSING = (
    "this torch ({version}) no longer offers torch._C._get_tracing_state/_set_tracing_state, "
    "which ortfx uses to export custom autograd Functions without tracing their forward; "
    "please report this with your torch version."
)


@contextlib.contextmanager
def function_bodies_untraced() -> Iterator[None]:
    """Run each custom Function's forward with the TorchScript tracer suspended (an export
    retried after its trace of a Function body failed).

    The graph keeps the Function as a PythonOp that calls it at run time, so its traced body is
    never used; tracing it failed on what eager PyTorch allows in a forward, such as a
    parameter the Function closes over or an ORTModule it calls ("Cannot insert a Tensor that
    requires grad as a constant"). A profile hook (this thread only) sees the forward start
    under ``Function.apply``, however the user bound ``apply``.
    """
    get = getattr(torch._C, "_get_tracing_state", None)
    put = getattr(torch._C, "_set_tracing_state", None)
    if get is None or put is None:
        raise RuntimeError(TRACING_STATE_MISSING.format(version=torch.__version__))
    suspended: dict[int, Any] = {}  # id(forward frame) -> the tracing state to restore
    previous = sys.getprofile()

    def hook(frame: types.FrameType, event: Any, arg: Any) -> None:
        if event == "call":
            caller = frame.f_back
            called_by_apply = caller is not None and caller.f_code is _APPLY_CODE
            if called_by_apply and frame.f_code.co_name == "forward":
                suspended[id(frame)] = get()
                put(None)
        elif event == "return" and id(frame) in suspended:
            put(suspended.pop(id(frame)))
        if previous is not None:
            previous(frame, event, arg)

    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(previous)
        for state in suspended.values():  # a forward that raised: restore the outermost
            put(state)
            break
