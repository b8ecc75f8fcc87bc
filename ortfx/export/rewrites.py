"""What an export changes around the forward it traces, each undone when it ends.

Export runs the user's forward once. It must leave the module, the RNG streams and the rest of
the process as it found them, and while it runs, only the exporting thread may see a change:
every replacement here answers other threads with torch's own behaviour.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import random
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np
import optree
import torch

from ortfx import _torch, io
from ortfx.errors import OrtfxExportError
from ortfx.export.reads import line_of, own_code

_STREAMS = (
    torch.Generator,
    random.Random,
    np.random.Generator,
    np.random.RandomState,
    np.random.BitGenerator,
)


def _held_streams(module: torch.nn.Module) -> list[Callable[[], object]]:
    """A restorer for every random stream ``module``'s tree holds as an attribute (directly,
    or in a list, tuple or dict): torch generators, Python's and numpy's. The forward may
    draw from them or reseed them by their own methods, which no op watch sees."""
    found: dict[int, Any] = {}
    for m in module.modules():
        for value in vars(m).values():
            inner = value.values() if isinstance(value, dict) else value
            items = inner if isinstance(value, dict | list | tuple) else (value,)
            for item in items:
                if isinstance(item, _STREAMS):
                    found.setdefault(id(item), item)
    restorers: list[Callable[[], object]] = []
    for stream in found.values():
        if isinstance(stream, torch.Generator):
            restorers.append(functools.partial(stream.set_state, stream.get_state()))
        elif isinstance(stream, random.Random):
            restorers.append(functools.partial(stream.setstate, stream.getstate()))
        elif isinstance(stream, np.random.RandomState):
            restorers.append(functools.partial(stream.set_state, stream.get_state()))
        else:
            bits = stream.bit_generator if isinstance(stream, np.random.Generator) else stream
            restorers.append(functools.partial(setattr, bits, "state", bits.state))
    return restorers


@contextlib.contextmanager
def preserved_random_state(module: torch.nn.Module | None = None) -> Iterator[None]:
    """Export runs the module: no random stream of the user's may move. Python's, numpy's and
    torch's default ones are put back, and those ``module`` holds; in an export, the watch
    saves the generators the traced forward's ops are given (:func:`generators_restored`)."""
    py_state = random.getstate()
    np_state = np.random.get_state()
    torch_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    held = _held_streams(module) if module is not None else []
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        for restore in held:
            restore()


@contextlib.contextmanager
def generators_restored(saved: dict[int, tuple[torch.Generator, torch.Tensor]]) -> Iterator[None]:
    """When the export ends, every generator in ``saved`` (filled by the export's watch as the
    traced forward's ops meet them, each before its first draw) goes back to its state."""
    try:
        yield
    finally:
        for generator, state in saved.values():
            generator.set_state(state)


# ---- BatchNorm: the running statistics as ops of the graph --------------------------------------


# torch's own, bound once: ortfx's bodies call it while the public name is rebound.
_BATCH_NORM = torch.nn.functional.batch_norm


def _update_statistics(
    x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, factor: float | torch.Tensor
) -> None:
    """Eager's update of running statistics, as explicit in-place ops the exporter keeps in
    the graph as buffer updates (its own BatchNormalization would update them with the
    biased variance, or, for a functional call, not at all)."""
    # The statistics carry no gradient (torch's kernel updates them outside autograd); ortfx's
    # own no_grad, not a region of the user's that stops gradients.
    with torch.no_grad(), own_code():
        dims = [0, *range(2, x.dim())]
        mean.mul_(1 - factor).add_(x.mean(dims) * factor)
        var.mul_(1 - factor).add_(x.var(dims, unbiased=True) * factor)


