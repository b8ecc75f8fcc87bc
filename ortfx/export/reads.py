"""What the forward reads while traced, beyond its arguments, parameters and buffers.

The trace runs the forward once with the call's grad mode (set on the exporting thread only;
torch keeps grad mode per thread), so ``torch.is_grad_enabled()`` and the autograd attributes of
the tensors it computes answer as in eager. The graph, though, serves later calls: one that
read them is keyed on what it read (the requires_grad flags, grad mode), and reads no key can
hold are refused. Everything is watched on the exporting thread only and for the export's
duration: a ``TorchFunctionMode`` (torch keeps its mode stack per thread) sees the attribute
reads, ``register_hook`` and the ops of the forward's own ``torch.no_grad()`` regions; a profile
hook (``sys.setprofile`` is per thread too) sees ``torch.is_grad_enabled()`` calls and, for
exporters that inline them, custom ``Function.apply`` calls. No class or module attribute of
torch is replaced.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any, Final

import attrs
import optree
import torch

from ortfx import _torch, io, outside
from ortfx.export import functions
from ortfx.model_info import Guard

GRADIENT_HOOK_IN_FORWARD = (
    "the forward of {module} registers a gradient hook on an intermediate tensor "
    "(Tensor.register_hook at {where}); ONNX Runtime computes the backward of the exported "
    "graph without it, so the gradients would differ from PyTorch's. Write the change to the "
    "gradient as a custom torch.autograd.Function (ortfx runs it inside the graph with its "
    "backward), or run the module in PyTorch (the default fallback policy does)."
)
INTERMEDIATE_REQUIRES_GRAD = (
    "the forward of {module} reads {attribute} of {what} ({where}); the dynamo exporter traces "
    "copies that read as tensors without gradient, while in PyTorch the tensor can require "
    "grad, so the graph could take another branch than PyTorch. Read torch.is_grad_enabled() "
    "instead, export with Options(exporter='torchscript') (it traces with autograd as called), "
    "or run the module in PyTorch (the default fallback policy does)."
)
AN_INPUT_READ = (
    "the forward of {module} reads {attribute} of an input ({where}): whether the caller's "
    "tensor is a leaf, or has a grad_fn, depends on how the caller made it, which is not part "
    "of what ortfx keys its graphs on, so the graph could take another branch than PyTorch on "
    "a later call. Read requires_grad instead, or run the module in PyTorch (the default "
    "fallback policy does)."
)
COMPUTED_OR_COPY = "a tensor it computed or an input"
RANDOM_VALUE = (
    "the forward of {module} takes a Python value from a random draw ({attribute} at {where}: "
    "a branch or a number computed from torch.rand, dropout, ...). The traced graph would hold "
    "that one draw's outcome for every later call, and no check after the run can redraw as "
    "eager does. Keep it in tensors (torch.where(torch.rand(()) < p, a, b)), or run the module "
    "in PyTorch (the default fallback policy does)."
)
MADE_TO_REQUIRE_GRAD = (
    "the forward of {module} makes a tensor require grad ({where}) in a way ORT's graph cannot "
    "follow: the tensor is one of the module's inputs (the caller's tensor would then require "
    "grad and get a .grad), or nothing else in the call requires grad (PyTorch's outputs would "
    "then require grad, the graph's would not). Make it an nn.Parameter of the module, or run "
    "the module in PyTorch (the default fallback policy does)."
)

# Code whose reads are bookkeeping, not the model's branches (by module name): autograd's and
# the exporters' (under torch), and ortfx's own.
_BOOKKEEPING = ("torch.", "ortfx.")
_AUTOGRAD_ATTRIBUTES = ("requires_grad", "grad_fn", "is_leaf")


def _inherited(name: str) -> Any:
    """``torch.Tensor``'s own ``name`` (a C descriptor or method), found through the public
    class's MRO, not by a private class name."""
    return next(vars(k)[name] for k in torch.Tensor.__mro__ if name in vars(k))


