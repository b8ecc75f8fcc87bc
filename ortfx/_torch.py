"""Every use of torch's private API, in one place, each guarded.

torch moves its internals between releases. Each private name ortfx relies on is looked up here,
once, and a missing one either degrades to a public (slower or coarser) answer or raises a clear
error that names the torch version; nothing else in ortfx touches a private torch name. Where a
public spelling exists it is used instead (``torch.utils.dlpack``, ``torch.autograd.graph``).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

import torch

# ---- nn.Module and Tensor internals ---------------------------------------------------------


def own_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    """The parameters ``module`` itself holds (not its children's), by local name. The dict
    is torch's own: callers read it, and write it only to put back what they took."""
    found: dict[str, torch.nn.Parameter | None] = module._parameters
    return found


def own_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """The buffers ``module`` itself holds, by local name (torch's own dict, see above)."""
    found: dict[str, torch.Tensor | None] = module._buffers
    return found


def own_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """The submodules ``module`` itself holds, by local name (torch's own dict, see above)."""
    found: dict[str, torch.nn.Module | None] = module._modules
    return found


def version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: it moves on every in-place change."""
    return int(tensor._version)


def function_class(node: Any) -> Any:
    """The ``torch.autograd.Function`` class behind a custom Function's autograd node."""
    return type(node)._forward_cls


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


def hook_handles_made() -> int:
    """How many hook handles torch has given out in this process (each registration of a
    module, tensor or global hook takes the next number)."""
    return int(torch.utils.hooks.RemovableHandle.next_id)


def batch_norm_base() -> type[torch.nn.Module]:
    """The (private) base class of BatchNorm1d/2d/3d, whose ``forward`` export replaces."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm


# ---- autograd engine and global modes -------------------------------------------------------

QUEUE_CALLBACK_MISSING = (
    "this torch ({version}) no longer offers torch.autograd.Variable._execution_engine"
    ".queue_callback, which ortfx uses to run code once the running backward pass has finished "
    "(ZeRO-3 releases gathered parameters there); please report this with your torch version."
)


def queue_after_backward(callback: Callable[[], Any]) -> None:
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


_KEEP_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


# Libraries whose tensor hooks on a module's outputs schedule their own work (FSDP's and
# DeepSpeed's pre-backward hooks), not a reading of the gradient.
_LIBRARY_HOOKS: Final = ("torch", "deepspeed", "accelerate", "transformers", "peft", "lightning")


def gradient_watched(tensor: torch.Tensor) -> bool:
    """Whether user code's gradient hook (``register_hook``) or ``retain_grad()`` waits on
    ``tensor``'s gradient (torch keeps its tensor hooks in a private table)."""
    if tensor.retains_grad:
        return True
    hooks = getattr(tensor, "_backward_hooks", None) or {}
    for hook in hooks.values():
        function = getattr(hook, "func", hook)
        owner = getattr(function, "__module__", None) or ""
        if owner.split(".")[0] not in _LIBRARY_HOOKS:
            return True
    return False


def backward_keeps_graph() -> bool:
    """During a backward: whether it was asked to keep the graph (``retain_graph=True``),
    so that another backward may come through the same nodes. Without torch's private
    question, assume it does (the caller then keeps what a second backward needs)."""
    return True if _KEEP_GRAPH is None else bool(_KEEP_GRAPH())


# Looked up once: the question is asked on every call.
_FUNCTORCH_LEVEL = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", None)


def in_functorch_transform() -> bool:
    """Whether this call runs inside a torch.func transform (vmap, grad, ...): torch's
    private level query; without it, never (torch's own error then speaks)."""
    level = _FUNCTORCH_LEVEL
    return level is not None and level() is not None


_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def any_autocast() -> bool:
    """Whether torch.autocast is on for any device type (torch's private one-call question;
    without it, the public per-device checks answer, about ten times slower)."""
    check = _ANY_AUTOCAST
    if check is not None:
        return bool(check())
    return any(torch.is_autocast_enabled(kind) for kind in ("cpu", "cuda", "xpu", "mps"))


_FUNCTION_MODES = getattr(torch._C, "_len_torch_function_stack", None)
_DISPATCH_MODES = getattr(torch._C, "_len_torch_dispatch_stack", None)


def user_modes() -> tuple[str, ...]:
    """The class names of the ``TorchFunctionMode`` s and ``TorchDispatchMode`` s active on
    this thread (torch keeps its mode stacks per thread), but for torch's own device context
    (``with torch.device(...)``), which only sets where factories put tensors. Two cheap
    questions when none is active (every call asks); without torch's private stack queries,
    none is seen."""
    if _FUNCTION_MODES is None or _DISPATCH_MODES is None:
        return ()
    functions, dispatches = _FUNCTION_MODES(), _DISPATCH_MODES()
    if not (functions or dispatches):
        return ()
    from torch.utils._device import DeviceContext

    modes = [torch._C._get_function_stack_at(i) for i in range(functions)]
    modes += [torch._C._get_dispatch_stack_at(i) for i in range(dispatches)]
    return tuple(type(m).__name__ for m in modes if not isinstance(m, DeviceContext))


# ---- the TorchScript tracer -----------------------------------------------------------------

TRACING_STATE_MISSING = (
    "this torch ({version}) no longer offers torch._C._get_tracing_state/_set_tracing_state, "
    "which ortfx uses to export custom autograd Functions without tracing their forward; "
    "please report this with your torch version."
)


def tracing_state_access() -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """torch's getter and setter of the TorchScript tracer's state (this thread's)."""
    get = getattr(torch._C, "_get_tracing_state", None)
    put = getattr(torch._C, "_set_tracing_state", None)
    if get is None or put is None:
        raise RuntimeError(TRACING_STATE_MISSING.format(version=torch.__version__))
    return get, put


def trace_value_of(tensor: torch.Tensor) -> None:
    """Give ``tensor`` a value in the running trace (a constant, for a tensor the tracer did
    not see being made: the tracer was suspended), before autograd makes it require grad."""
    get = getattr(torch._C, "_get_value_trace", None)
    if get is None:
        raise RuntimeError(TRACING_STATE_MISSING.format(version=torch.__version__))
    get(tensor)


def traced_node(tensor: torch.Tensor) -> Any:
    """The node of this thread's running TorchScript trace that made ``tensor`` (None when
    no trace runs here, or it is suspended)."""
    get = getattr(torch._C, "_get_value_trace", None)
    state, _ = tracing_state_access()
    if get is None:
        raise RuntimeError(TRACING_STATE_MISSING.format(version=torch.__version__))
    return get(tensor).node() if state() is not None else None


# TorchScript trace nodes that read only a tensor's sizes, never its values.
_SIZE_NODES = frozenset({"aten::size", "aten::numel", "aten::dim", "prim::shape", "aten::len"})


def traced_origin(tensor: torch.Tensor) -> str:
    """Where the running TorchScript trace computes ``tensor`` from: ``"data"`` (the values of
    a traced input, parameter or buffer), ``"size"`` (only their sizes) or ``"constant"``."""
    get = getattr(torch._C, "_get_value_trace", None)
    if get is None:
        raise RuntimeError(TRACING_STATE_MISSING.format(version=torch.__version__))
    seen: set[int] = set()
    pending = [get(tensor)]
    origin = "constant"
    while pending:
        value = pending.pop()
        if value.unique() in seen:
            continue
        seen.add(value.unique())
        node = value.node()
        kind = node.kind()
        if kind == "prim::Param":
            return "data"
        if kind in _SIZE_NODES:
            origin = "size"
            continue
        pending.extend(node.inputs())
    return origin


# Nodes that draw random numbers: a value computed from one differs on every run.
_RANDOM_NODES = frozenset(
    f"aten::{name}"
    for name in (
        "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
        "bernoulli", "bernoulli_", "normal", "normal_", "uniform_", "multinomial", "poisson",
        "exponential_", "geometric_", "log_normal_", "cauchy_", "random_", "dropout",
        "dropout_", "native_dropout", "feature_dropout", "alpha_dropout",
        "feature_alpha_dropout",
    )
)  # fmt: skip


def traced_from_random(tensor: torch.Tensor, clean: set[int]) -> bool:
    """Whether the running TorchScript trace computes ``tensor``'s values from a random draw
    (sizes of a drawn tensor do not count). ``clean``: the trace's values already found free
    of draws (filled here, shared between calls within one trace: each value is walked once)."""
    get = getattr(torch._C, "_get_value_trace", None)
    if get is None:
        raise RuntimeError(TRACING_STATE_MISSING.format(version=torch.__version__))
    walked: list[int] = []
    pending = [get(tensor)]
    while pending:
        value = pending.pop()
        unique = value.unique()
        if unique in clean:
            continue
        clean.add(unique)  # undone below if a draw is found
        walked.append(unique)
        node = value.node()
        kind = node.kind()
        if kind in _RANDOM_NODES:
            clean.difference_update(walked)
            return True
        if kind == "prim::Param" or kind in _SIZE_NODES:
            continue
        pending.extend(node.inputs())
    return False


def tracer_warning() -> type[Warning]:
    """TorchScript's TracerWarning, imported on use: ``import ortfx`` must survive a torch
    without TorchScript, where the dynamo exporter takes over."""
    from torch.jit._trace import TracerWarning  # the public alias is untyped

    return TracerWarning


def torchscript_exporter_available() -> bool:
    """Whether this torch still ships the TorchScript exporter (moved in 2.9, deprecated)."""
    try:
        tracer_warning()
        importlib.import_module("torch.onnx._internal.torchscript_exporter")
    except ImportError:
        try:  # before torch 2.9 the exporter lived in torch.onnx.utils
            return hasattr(importlib.import_module("torch.onnx.utils"), "_export")
        except ImportError:
            return False
    return True


SYMBOLIC_HELPER_MISSING = (
    "this torch ({version}) no longer offers torch.onnx.symbolic_helper.{name}, which ortfx's "
    "TorchScript symbolics use; use Options(exporter='dynamo'), and please report this with "
    "your torch version."
)


def symbolic_helper(name: str) -> Callable[..., Any]:
    """A private helper of the TorchScript exporter's ``torch.onnx.symbolic_helper``."""
    import torch.onnx.symbolic_helper as helper

    found = getattr(helper, name, None)
    if found is None:

        def missing(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(SYMBOLIC_HELPER_MISSING.format(version=torch.__version__, name=name))

        return missing
    function: Callable[..., Any] = found
    return function


# The code object of torch.autograd.Function.apply: a profile hook recognises its frames.
FUNCTION_APPLY_CODE: types.CodeType = torch.autograd.Function.__dict__["apply"].__func__.__code__


# ---- the TorchScript exporter's whole-graph shape inference ---------------------------------

_GRAPH_SHAPE_INFERENCE = "_jit_pass_onnx_graph_shape_type_inference"
# Parameters larger than this (elements) reach torch's whole-graph shape inference as typed
# inputs instead of values. Given a value, torch clones the node consuming it into a one-node
# ONNX model holding the value as a Constant and serialises it: two transient copies of every
# weight, which made the first step peak a whole embedding table above eager (issue 31). Shapes
# never depend on a weight's values; a shape-like parameter is small and keeps its value.
SHAPE_VALUE_LIMIT = 1 << 16


@contextlib.contextmanager
def shape_inference_without_weights() -> Iterator[None]:
    """For this thread's exports in the block, torch's whole-graph ONNX shape inference sees
    parameters over :data:`SHAPE_VALUE_LIMIT` elements by type and shape only. Other threads'
    calls pass through unchanged; the function is put back on exit (unless someone else
    replaced it meanwhile: theirs stays, and ours forwards to torch's)."""
    original = getattr(torch._C, _GRAPH_SHAPE_INFERENCE, None)
    if original is None:  # a torch without the TorchScript exporter's pass: nothing to scope
        yield
        return
    owner = threading.get_ident()

    def inference(graph: Any, params: dict[str, Any], opset: int) -> Any:
        if threading.get_ident() == owner:
            params = {
                name: value
                for name, value in params.items()
                if not isinstance(value, torch.Tensor) or value.numel() <= SHAPE_VALUE_LIMIT
            }
        return original(graph, params, opset)

    setattr(torch._C, _GRAPH_SHAPE_INFERENCE, inference)
    try:
        yield
    finally:
        if getattr(torch._C, _GRAPH_SHAPE_INFERENCE, None) is inference:
            setattr(torch._C, _GRAPH_SHAPE_INFERENCE, original)


# ---- the TorchScript exporter's symbolic registry -------------------------------------------


def symbolic_modules(opset: int) -> tuple[str, ...]:
    """Where the TorchScript exporter defines its symbolics for ``opset``: its own module
    (moved under ``torch.onnx._internal`` in torch 2.9), then the public re-export."""
    return (
        f"torch.onnx._internal.torchscript_exporter.symbolic_opset{opset}",
        f"torch.onnx.symbolic_opset{opset}",
    )


def _symbolic_registry() -> Any:
    """torch.onnx's registry of TorchScript symbolics (its module moved in torch 2.9)."""
    for name in (
        "torch.onnx._internal.torchscript_exporter.registration",
        "torch.onnx._internal.registration",
    ):
        try:
            return importlib.import_module(name).registry
        except (ImportError, AttributeError):
            continue
    return None


def _overrides(group: Any) -> dict[int, Any] | None:
    """A registry group's custom (user-registered) functions by opset, or None when torch's
    registry no longer looks as read here."""
    functions = getattr(group, "_functions", None)
    found = getattr(functions, "_overrides", None)
    return found if isinstance(found, dict) else None


@contextlib.contextmanager
def symbolics_registered(table: Sequence[tuple[str, Callable[..., Any], int]]) -> Iterator[None]:
    """Register ``(name, symbolic, opset)`` custom symbolics for the block, then put torch's
    registry back exactly as it was: a symbolic someone else registered for the same op and
    opset comes back, a name ortfx introduced disappears. Call it holding ortfx's export lock
    (torch's exporter keeps process-wide state of its own: one export at a time).

    Without the registry internals read here (a future torch), the public calls register and
    unregister: exact unless another library registered a custom symbolic for one of the same
    ops, which would then not come back (docs/architecture.md, process-wide effects).
    """
    register: Any = torch.onnx.register_custom_op_symbolic  # type: ignore[attr-defined]
    unregister: Any = torch.onnx.unregister_custom_op_symbolic  # type: ignore[attr-defined]
    _torchs_symbolics_registered()
    tables = getattr(_symbolic_registry(), "_registry", None)
    undo: list[Callable[[], None]] = []
    try:
        for name, symbolic, opset in table:
            undo.append(_undo_registration(tables, name, opset, unregister))
            register(name, symbolic, opset)
        yield
    finally:
        for step in reversed(undo):
            step()


def _torchs_symbolics_registered() -> None:
    """Import torch's own symbolic modules, as its first export does: torch fills its registry
    lazily, and a name ortfx registered before that would be taken for one ortfx introduced
    (its undo then removed torch's own symbolics with ortfx's: a user's later export of
    ``F.cross_entropy`` failed)."""
    trigger = None
    for name in (
        "torch.onnx._internal.torchscript_exporter.utils",
        "torch.onnx.utils",
    ):
        try:
            trigger = importlib.import_module(name)._trigger_symbolic_function_registration
            break
        except (ImportError, AttributeError):
            continue
    if trigger is not None:
        trigger()
        return
    for version in range(7, 26):  # a torch without the trigger: its modules by name
        with contextlib.suppress(ImportError):
            importlib.import_module(f"torch.onnx.symbolic_opset{version}")


def _undo_registration(
    tables: Any, name: str, opset: int, unregister: Callable[[str, int], None]
) -> Callable[[], None]:
    """What puts the registry back after ``name`` is registered at ``opset``."""
    if not isinstance(tables, dict):
        return lambda: unregister(name, opset)
    group = tables.get(name)
    if group is None:
        return lambda: tables.pop(name, None)  # ortfx introduced the name: gone again
    overrides = _overrides(group)
    if overrides is None:
        return lambda: unregister(name, opset)
    earlier = overrides.get(opset)
    functions = group._functions
    if earlier is None:
        return lambda: functions.remove_override(opset)
    return lambda: functions.override(opset, earlier)


_OPAQUE: dict[Any, Any] = {}


def opaque_to_dynamo(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` wrapped by ``torch.compiler.disable`` (cached): Dynamo runs it as it is."""
    found = _OPAQUE.get(function)
    if found is None:
        found = _OPAQUE[function] = torch.compiler.disable(function)  # type: ignore[no-untyped-call]
    return found  # type: ignore[no-any-return]