def _normalized_by_batch(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    channels = x.shape[1]
    # Placeholder statistics: in training mode the output uses the batch's own.
    mean, var = torch.zeros(channels, dtype=x.dtype), torch.ones(channels, dtype=x.dtype)
    out: torch.Tensor = _BATCH_NORM(x, mean, var, weight, bias, True, 0.0, eps)
    return out


def _normalized_by_statistics(
    x: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """Eval-mode normalization as plain arithmetic: ORT's training graph turns a
    BatchNormalization node into its training form, which would normalize an eval-mode call
    with gradients by the batch's statistics instead of the running ones."""
    shape = [1, -1, *([1] * (x.dim() - 2))]
    y: torch.Tensor = (x - mean.reshape(shape)) * torch.rsqrt(var + eps).reshape(shape)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y


def _batch_norm_train(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``_BatchNorm.forward`` in train mode, ``momentum=None`` included (a Python value
    computed from ``num_batches_tracked``, which a trace would bake in: here a tensor op)."""
    assert self.num_batches_tracked is not None
    with torch.no_grad(), own_code():
        self.num_batches_tracked.add_(1)
    factor = (1.0 / self.num_batches_tracked) if self.momentum is None else self.momentum
    _update_statistics(x, self.running_mean, self.running_var, factor)
    return _normalized_by_batch(x, self.weight, self.bias, self.eps)


def _batch_norm_eval(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``_BatchNorm.forward`` with running statistics (eval mode)."""
    return _normalized_by_statistics(
        x, self.running_mean, self.running_var, self.weight, self.bias, self.eps
    )


def _functional_batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.batch_norm`` as eager computes it, for forwards that call it themselves (timm's
    ``BatchNormAct2d``, a module normalizing by its own buffers): the running statistics
    updated by graph ops in training, read by arithmetic otherwise."""
    if running_mean is None or running_var is None or momentum is None:
        return _BATCH_NORM(input, running_mean, running_var, weight, bias, training, momentum, eps)
    if training:
        _update_statistics(input, running_mean, running_var, momentum)
        return _normalized_by_batch(input, weight, bias, eps)
    return _normalized_by_statistics(input, running_mean, running_var, weight, bias, eps)


def _on_this_thread(
    body: Callable[..., torch.Tensor], module: torch.nn.Module, original: Callable[..., Any]
) -> Callable[..., Any]:
    """``body`` for the exporting thread; torch's own forward for any other."""
    exporting = threading.get_ident()

    def forward(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == exporting:
            return body(module, *args, **kwargs)
        return original(*args, **kwargs)

    return forward


@contextlib.contextmanager
def batch_norm_updates_in_graph(module: torch.nn.Module) -> Iterator[None]:
    """Export each BatchNorm with running statistics through :func:`_batch_norm_train` (train
    mode) or :func:`_batch_norm_eval` (eval mode); set on the instances for the export only,
    and for the exporting thread only (another thread calling the same module runs torch's).

    Every other ``F.batch_norm`` call (a subclass's own forward, a module's functional call on
    its buffers) goes through :func:`_functional_batch_norm`: ``torch.nn.functional.batch_norm``
    and the bindings of it in the modules defining ``module``'s classes are swapped for the
    export's duration, thread-checked as the checkpoint bindings are."""
    base = _torch.batch_norm_base()
    patched = [
        m
        for m in module.modules()
        if type(m).forward is base.forward
        and m.running_mean is not None
        and (m.track_running_stats or not m.training)
        and "forward" not in vars(m)
    ]
    for m in patched:
        body = _batch_norm_train if m.training else _batch_norm_eval
        # Straight into the instance dict: no module __setattr__ bookkeeping for ortfx's own.
        vars(m)["forward"] = _on_this_thread(body, m, types.MethodType(type(m).forward, m))
    exporting = threading.get_ident()

    def batch_norm(*args: Any, **kwargs: Any) -> torch.Tensor:
        if threading.get_ident() == exporting:
            return _functional_batch_norm(*args, **kwargs)
        return _BATCH_NORM(*args, **kwargs)

    functional = torch.nn.functional
    undo = _rebind(vars(functional), _BATCH_NORM, batch_norm)
    try:
        for namespace in _class_modules(module, skip=functional):
            undo += _rebind(namespace, _BATCH_NORM, batch_norm)
        yield
    finally:
        for namespace, name, value in reversed(undo):
            namespace[name] = value
        for m in patched:
            vars(m).pop("forward", None)


def _class_modules(module: torch.nn.Module, *, skip: types.ModuleType) -> list[dict[str, Any]]:
    """The namespaces of the Python modules defining ``module``'s classes (and their bases):
    where a ``from ... import`` binding of a replaced function lives."""
    found: dict[int, dict[str, Any]] = {}
    for m in module.modules():
        for klass in type(m).__mro__:
            code = sys.modules.get(klass.__module__)
            if code is not None and code is not skip:
                found.setdefault(id(code), vars(code))
    return list(found.values())


# ---- torch.utils.checkpoint: the checkpointed function traced as plain code ---------------------

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


# torch's own text (torch.utils.checkpoint.check_backward_validity)
NO_INPUT_REQUIRES_GRAD = "None of the inputs have requires_grad=True. Gradients will be None"

REENTRANT_CHECKPOINT_UNSURE = (
    "the forward of {module} calls torch.utils.checkpoint with use_reentrant=True ({where}); "
    "PyTorch gives its outputs gradients only if one of its tensor arguments requires grad, and "
    "the dynamo exporter traces copies that cannot say whether they do, so the graph could train "
    "parameters PyTorch leaves without gradients. Pass use_reentrant=False (transformers: "
    "gradient_checkpointing_enable(gradient_checkpointing_kwargs={{'use_reentrant': False}})), "
    "export with Options(exporter='torchscript'), or run the module in PyTorch (the default "
    "fallback policy does)."
)


@attrs.define
class Checkpoints:
    """The checkpoint calls one export traced."""

    calls: int = 0
    # A reentrant checkpoint was met: whether its outputs carry gradients depends on its
    # arguments' requires_grad, so the graph serves calls with these flags and grad mode only.
    reads_grad: bool = False
    # Buffers a checkpointed function updated (BatchNorm statistics): eager's recompute in
    # the backward updates them a second time, the graph once.
    updated: set[str] = attrs.field(factory=set)


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
        return value.detach()
    return value


_LIBRARIES = ("torch.", "ortfx.")


def user_line(frame: types.FrameType | None) -> str:
    """``file:line`` of the first frame outside torch and ortfx."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_LIBRARIES):
        frame = frame.f_back
    return "?" if frame is None else line_of(frame)


@functools.cache
def _validity_check_line(code: types.CodeType) -> int:
    """Where torch warns that no input requires grad: the line of ``CheckpointFunction.forward``
    (``code``) calling ``check_backward_validity`` (the warning's ``stacklevel=2``)."""
    for instruction in dis.get_instructions(code):
        if instruction.argval == "check_backward_validity" and instruction.positions:
            return instruction.positions.lineno or code.co_firstlineno
    return code.co_firstlineno


def _warn_no_input_requires_grad(reentrant: Any) -> None:
    """torch's warning, attributed where torch's ``reentrant`` Function gives it (its module
    and line), so that a filter on it applies as in eager."""
    code = reentrant.forward.__code__
    namespace = sys.modules[reentrant.__module__].__dict__
    warnings.warn_explicit(
        NO_INPUT_REQUIRES_GRAD,
        UserWarning,
        code.co_filename,
        _validity_check_line(code),
        module=reentrant.__module__,
        registry=namespace.setdefault("__warningregistry__", {}),
        module_globals=namespace,
    )


@contextlib.contextmanager
def checkpoints_traced_directly(
    module: torch.nn.Module, *, unsure: bool = False
) -> Iterator[Checkpoints]:
    """Trace the function inside ``torch.utils.checkpoint.checkpoint`` as plain code.

    The reentrant variant is an autograd.Function the exporter cannot express; recompute is
    ORT's job (the memory optimizer). As that Function, a reentrant call whose tensor arguments
    do not require grad warns as torch does and runs its function under ``no_grad``, its
    outputs detached (gradient stops in the graph): PyTorch gives its parameters no gradient.
    ``unsure``: the trace's requires_grad flags cannot be trusted (the dynamo exporter while
    something requires grad), so such a call is refused instead. Yields the :class:`Checkpoints`
    record.

    Counted through public names only (torch moves checkpoint's internals between releases):
    ``checkpoint`` itself, every binding of it that ``module``'s code holds (a module-level
    ``from torch.utils.checkpoint import checkpoint`` in the files defining its submodules'
    classes, a ``functools.partial`` of it stored on a submodule), and ``CheckpointFunction``,
    which the original reentrant variant still reaches from any other binding. The bindings
    are swapped for the export's duration; a call from any other thread goes to torch's own.
    """
    from torch.utils import checkpoint as ckpt

    record = Checkpoints()
    public, reentrant = ckpt.checkpoint, ckpt.CheckpointFunction
    exporting = threading.get_ident()
    buffers = dict(module.named_buffers())

    def watched(function: Any, *args: Any, **kwargs: Any) -> Any:
        before = {name: _torch.version(b) for name, b in buffers.items()}
        try:
            return function(*args, **kwargs)
        finally:
            record.updated.update(
                name for name, b in buffers.items() if _torch.version(b) != before[name]
            )

    def as_reentrant(function: Any, args: tuple[Any, ...]) -> Any:
        record.reads_grad = True
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return watched(function, *args)
        if unsure:
            raise OrtfxExportError(
                REENTRANT_CHECKPOINT_UNSURE.format(
                    module=type(module).__name__, where=user_line(sys._getframe(2))
                )
            )
        _warn_no_input_requires_grad(reentrant)
        with torch.no_grad():
            out = watched(function, *args)
        return optree.tree_map(_detached, out, namespace=io.NAMESPACE)

    def direct(function: Any = None, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != exporting:
            if function is None:
                return public(**kwargs)
            return public(function, *args, **kwargs)
        if function is None:  # the decorator form, checkpoint(use_reentrant=False)(fn)
            return functools.partial(direct, **kwargs)
        own = {k: kwargs.pop(k) for k in _CHECKPOINT_KEYWORDS & kwargs.keys()}
        if kwargs and own.get("use_reentrant") is not False:
            # as torch: only the non-reentrant variant passes keywords on to the function
            raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
        record.calls += 1
        if own.get("use_reentrant") is False:
            return watched(function, *args, **kwargs)
        return as_reentrant(function, args)

    class Direct:
        @staticmethod
        def apply(function: Any, preserve: bool, *args: Any) -> Any:
            if threading.get_ident() != exporting:
                return reentrant.apply(function, preserve, *args)  # type: ignore[no-untyped-call]
            record.calls += 1
            return as_reentrant(function, args)

    undo = _rebind(vars(ckpt), public, direct)
    undo += _rebind(vars(ckpt), reentrant, Direct)
    try:
        for m in module.modules():
            undo += _rebind(vars(m), public, direct)
        for namespace in _class_modules(module, skip=ckpt):
            undo += _rebind(namespace, public, direct)
        yield record
    finally:
        for namespace, name, value in reversed(undo):
            namespace[name] = value