# id(getset descriptor) -> attribute name: a torch function call on ``descriptor.__get__`` or
# ``__set__`` is a read or a write of that attribute.
_DESCRIPTORS = {id(_inherited(name)): name for name in _AUTOGRAD_ATTRIBUTES}
_REQUIRES_GRAD_ = _inherited("requires_grad_")
_REGISTER_HOOK = torch.Tensor.register_hook
_NOT_STOPPED = frozenset({torch.Tensor.detach, _REQUIRES_GRAD_})
_IS_GRAD_ENABLED = torch.is_grad_enabled
# Tensor -> Python value conversions, by what they give (torch's own words in its tracer's
# warnings); a traced graph holds the value they gave as a constant.
_CONVERSIONS: dict[Any, str] = {
    _inherited("__bool__"): "boolean",
    _inherited("__int__"): "integer",
    _inherited("__float__"): "float",
    _inherited("__index__"): "index",
    _inherited("item"): "number",
    _inherited("tolist"): "list",
    _inherited("numpy"): "NumPy array",
    torch.Tensor.__len__: "len",
    torch.Tensor.__iter__: "iteration",
    _inherited("__complex__"): "complex",
    _inherited("is_nonzero"): "boolean",
    _inherited("__contains__"): "boolean",
    _inherited("__format__"): "number",
    _inherited("__array__"): "NumPy array",
    torch.equal: "boolean",
    torch.allclose: "boolean",
}
# Ops that draw random numbers (by name): a value taken from what they give is refused.
_DRAWS = frozenset(
    {
        "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
        "bernoulli", "bernoulli_", "normal", "normal_", "uniform_", "multinomial", "poisson",
        "exponential_", "geometric_", "log_normal_", "cauchy_", "random_", "dropout",
        "dropout_", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d",
        "dropout3d", "rrelu",
    }
)  # fmt: skip


def _source(func: Any, args: Sequence[Any], kwargs: Any) -> Any:
    """The tensor whose values decide what a conversion gives (a guard's output)."""
    if func is torch.equal:
        a, b = args[0], args[1]
        return torch.eq(a, b).all() if a.shape == b.shape else a.new_zeros((), dtype=torch.bool)
    if func is torch.allclose:  # torch.isclose, written out: the exporter has no isclose
        names = ("rtol", "atol", "equal_nan")
        given = {"rtol": 1e-5, "atol": 1e-8, "equal_nan": False}
        given |= dict(zip(names, args[2:], strict=False)) | dict(kwargs)
        a, b = args[0], args[1]
        close = (a == b) | ((a - b).abs() <= given["atol"] + given["rtol"] * b.abs())
        if given["equal_nan"]:
            close = close | (a.isnan() & b.isnan())
        return close.all()
    if func is _CONTAINS:
        return (args[0] == args[1]).any()
    return args[0]


_CONTAINS = _inherited("__contains__")
_FORMAT = _inherited("__format__")

# Ops that give a Python list of tensors, as many as a size along ``dim`` decides (Python
# iteration over a tensor is ``unbind``): the trace bakes that count in, as a conversion would.
# name -> (position of dim among the arguments, its default)
_PARTS: dict[str, tuple[int, int]] = {
    "unbind": (1, 0),
    "split": (2, 0),
    "unsafe_split": (2, 0),
    "chunk": (2, 0),
    "unsafe_chunk": (2, 0),
    "tensor_split": (2, 0),
}

# Set while ortfx's own code runs inside the trace (e.g. the BatchNorm statistics update under
# no_grad): its no-grad regions are ortfx's, not the user's.
OWN_CODE: contextvars.ContextVar[bool] = contextvars.ContextVar("ortfx_own_code", default=False)


# Set while the user's forward runs inside an export (Watch.forward): warnings raised then are
# the forward's (shown, as in eager); the rest of an export's warnings are the exporters' own.
IN_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("ortfx_in_forward", default=False)


