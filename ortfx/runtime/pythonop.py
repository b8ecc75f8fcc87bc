"""PythonOp: a custom ``torch.autograd.Function`` running inside the ORT graph.

ORT runs a ``com.microsoft::PythonOp`` node by calling a C++ runner (``ortfx._bridge``), which
takes the GIL and calls :func:`forward_runner` here; ``PythonOpGrad`` calls
:func:`backward_runner`. All torch work happens here:

* Forward (safe mode, the default): tensors arrive as DLPack capsules that share ORT's buffers.
  They become leaves with ORT's requires-grad flags; inputs the Function may modify in place are
  cloned first (all of them on a node's first run, then those it marked dirty), so ORT's own
  buffers never change. The node's ``func_name`` says which arguments are bool tensors (ORT
  hands them over as uint8) and which are Python numbers in eager (sizes the tracer made
  tensors). ``Function.apply`` runs with grad enabled, exactly as in eager mode. The autograd
  node it creates is the ctx handed to ORT; ortfx keeps the outputs (and so the node, its saved
  tensors and its input edges) alive in :data:`_CONTEXTS` until backward.
* Backward: with a grad for every output, ``backward`` is called directly and what it returns
  checked as torch's engine does (:mod:`ortfx.runtime.function_grads`); otherwise the grads ORT
  has are fed to ``torch.autograd.grad`` over the kept outputs, so the eager engine itself
  applies ``set_materialize_grads``, ``mark_non_differentiable``, dirty inputs and hooks. ORT
  gets zeros where backward gave None, and the runner's backward learns where
  (:func:`recording_no_gradient`). The kept entry is then released, with the ctx's attributes
  and saved tensors.
* Outputs that share memory with an input ORT owns are copied: ORT assumes a fresh buffer.
* Unsafe mode (``safe_run_mode=0`` on the node) calls ``forward(ctx, ...)`` / ``backward`` with a
  plain context object, which ORT then holds alone.

Reference counts follow ORT 1.19: every returned capsule is referenced only by the returned
list; in training the ctx has at least two references (ORT's and the autograd node's).

A Python exception in a runner is kept per thread (:func:`take_error`) so that the session can
re-raise the original exception instead of ORT's wrapper of it.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack  # type: ignore[attr-defined]

from ortfx import _torch
from ortfx.errors import OrtfxInitError
from ortfx.function_names import NodeName, parse_node_name
from ortfx.runtime import function_grads, memgrad, openmp

BRIDGE_MISSING = (
    "the exported graph runs custom torch.autograd.Function(s) {names} as ORT PythonOp nodes, "
    "which needs ortfx's compiled bridge (ortfx._bridge), but it could not be loaded: {error}. "
    "Reinstall ortfx with a C++ compiler available (`pip install -e .` builds it in about a "
    "second), or turn the feature off with Options(enable_custom_autograd_function=False) and "
    "run the module in PyTorch."
)


@attrs.define
class _Kernel:
    """What one PythonOp node (by ORT's invoke id) learned on its first run."""

    first: bool = True
    dirty: frozenset[int] = frozenset()  # argument positions the Function modifies in place


class _Box:
    """A tensor the Function saved for backward, held where ortfx can drop it."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor


def _unpack(box: _Box) -> torch.Tensor:
    if box.tensor is None:
        raise RuntimeError(
            "ortfx PythonOp: this Function's saved tensors were released because its forward "
            "graph was freed before backward"
        )
    return box.tensor


@attrs.frozen
class _Kept:
    """What a training forward keeps alive until its backward."""

    outputs: tuple[torch.Tensor | None, ...]  # as the Function returned them (with grad_fn)
    leaves: tuple[torch.Tensor | None, ...]  # per argument: the leaf grads flow to, or None
    tensors: tuple[bool, ...]  # per argument: whether it is a tensor
    saved: list[_Box]  # what ctx.save_for_backward stored
    node: int | None  # the node's number among the graph's PythonOps

    def drop(self, node: Any, *, ran: bool = False) -> None:
        """Free what the ctx reaches once its backward has run (``ran``) or can no longer run.
        A Function may have made a cycle through its ctx (``ctx.out = out``) that only the
        garbage collector would break; clearing the ctx's attributes and saved tensors breaks
        it, and the node then frees its input leaves (ORT's buffers) itself. A ctx whose
        backward never ran stays in ORT 1.19's context pool until exit, keeping its autograd
        node and that node's input edges: their leaves' storage is released too."""
        for box in self.saved:
            box.tensor = None
        vars(node).clear()
        if ran:
            return
        for leaf in self.leaves:
            if leaf is not None:
                # Our own leaf over ORT's buffer, reachable only through the node's edges.
                leaf.data = torch.empty(0, dtype=leaf.dtype, device=leaf.device)


_KERNELS: dict[str, _Kernel] = {}
_UNNAMED = NodeName()
# token -> outputs and leaves (or a parameter feed's context), until backward. A token, not
# id(ctx): ids are reused once a ctx is freed, and a late release of an old forward must never
# drop a newer forward's context.
_CONTEXTS: dict[int, _Kept | memgrad.Fed] = {}
_TOKENS = itertools.count(1)
# .training: the kept-context list of the ORT training forward running on this thread, or None;
# .error: the exception a runner raised.
_LOCAL = threading.local()
_LOCK = threading.Lock()
_registered: list[str] = []  # function names already handed to ORT
_SETUP_LOCK = threading.Lock()
_bridge: Any = None


# One ORT run of a graph with PythonOp nodes at a time in the process. Two threads each inside
# such a run deadlock (measured: two wrappers, one intra-op thread each): each holds one of the
# GIL and ORT's own lock around Python calls while waiting for the other. Waiting on this lock
# releases the GIL. Reentrant: a Function's forward may itself run an ORTModule.
RUN_LOCK = threading.RLock()


def live_contexts() -> int:
    """Contexts kept for a backward that has not run yet (0 between training steps)."""
    return len(_CONTEXTS)


def take_error() -> BaseException | None:
    """The exception a runner raised on this thread since the last call, if any."""
    error: BaseException | None = getattr(_LOCAL, "error", None)
    _LOCAL.error = None
    return error


@contextlib.contextmanager
def training_run() -> Iterator[list[int]]:
    """Mark an ORT forward that a backward may follow: only then are contexts kept.

    Yields the list of kept contexts (ids); pass it to :func:`release` when the forward's run
    state dies, so a forward whose backward never runs (an eval-mode training graph, an unused
    output) releases them too.
    """
    before = getattr(_LOCAL, "training", None)
    kept: list[int] = []
    _LOCAL.training = kept
    try:
        yield kept
    finally:
        _LOCAL.training = before


def release(contexts: Sequence[int]) -> None:
    """Drop what the given forward contexts kept, if their backward has not done so."""
    with _LOCK:
        dropped = [kept for key in contexts if (kept := _CONTEXTS.pop(key, None)) is not None]
    for kept in dropped:
        if isinstance(kept, memgrad.Fed):
            continue  # holds the parameter only
        node = next(o.grad_fn for o in kept.outputs if o is not None and o.grad_fn is not None)
        kept.drop(node)


def _storages(tensors: Sequence[torch.Tensor | None]) -> frozenset[int]:
    return frozenset(t.untyped_storage().data_ptr() for t in tensors if t is not None)


def _capsule(value: Any, owned: frozenset[int]) -> Any:
    """A DLPack capsule ORT can own, copying values that alias ORT's own buffers."""
    if not isinstance(value, torch.Tensor):
        return None
    tensor = value.detach()
    if tensor.dtype == torch.bool:
        # ORT 1.19 reads no DLPack bool; it takes a bool output's bytes as uint8.
        tensor = tensor.view(torch.uint8)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    elif tensor.untyped_storage().data_ptr() in owned:
        tensor = tensor.clone()
    return to_dlpack(tensor)


class _PlainContext:
    """The ctx of unsafe mode: ``forward`` and ``backward`` are called directly."""

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple[torch.Tensor, ...] = ()
        self.materialize_grads = True
        self.outputs_meta: list[tuple[torch.Size, torch.dtype, torch.device] | None] = []

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors

    def mark_dirty(self, *tensors: torch.Tensor) -> None:
        pass  # inputs are copies already

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def _feed_forward(index: int) -> list[Any]:
    """A parameter feed of memory-efficient gradient management (:mod:`ortfx.runtime.memgrad`),
    run without ``Function.apply``: its trigger carries nothing, and its backward needs only
    the parameter, so an autograd node, leaves and saved tensors would be pure cost (the
    parameter's whole round trip fell from 78 to 45 µs; docs/memory.md)."""
    param, value, _ = memgrad.take(index)
    run: list[int] | None = getattr(_LOCAL, "training", None)
    capsule = _capsule(value, frozenset())
    if run is None:
        return [None, capsule]
    ctx = memgrad.Fed(param, index, _torch.version(param), next(_TOKENS))
    with _LOCK:
        _CONTEXTS[ctx.token] = ctx  # also the second reference ORT wants on a training ctx
    run.append(ctx.token)
    return [ctx, capsule]


def _feed_backward(ctx: memgrad.Fed, incoming: tuple[Any, ...]) -> list[Any]:
    with _LOCK:
        kept = _CONTEXTS.pop(ctx.token, None)
    if kept is None:
        raise RuntimeError(
            "ortfx PythonOp: no kept forward for a parameter feed; its backward ran twice or "
            "after the bridge was torn down"
        )
    grad = from_dlpack(incoming[0]) if incoming[0] is not None else None
    if grad is not None and not _no_gradient_for(ctx.index):
        memgrad.give(ctx.param, ctx.index, ctx.version, grad)
    # The trigger's gradient (ORT wants one; ortfx drops it); the index has none.
    return [to_dlpack(torch.zeros((), dtype=torch.float32)), None]


def _forward(
    callback: Any,
    requires_grad: list[int],
    tensor_flags: list[int],
    invoke_id: str,
    safe: bool,
    args: tuple[Any, ...],
    name: NodeName = _UNNAMED,
) -> list[Any]:
    kernel = _KERNELS.get(invoke_id)
    if kernel is None:
        kernel = _KERNELS[invoke_id] = _Kernel()
    run: list[int] | None = getattr(_LOCAL, "training", None)
    training = run is not None
    owned: list[torch.Tensor | None] = []  # ORT's buffers, as given
    leaves: list[torch.Tensor | None] = []
    call: list[Any] = []
    for i, (arg, flag) in enumerate(zip(args, tensor_flags, strict=True)):
        if flag != 1 or arg is None:
            call.append(arg)
            leaves.append(None)
            continue
        tensor = from_dlpack(arg)
        if i in name.bools:
            tensor = tensor.view(torch.bool)  # ORT hands bool tensors over as uint8
        if i in name.numbers:
            # A Python number in eager (a size, or arithmetic on sizes) that the tracer made
            # a 0-dim tensor: the Function gets the number, as in eager.
            call.append(tensor.item())
            leaves.append(None)
            continue
        owned.append(tensor)
        grad = training and bool(requires_grad[i]) and tensor.is_floating_point()
        leaf = tensor.requires_grad_() if grad else tensor  # a fresh tensor: ours to flag
        leaves.append(leaf if grad else None)
        if kernel.first or i in kernel.dirty or not safe:
            # The Function may write into it: give it a copy (a non-leaf, so mark_dirty works).
            with torch.set_grad_enabled(grad):
                leaf = leaf.clone()
        call.append(leaf)

    if not safe:
        ctx = _PlainContext(tuple(leaf is not None for leaf in leaves))
        with torch.no_grad():
            outputs = _as_tuple(callback(ctx, *call))
        ctx.outputs_meta = [
            (o.shape, o.dtype, o.device) if isinstance(o, torch.Tensor) else None for o in outputs
        ]
        kernel.first = False
        # Unsafe mode: ORT must hold the only reference to ctx.
        storages = _storages(owned)
        return [ctx if training else None, *(_capsule(o, storages) for o in outputs)]

    saved: list[_Box] = []

    def pack(tensor: torch.Tensor) -> _Box:
        # Detached: a saved *output* holds its grad_fn, this very node, which holds the box,
        # a cycle through C++ that the garbage collector cannot see (every step's ctx and
        # inputs stayed alive). torch gives the unpacked tensor its autograd metadata back.
        saved.append(_Box(tensor.detach()))
        return saved[-1]

    with torch.set_grad_enabled(training), torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        outputs = _as_tuple(callback(*call))
    if kernel.first:
        kernel.first = False
        kernel.dirty = frozenset(
            i for i, arg in enumerate(call) if any(o is arg for o in outputs if o is not None)
        )
    node = next(
        (o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None),
        None,
    )
    result: list[Any] = [None]
    if training and node is not None:
        token = next(_TOKENS)
        node._ortfx_token = token  # type: ignore[attr-defined]
        with _LOCK:
            tensors = tuple(f == 1 and i not in name.numbers for i, f in enumerate(tensor_flags))
            _CONTEXTS[token] = _Kept(tuple(outputs), tuple(leaves), tensors, saved, name.node)
        assert run is not None
        run.append(token)
        result[0] = node
    storages = _storages(owned)
    result.extend(_capsule(o, storages) for o in outputs)
    if node is not None and getattr(node, "ortfx_drop_outputs", False):
        # The Function says ORT owns its outputs' memory (e.g. a ZeRO-3 gathered weight that
        # must die with ORT's last reader): keep only their metadata until backward.
        for o in outputs:
            if isinstance(o, torch.Tensor):
                o.data = torch.empty(0, dtype=o.dtype, device=o.device)
    return result


def _backward(callback: Any, args: tuple[Any, ...]) -> list[Any]:
    ctx, incoming = args[0], args[1:]
    if isinstance(ctx, memgrad.Fed):
        return _feed_backward(ctx, incoming)
    grads = [from_dlpack(g) if g is not None else None for g in incoming]
    if isinstance(ctx, _PlainContext):
        filled = [
            g
            if g is not None or not ctx.materialize_grads or meta is None
            else torch.zeros(meta[0], dtype=meta[1], device=meta[2])
            for g, meta in zip(grads, ctx.outputs_meta, strict=True)
        ]
        with torch.no_grad():
            returned = list(_as_tuple(callback(ctx, *filled)))
        return [_capsule(r, _storages(grads)) for r in returned]
    with _LOCK:
        kept = _CONTEXTS.pop(getattr(ctx, "_ortfx_token", 0), None)
    if not isinstance(kept, _Kept):  # tokens of autograd nodes only ever map to _Kept
        raise RuntimeError(
            f"ortfx PythonOp: no kept forward for {type(ctx).__name__}; its backward ran twice "
            "or after the bridge was torn down"
        )
    try:
        returned = _kept_backward(ctx, kept, grads)
        storages = _storages(grads)
        return [_capsule(r, storages) for r in _no_gradient_as_zeros(kept, returned)]
    finally:
        kept.drop(ctx, ran=True)  # nothing of this forward is needed any more


def _no_gradient_as_zeros(
    kept: _Kept, returned: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Zeros where backward gave no gradient (None) for an input that requires grad: ORT wants
    a tensor for it. The runner's backward is told (:func:`recording_no_gradient`), so the
    graph inputs that get no gradient from anywhere else get None, as in eager."""
    cut: list[tuple[int, int]] | None = getattr(_LOCAL, "no_gradient", None)
    filled: list[torch.Tensor | None] = []
    for position, (grad, leaf) in enumerate(zip(returned, kept.leaves, strict=True)):
        if leaf is not None and grad is None:
            if cut is not None and kept.node is not None:
                cut.append((kept.node, position))
            grad = torch.zeros_like(leaf)
        filled.append(grad)
    return filled


@contextlib.contextmanager
def recording_no_gradient(
    model: bytes, seeded: Sequence[str] | None = None
) -> Iterator[list[tuple[int, int]]]:
    """Collect, during an ORT backward of ``model`` on this thread, the (node number, apply()
    position) pairs whose Function's backward gave no gradient for an input that requires
    grad; ``seeded``: the graph outputs that got a gradient, when not all did."""
    names = ("no_gradient", "model", "seeded")
    before = tuple(getattr(_LOCAL, name, None) for name in names)
    cut: list[tuple[int, int]] = []
    _LOCAL.no_gradient, _LOCAL.model, _LOCAL.seeded = cut, model, seeded
    try:
        yield cut
    finally:
        _LOCAL.no_gradient, _LOCAL.model, _LOCAL.seeded = before


def _no_gradient_for(index: int) -> bool:
    """Whether fed parameter ``index`` gets no gradient, eager's None: ORT's zeros reached it
    only through Function backwards that gave None, or from outputs that got no gradient.
    Every backward behind the feed in the graph has run by the time its own runs, so what
    they gave up is known."""
    cut: list[tuple[int, int]] | None = getattr(_LOCAL, "no_gradient", None)
    seeded: Sequence[str] | None = getattr(_LOCAL, "seeded", None)
    if not cut and seeded is None:
        return False
    model: bytes = _LOCAL.model
    value = function_grads.fed_value(model, index)
    return bool(function_grads.no_gradient_inputs(model, cut or (), [value], seeded))


def _kept_backward(
    ctx: Any, kept: _Kept, grads: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """One gradient per forward argument: a tensor for each leaf, else None."""
    differentiable = [
        (o, g)
        for o, g in zip(kept.outputs, grads, strict=True)
        if isinstance(o, torch.Tensor) and o.requires_grad
    ]
    dropped = getattr(ctx, "ortfx_drop_outputs", False)  # outputs kept as metadata only
    if dropped or (
        len(differentiable) == len(grads) and all(g is not None for _, g in differentiable)
    ):
        # Every output has its grad: nothing to materialize, so call backward directly, as
        # the engine would (about 3x cheaper than going through it), and check what it
        # returned as the engine does.
        with torch.no_grad():
            direct = _torch.function_class(ctx).backward(ctx, *grads)
        if function_grads.fits(direct, kept.leaves):
            values = direct if isinstance(direct, tuple) else (direct,)
            return [
                r if leaf is not None else None for r, leaf in zip(values, kept.leaves, strict=True)
            ]
        with torch.no_grad():
            return function_grads.eager_gradients(
                type(ctx).__name__, direct, kept.leaves, kept.tensors
            )
    # Otherwise the eager engine over the kept outputs: materialized grads, non-differentiable
    # outputs, dirty inputs and the checks of what backward returned behave exactly as in
    # PyTorch.
    pairs = [(o, g) for o, g in differentiable if g is not None]
    targets = [leaf for leaf in kept.leaves if leaf is not None]
    found: list[torch.Tensor | None]
    if targets and pairs:
        with torch.enable_grad():
            found = list(
                torch.autograd.grad(
                    [o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True
                )
            )
    else:
        # No grad reached any output: eager would not run this backward at all.
        found = [None] * len(targets)
    by_position = iter(found)
    return [next(by_position) if leaf is not None else None for leaf in kept.leaves]


def forward_runner(
    func_name: str,
    callback: Any,
    requires_grad: list[int],
    tensor_flags: list[int],
    is_training: bool,
    inplace_map: list[int],
    invoke_id: str,
    safe: bool,
    args: tuple[Any, ...],
) -> list[Any]:
    """Called by the bridge for each PythonOp run; returns ``[ctx, capsule or None, ...]``."""
    try:
        if func_name == memgrad.FUNCTION_NAME and safe:
            return _feed_forward(args[1])
        name = parse_node_name(func_name)
        return _forward(callback, requires_grad, tensor_flags, invoke_id, safe, args, name)
    except BaseException as e:
        _LOCAL.error = e
        raise
    finally:
        openmp.after_callback()


def backward_runner(
    func_name: str,
    callback: Any,
    requires_grad: list[int],
    tensor_flags: list[int],
    is_training: bool,
    inplace_map: list[int],
    invoke_id: str,
    safe: bool,
    args: tuple[Any, ...],
) -> list[Any]:
    """Called by the bridge for each PythonOpGrad run; one capsule or None per forward input."""
    try:
        return _backward(callback, args)
    except BaseException as e:
        _LOCAL.error = e
        raise
    finally:
        openmp.after_callback()


def _load_bridge(names: Sequence[str]) -> Any:
    try:
        from ortfx import _bridge  # type: ignore[attr-defined]
    except ImportError as e:
        raise OrtfxInitError(BRIDGE_MISSING.format(names=", ".join(names), error=e)) from e
    return _bridge


def teardown() -> None:
    """Drop every kept context, then make ORT drop its Python references (run at exit)."""
    from onnxruntime.capi import _pybind_state as C

    with _LOCK:
        _CONTEXTS.clear()
    C.unregister_python_functions()
    _registered.clear()
    if _bridge is not None:
        _bridge.clear()


def prepare(functions: dict[str, type]) -> None:
    """Make sure ORT can run PythonOp nodes for ``functions`` (name in the graph -> class).

    Loads and registers the bridge once per process, and each Function class once.
    """
    global _bridge
    if not functions:
        return
    from onnxruntime.capi import _pybind_state as C

    with _SETUP_LOCK:  # two threads preparing their first graphs at once set up once
        if _bridge is None:
            bridge = _load_bridge(sorted(functions))
            C.register_forward_runner(bridge.forward_runner_address())
            C.register_backward_runner(bridge.backward_runner_address())
            bridge.set_runners(forward_runner, backward_runner)
            _bridge = bridge
            atexit.register(teardown)
        for name, cls in functions.items():
            if name not in _registered:
                C.register_torch_autograd_function(name, cls)
                _registered.append(name)