@contextlib.contextmanager
def own_code() -> Iterator[None]:
    token = OWN_CODE.set(True)
    try:
        yield
    finally:
        OWN_CODE.reset(token)


def line_of(frame: types.FrameType) -> str:
    """``file:line`` of a frame, for messages that point at the user's code."""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _user_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """The first frame outside torch (a torch function's Python dispatch sits between) and
    ortfx's :data:`TRANSPARENT` modes."""
    while frame is not None and (
        frame.f_globals.get("__name__", "").startswith("torch.") or frame.f_code in TRANSPARENT
    ):
        frame = frame.f_back
    return frame


def _past_transparent(frame: types.FrameType) -> types.FrameType:
    """``frame``, or the first frame behind it that is not one of :data:`TRANSPARENT`."""
    while frame.f_code in TRANSPARENT and frame.f_back is not None:
        frame = frame.f_back
    return frame


_DISPATCH = ("torch.overrides", "torch._tensor")


def _model_frame(caller: types.FrameType) -> types.FrameType | None:
    """The frame of the model's code a conversion is made from: the user's, or torch's own
    module code when it is not called from the user's (a torch module wrapped directly, as
    ``nn.TransformerEncoder``'s mask check). None for ortfx's own code."""
    where = _user_frame(caller)
    if where is not None and where.f_code is not _TRACED_CALL[0]:
        if where.f_globals.get("__name__", "").startswith("ortfx."):
            return None
        return where
    frame: types.FrameType | None = caller
    while frame is not None and frame.f_globals.get("__name__", "") in _DISPATCH:
        frame = frame.f_back
    return frame


# The code object of the export's call into the user's module (ortfx.export.trace.FlatCall's
# forward, see mark_traced_call): a conversion found under it came from torch's own modules.
_TRACED_CALL: list[types.CodeType | None] = [None]


def mark_traced_call(code: types.CodeType) -> None:
    _TRACED_CALL[0] = code


@attrs.define
class Reads:
    """What the forward read while traced (:func:`watched`)."""

    leaves: bool = False  # the graph depends on the call's requires_grad flags
    mode: bool = False  # ... and on grad mode (also: torch.is_grad_enabled() was asked)
    # (attribute, file:line, what was read): a read the trace cannot answer as eager
    refused: tuple[str, str, str] | None = None
    hooks: list[str] = attrs.Factory(list)  # file:line of each register_hook in the forward
    # Each tensor the forward turned into a Python value while the TorchScript tracer ran (the
    # graph holds the value as a constant): (kind, file, line), and for those computed from
    # traced data or sizes, the guard and the tensor to add as a graph output.
    conversions: list[tuple[str, str, int]] = attrs.Factory(list)
    guards: list[tuple[Guard, torch.Tensor]] = attrs.Factory(list)
    functions: dict[str, type] = attrs.Factory(dict)  # custom Functions met (graph names)
    # A profiler the watch cannot chain to hid what only its profile hook sees (custom
    # Functions under the dynamo exporter).
    unseen: bool = False
    # id -> (generator, its state before the forward's first draw from it): every generator an
    # op of the forward was given, put back when the export ends (rewrites.generators_restored)
    generators: dict[int, tuple[torch.Generator, torch.Tensor]] = attrs.Factory(dict)
    # The code that ran in the forward, what it ran on, the environment variables it read
    # (see ortfx.outside); None: no profile hook could watch (a C-level profiler, or the
    # dynamo exporter, which runs no Python of the forward).
    ran: outside.Ran | None = attrs.Factory(outside.Ran)
    # Python's or NumPy's global random stream the forward drew from (the draw is baked in).
    drew: str | None = None


class _Watch(torch.overrides.TorchFunctionMode):
    """The exporting thread's view of the forward's tensor operations while traced."""

    def __init__(
        self,
        reads: Reads,
        *,
        grad_enabled: bool,
        inputs: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        dynamo: bool,
        any_grad: bool,
    ) -> None:
        super().__init__()
        self.reads = reads
        self.grad_enabled = grad_enabled
        self.given = {id(t) for t in inputs}
        self.known = self.given | {id(t) for t in buffers}
        self.dynamo = dynamo
        self.any_grad = any_grad
        # The dynamo exporter traces copies of inputs and parameters, which all read
        # requires_grad False: a False answer cannot be trusted when some flag is set.
        self.unsure = dynamo and any_grad
        # The forward's own no_grad regions stop gradients (TorchScript: the tracer records
        # the detach this inserts; the dynamo exporter keeps no such record).
        self.stops = grad_enabled and not dynamo
        self.tracing = _torch.tracing_state_access()[0] if not dynamo else _never
        self.splitting = False  # inside a list-giving op (see _PARTS)
        self.drawn = False  # an op of the forward drew random numbers (see _baked)
        self.clean: set[int] = set()  # traced values known free of random draws

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        caller = _past_transparent(sys._getframe(1))  # who called the op
        for given in (*args, *kwargs.values()):  # generator= or positional (torch.poisson)
            if isinstance(given, torch.Generator) and id(given) not in self.reads.generators:
                self.reads.generators[id(given)] = (given, given.get_state())
        attribute = _DESCRIPTORS.get(id(getattr(func, "__self__", None)))
        if attribute is not None:
            if func.__name__ == "__get__":
                value = call_as_eager(func, args, kwargs)
                self._read(attribute, args[0], value, caller)
                return value
            if attribute == "requires_grad" and len(args) > 1 and args[1]:
                self._made_to_require_grad(args[0], caller)
            return call_as_eager(func, args, kwargs)
        name = getattr(func, "__name__", "")
        if name in _DRAWS:
            self.drawn = True
        kind = _CONVERSIONS.get(func)
        if kind is not None and self.tracing() is not None and not OWN_CODE.get():
            where = _model_frame(caller)
            if where is not None and not _in_function_body(caller):
                out = call_as_eager(func, args, kwargs)
                source = _source(func, args, kwargs)
                if func is _FORMAT:  # the text of the number: guard the number
                    kind, value = (
                        ("number", source.item())
                        if source.dim() == 0
                        else ("list", source.tolist())
                    )
                else:
                    value = out
                self._baked(kind, source, value, where)
                return out
        parts = _PARTS.get(getattr(func, "__name__", ""))
        if parts is not None and not self.splitting and self.tracing() is not None and args:
            where = _user_frame(caller)
            if where is not None and not where.f_globals.get("__name__", "").startswith(
                _BOOKKEEPING
            ):
                position, default = parts
                dim = kwargs.get("dim", args[position] if len(args) > position else default)
                self._parts(args[0], dim, where)
            self.splitting = True  # torch.split's Python wrapper calls Tensor.split: once
            try:
                return call_as_eager(func, args, kwargs)
            finally:
                self.splitting = False
        if func is _REQUIRES_GRAD_ and (
            args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
        ):
            self._made_to_require_grad(args[0], caller)
        elif func is _REGISTER_HOOK and self.grad_enabled:
            # ORT's backward cannot run it: recorded (the export is refused), not registered
            # (without grad it raises as in eager, below).
            where = _user_frame(caller)
            self.reads.hooks.append(line_of(where) if where is not None else "?")
            return _NoHandle()
        out = call_as_eager(func, args, kwargs)
        if self.stops and not torch.is_grad_enabled() and not OWN_CODE.get():
            out = self._stopped(func, args, kwargs, out)
        return out

    def _baked(self, kind: str, tensor: Any, value: Any, where: types.FrameType) -> None:
        """The forward took ``value`` from ``tensor`` (``kind``) at ``where``: the trace bakes
        it in. Computed from traced data or sizes, the graph gets the tensor as an output, and
        each run is checked against the value (a :class:`~ortfx.model_info.Guard`)."""
        filename, lineno = where.f_code.co_filename, where.f_lineno
        self.reads.conversions.append((kind, filename, lineno))
        if kind in ("len", "iteration"):
            tensor = tensor.shape[0]  # a traced size while tracing: what decides the value
            value = int(tensor)
        at = f"{os.path.basename(filename)}:{lineno}"
        if self.drawn and _torch.traced_from_random(tensor, self.clean):
            self._refuse(kind, where, "random")
            return
        origin = _torch.traced_origin(tensor)
        if origin == "constant":
            return  # the same for every call
        # The value as it is now: the forward may change the tensor in place later (a flag
        # buffer it sets), and the graph's output would then be the changed one.
        tensor = tensor.clone()
        guard = Guard(kind, at, _canonical(kind, value), origin)
        self.reads.guards.append((guard, tensor))

    def _parts(self, tensor: Any, dim: Any, where: types.FrameType) -> None:
        """An op splits ``tensor`` along ``dim`` into a list: its length is baked in, so the
        size along ``dim`` is guarded."""
        if not isinstance(tensor, torch.Tensor) or not isinstance(dim, int) or tensor.dim() == 0:
            return
        size = tensor.shape[dim]
        if isinstance(size, torch.Tensor):  # a traced size (a plain int is a constant)
            self._baked("number of parts", size, int(size), where)

    def _stopped(self, func: Any, args: Sequence[Any], kwargs: Any, out: Any) -> Any:
        """An op of the forward's own ``torch.no_grad()`` region that read a tensor requiring
        grad gives its outputs through ``detach``, which the TorchScript exporter keeps as a
        gradient stop: eager gives such outputs no gradient, and ORT would differentiate
        through them."""
        if func in _NOT_STOPPED or getattr(func, "__name__", "").endswith("_"):
            return out  # in-place: the result is the input itself
        given: list[Any] = optree.tree_leaves(
            (args, kwargs),  # type: ignore[arg-type]
            namespace=io.NAMESPACE,
        )
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in given):
            return out
        return optree.tree_map(_detached, out, namespace=io.NAMESPACE)

    def _made_to_require_grad(self, tensor: Any, caller: types.FrameType) -> None:
        """The forward makes a tensor a new autograd leaf (wav2vec2 does, for gradient
        checkpointing). What it computes from it then depends on the flags and grad mode, as
        in eager, except where ORT's graph cannot follow: the caller's own input would change,
        or nothing else requires grad (refused). torch's and ortfx's own code do not count."""
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            return  # already does: nothing changes
        where = _user_frame(caller)
        if where is None or where.f_globals.get("__name__", "").startswith(_BOOKKEEPING):
            return
        if id(tensor) in self.given or not self.any_grad:
            self._refuse("requires_grad", where, "made")
            return
        self.reads.leaves = self.reads.mode = True
        self.unsure = self.unsure or self.dynamo  # the dynamo exporter's copies cannot say

    def _read(self, name: str, tensor: Any, value: Any, caller: types.FrameType) -> None:
        if caller.f_globals.get("__name__", "").startswith(_BOOKKEEPING):
            return  # the exporter's, autograd's, torch's and ortfx's bookkeeping
        reads = self.reads
        if name != "requires_grad" and id(tensor) in self.given:
            self._refuse(name, caller, "input")
            return
        if name == "requires_grad" and (
            id(tensor) in self.known or isinstance(tensor, torch.nn.Parameter)
        ):
            reads.leaves = True  # answers as in eager, for these flags
            return
        if self.dynamo and name == "requires_grad" and value:
            # A copy that requires grad: eager's tensor does too, for these flags and mode.
            reads.leaves = reads.mode = True
            return
        if not (tensor.is_floating_point() or tensor.is_complex()):
            return  # never requires grad, in eager either
        if self.unsure:
            self._refuse(name, caller, COMPUTED_OR_COPY)
        else:  # a computed tensor: as in eager, for these flags and this grad mode
            reads.leaves = reads.mode = True

    def _refuse(self, name: str, caller: types.FrameType, what: str) -> None:
        if self.reads.refused is None:
            self.reads.refused = (name, line_of(caller), what)


def _call_as(func: Any, args: Sequence[Any], kwargs: Any) -> Any:
    return func(*args, **kwargs)


# Generator methods that draw nothing (seeding, state), on a profile hook's c_call.
_NOT_DRAWS: Final = frozenset(
    {"seed", "getstate", "setstate", "get_state", "set_state", "__init__", "__reduce__"}
)

_CALL_LINE = max(line for _, _, line in _call_as.__code__.co_lines() if line is not None)
_CALL_OFFSET = _CALL_LINE - _call_as.__code__.co_firstlineno
# (code, line) of a forward's call site -> _call_as compiled as if written on that line of that
# module (see call_as_eager); bounded, cleared when full.
_AS_CALLED: dict[tuple[types.CodeType, int], Any] = {}


def call_as_eager(func: Any, args: Sequence[Any], kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` from a ``TorchFunctionMode``'s ``__torch_function__``, as if
    called where eager calls it: a warning the op raises is then attributed to the forward's
    line and module, so the process's filters (by module, ``-W error``) and the registry of
    warnings shown once act as in eager."""
    caller = _eager_caller(sys._getframe(2))  # the frame that called __torch_function__
    if caller is None:
        return func(*args, **kwargs)
    return _calling_from(caller)(func, args, kwargs)


# The __torch_function__ code of ortfx's other modes that run inside the watch and call the
# op on, plainly (the export's write watch): not there in eager either.
TRANSPARENT: set[types.CodeType] = set()


def _eager_caller(frame: types.FrameType | None) -> types.FrameType | None:
    """The frame eager would run an op from, given the frame that called the watch: torch's
    dispatch to a mode (``torch.overrides``), the Python wrapper that asked for it (it runs
    again from the watch) and ortfx's :data:`TRANSPARENT` modes are not there in eager."""
    while frame is not None:
        if frame.f_globals.get("__name__") == "torch.overrides":
            while frame is not None and frame.f_globals.get("__name__") == "torch.overrides":
                frame = frame.f_back
            frame = frame.f_back if frame is not None else None
        elif frame.f_code in TRANSPARENT:
            frame = frame.f_back
        else:
            return frame
    return frame


def _calling_from(frame: types.FrameType) -> Any:
    key = (frame.f_code, frame.f_lineno)
    found = _AS_CALLED.get(key)
    if found is None:
        first = frame.f_lineno - _CALL_OFFSET
        if first < 1:
            return _call_as
        code = _call_as.__code__.replace(
            co_filename=frame.f_code.co_filename,
            co_firstlineno=first,
            co_name=frame.f_code.co_name,
        )
        found = types.FunctionType(code, frame.f_globals)
        if len(_AS_CALLED) >= 1024:
            _AS_CALLED.clear()
        _AS_CALLED[key] = found
    return found


def _canonical(kind: str, value: Any) -> Any:
    """``value`` in the form :func:`ortfx.model_info.guard_value` gives a run's output."""
    if kind == "NumPy array":
        value = value.tolist()
    return (type(value).__name__, repr(value))


def _in_function_body(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` runs inside a custom ``autograd.Function``'s forward: its trace is not
    the graph's (ORT calls the Function at run time), so nothing it converts is baked in."""
    while frame is not None:
        if frame.f_code is _torch.FUNCTION_APPLY_CODE:
            return True
        frame = frame.f_back
    return False


def _never() -> Any:
    return None


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach()
    return value


class _NoHandle:
    """What ``register_hook`` returns while traced: removing it does nothing."""

    def remove(self) -> None:
        pass


class Watch:
    """One export's watch: :meth:`forward` is entered around the user's forward only (inside
    the traced call, so that the mode is the innermost one even under ``torch.export``'s
    own), and :attr:`reads` holds what it saw."""

    def __init__(
        self, mode: _Watch, dynamo: bool, inner: torch.overrides.TorchFunctionMode | None = None
    ) -> None:
        self.mode, self.dynamo = mode, dynamo
        self.reads = mode.reads
        # Another of ortfx's modes, innermost (the export's write watch, see TRANSPARENT).
        self.inner = inner if inner is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        streams = outside.streams()
        with self._forward():
            yield
        self.reads.drew = self.reads.drew or outside.drew(streams, outside.streams())

    @contextlib.contextmanager
    def _forward(self) -> Iterator[None]:
        reads, dynamo = self.reads, self.dynamo
        previous = sys.getprofile()
        token = IN_FORWARD.set(True)
        if dynamo:
            reads.ran = None  # the dynamo exporter runs no Python of the forward's
        if not profile_chains(previous):
            reads.ran = None
            # A C-level profiler (cProfile, torch.profiler) runs on this thread: a Python hook
            # can neither call it nor replace it without switching it off. Without the hook:
            # the graph is keyed on grad mode as if the forward had asked, and what only the
            # hook sees (Function.apply under the dynamo exporter) is reported unseen.
            reads.mode = True
            reads.unseen = dynamo
            try:
                with self.mode, self.inner:
                    yield
            finally:
                IN_FORWARD.reset(token)
            return

        ran = reads.ran

        def profile(frame: types.FrameType, event: Any, arg: Any) -> None:
            if event == "call" and ran is not None:
                ran.called(frame)
            elif event == "return" and ran is not None:
                ran.returned(frame)
            if event == "c_call":
                if arg is _IS_GRAD_ENABLED and not frame.f_globals.get("__name__", "").startswith(
                    _BOOKKEEPING
                ):
                    reads.mode = True  # the forward branches on grad mode, as called
                elif (
                    reads.drew is None
                    and isinstance(getattr(arg, "__self__", None), outside.GENERATORS)
                    and getattr(arg, "__name__", "") not in _NOT_DRAWS
                    and outside.users_code(frame.f_code)
                ):
                    # A draw from a Python or NumPy generator (one the forward made itself
                    # too): the traced graph would keep the number it drew.
                    reads.drew = outside.generator_name(arg)
            elif dynamo and event == "call" and frame.f_code is _torch.FUNCTION_APPLY_CODE:
                # The dynamo exporter inlines Functions silently: see each apply, however
                # bound.
                cls = frame.f_locals.get("cls")
                if isinstance(cls, type):
                    functions.record(cls)
            elif not dynamo and event == "return" and frame.f_code is _torch.FUNCTION_APPLY_CODE:
                functions.mark_numbers(arg)
            if previous is not None:
                previous(frame, event, arg)

        sys.setprofile(profile)
        try:
            with self.mode, self.inner:
                yield
        finally:
            IN_FORWARD.reset(token)
            sys.setprofile(previous)


def profile_chains(previous: Any) -> bool:
    """Whether a profile hook set now can pass every event on to ``previous`` (the thread's
    profiler: none, or a Python callable; a C-level profiler's object is not callable)."""
    return previous is None or callable(previous)


@contextlib.contextmanager
def watched(
    *,
    grad_enabled: bool,
    inputs: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    dynamo: bool,
    any_grad: bool,
    inner: torch.overrides.TorchFunctionMode | None = None,
) -> Iterator[Watch]:
    """For one export: the call's grad mode on this thread, the custom Functions met recorded,
    and a :class:`Watch` for the forward (see the module docstring)."""
    with functions.recorded() as found, torch.set_grad_enabled(grad_enabled):
        reads = Reads(functions=found)  # filled as the export meets them
        mode = _Watch(
            reads,
            grad_enabled=grad_enabled,
            inputs=inputs,
            buffers=buffers,
            dynamo=dynamo,
            any_grad=any_grad,
        )
        yield Watch(mode, dynamo, inner)
