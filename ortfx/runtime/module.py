"""``ORTModule``: the drop-in ``nn.Module`` wrapper. It holds one reference to an immutable
:class:`~ortfx.transitions.ExportState` and swaps it whole after each successful transition."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import os
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import attrs
import onnx
import optree
import torch

from ortfx import io, memory, passes
from ortfx.errors import (
    DATA_PARALLEL,
    INPUT_ON_OTHER_DEVICE,
    NOT_A_MODULE,
    PARAMS_ON_SEVERAL_DEVICES,
    OrtfxDeviceError,
    OrtfxError,
    OrtfxExportError,
    OrtfxInitError,
    OrtfxIOError,
    OrtfxRuntimeError,
    OrtfxTorchModelError,
    OrtfxWarning,
)
from ortfx.export import export, resolve_exporter
from ortfx.io import STATIC_TYPES
from ortfx.memory import MemoryPlan
from ortfx.model_info import InputKind, PostExportProcessedModelInfo
from ortfx.options import DebugOptions, FallbackPolicy, Options
from ortfx.runtime.autograd import RunORT
from ortfx.runtime.logs import WrapperLog, captured, feature_table
from ortfx.runtime.session import (
    InferenceRunner,
    Timings,
    TrainingRunner,
    require_ort,
    with_symbolic_shapes,
)
from ortfx.schema import ModelSchema, TensorSpec, leaf_spec, tensorize_scalars
from ortfx.transitions import (
    REPEATED_REEXPORT,
    Call,
    Decision,
    ExportKey,
    ExportState,
    GradState,
    Reexport,
    Reprocess,
    Reuse,
    SessionKey,
    Stats,
    Transition,
    apply,
    bump_module_version,
    count_reuse,
    decide,
    decision_name,
    note_fallback_call,
    note_session,
    start_fallback,
)

VERSIONS = (torch.__version__, onnx.__version__)


class Compiled:
    """The shell's artifacts for one cache entry: the processed graph and its lazy runners."""

    def __init__(self, info: PostExportProcessedModelInfo, timings: Timings) -> None:
        self.info = info
        self.timings = timings
        self.training: TrainingRunner | None = None
        self.inference: InferenceRunner | None = None
        self.ran = False  # whether ORT has run this graph once (shape failures after that)
        self.memory: tuple[MemoryPlan, ...] | None = None  # the recompute report, once known
        self.dims: dict[str, int] = {}  # input dim name -> size when the runner was built
        self.fingerprint: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...] = ()


# The fallback key of failures that no later call can fix (unsupported module, no ORT).
_ALWAYS = "every call"

# Which policy flag allows falling back from which error (first match wins).
_FALLBACK_FLAGS: tuple[tuple[type[OrtfxError], FallbackPolicy], ...] = (
    (OrtfxIOError, FallbackPolicy.UNSUPPORTED_DATA),
    (OrtfxDeviceError, FallbackPolicy.UNSUPPORTED_DEVICE),
    (OrtfxTorchModelError, FallbackPolicy.UNSUPPORTED_TORCH_MODEL),
    (OrtfxExportError, FallbackPolicy.UNSUPPORTED_ONNX_MODEL),
    (OrtfxRuntimeError, FallbackPolicy.UNSUPPORTED_ONNX_MODEL),
    (OrtfxError, FallbackPolicy.BAD_INITIALIZATION),
)


def _fallback_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """What makes a call "the same" for fallback: structure, static values and tensor kinds."""
    leaves, spec = io.flatten(io.call_tree(args, kwargs))
    kinds = tuple(
        leaf_spec(x) if isinstance(x, (torch.Tensor, *STATIC_TYPES)) else type(x) for x in leaves
    )
    return (spec, kinds)


@attrs.frozen
class Tracked:
    """The module's parameters and buffers as the graph sees them; rebuilt when they change."""

    param_names: tuple[str, ...]
    params: tuple[torch.nn.Parameter, ...]
    named_tensors: Mapping[str, torch.Tensor]
    device: torch.device
    # Where the first parameter lives: .to('meta') and friends replace every Parameter object
    # without a registration hook; checking this one slot per call catches that cheaply.
    first_slot: tuple[torch.nn.Module, str] | None = None

    def replaced(self) -> bool:
        if self.first_slot is None:
            return False
        owner, name = self.first_slot
        return owner._parameters.get(name) is not self.params[0]

    def fingerprint(self) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
        """Name, dtype and shape of every parameter and buffer, as the graph was built for."""
        return tuple((n, t.dtype, tuple(t.shape)) for n, t in self.named_tensors.items())


def _track(module: torch.nn.Module) -> Tracked:
    params = dict(module.named_parameters())
    named: dict[str, torch.Tensor] = {**params, **dict(module.named_buffers())}
    devices = {t.device for t in named.values()}
    if len(devices) > 1:
        raise OrtfxDeviceError(
            PARAMS_ON_SEVERAL_DEVICES.format(devices=", ".join(sorted(map(str, devices))))
        )
    device = devices.pop() if devices else torch.device("cpu")
    first_slot = None
    if params:
        path, _, name = next(iter(params)).rpartition(".")
        first_slot = (module.get_submodule(path), name)
    return Tracked(tuple(params), tuple(params.values()), named, device, first_slot)


# Names that live on the wrapper itself; everything else is forwarded to the user's module.
_OWN = frozenset({"training", "forward", "_original_module"})

# Bookkeeping DeepSpeed writes on the modules it hooks, some on every forward
# (ds_grads_remaining, applied_pre_backward_ref_cnt). Written on the wrapper, it is the
# wrapper's own state: kept there, out of the user's module, so its forward cannot read it and
# no graph depends on it. A name the user's module already has is forwarded (and invalidates).
_HOOK_STATE_PREFIX = "ds_"
_HOOK_STATE_NAMES = frozenset({"applied_pre_backward_ref_cnt", "pre_bwd_fn", "post_bwd_fn"})


def _hook_state(wrapper: torch.nn.Module, name: str) -> bool:
    if not (name.startswith(_HOOK_STATE_PREFIX) or name in _HOOK_STATE_NAMES):
        return False
    return name in wrapper.__dict__ or not hasattr(
        wrapper.__dict__["_modules"]["_original_module"], name
    )


class ORTModule(torch.nn.Module):
    """Runs ``module``'s forward and backward in ONNX Runtime; otherwise behaves like it.

    ``parameters()``, ``state_dict()``, attributes and user-defined methods are the wrapped
    module's own; attributes set through the wrapper land on it and invalidate its graphs.
    """

    # Instance state lives in __dict__ (set in _ortfx_setup); declared here for type checkers.
    _ortfx_options: Options
    _ortfx_log: WrapperLog
    _ortfx_exporter: str
    _ortfx_state: ExportState[Compiled]
    _ortfx_tracked: Tracked | None
    _ortfx_dynamic: frozenset[str]
    _ortfx_static: set[str]
    _ortfx_last: tuple[tuple[Any, ...], Call, Compiled] | None
    _ortfx_bound: tuple[str, ...]

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped user module."""
        module: torch.nn.Module = self._modules["_original_module"]  # type: ignore[assignment]
        return module

    def __init__(
        self,
        module: torch.nn.Module,
        debug_options: DebugOptions | None = None,
        *,
        options: Options | None = None,
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise OrtfxTorchModelError(NOT_A_MODULE.format(type_name=type(module).__qualname__))
        if debug_options is not None and not isinstance(debug_options, DebugOptions):
            raise TypeError(
                f"debug_options must be an ortfx.DebugOptions, got {type(debug_options).__name__}; "
                "pass e.g. ortfx.DebugOptions(log_level=ortfx.LogLevel.INFO)."
            )
        if isinstance(module, ORTModule):
            raise OrtfxTorchModelError(
                "ortfx.ORTModule was given a module that is already an ORTModule; wrap the "
                "original module once."
            )
        resolved = options if options is not None else Options()
        if debug_options is not None:
            resolved = debug_options.apply(resolved)
        resolved = Options.from_env(resolved)  # the environment wins, as upstream
        super().__init__()
        torch.nn.Module.__setattr__(self, "_original_module", module)
        object.__setattr__(self, "training", module.training)
        self._ortfx_setup(resolved)
        unsupported: OrtfxError | None = None
        if isinstance(module, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            unsupported = OrtfxTorchModelError(
                DATA_PARALLEL.format(type_name=type(module).__name__)
            )
        else:
            try:
                require_ort()
            except OrtfxInitError as e:
                unsupported = e
        if unsupported is not None:
            # Nothing about a later call can fix these: fall back for good, or raise.
            self._ortfx_fall_back(unsupported, key=_ALWAYS, retry=False, during_call=False)

    # ---- construction, pickling -----------------------------------------------------------

    def _ortfx_setup(self, options: Options) -> None:
        module = self.module
        own = self.__dict__
        own["_ortfx_options"] = options
        own["_ortfx_log"] = WrapperLog(options.log_level)
        own["_ortfx_exporter"] = resolve_exporter(options.exporter)
        own["_ortfx_state"] = ExportState[Compiled](maxsize=options.cache_size)
        own["_ortfx_tracked"] = None
        own["_ortfx_muted_hooks"] = False
        own["_ortfx_dynamic"] = frozenset(options.dynamic_scalars)
        own["_ortfx_static"] = set()  # dynamic scalar paths found baked into a graph
        own["_ortfx_last"] = None  # (signature, call, compiled) of the last call, for reuse
        # The wrapper's forward shows the user's signature (inspect, IDEs, HF's argument checks).
        call = functools.partial(ORTModule._ortfx_forward, self)
        forward = functools.update_wrapper(lambda *a, **k: call(*a, **k), module.forward)
        forward.__signature__ = inspect.signature(module.forward)  # type: ignore[attr-defined]
        own["forward"] = forward
        # User-defined methods run with the wrapper as self, so their self(...) goes through ORT.
        for name, fn in _user_methods(type(module)):
            own.setdefault(name, types.MethodType(fn, self))
        own["_ortfx_bound"] = tuple(name for name, _ in _user_methods(type(module)))
        _watch(self)

    def __getstate__(self) -> dict[str, Any]:
        state = {
            k: v
            for k, v in self.__dict__.items()
            if not k.startswith("_ortfx") and k != "forward" and k not in self._ortfx_bound
        }
        state["_ortfx_pickled"] = self._ortfx_options
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        options = state.pop("_ortfx_pickled")
        self.__dict__.update(state)
        self._ortfx_setup(options)

    # ---- delegation of the nn.Module API ---------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name == "_original_module":
            return super().__getattr__(name)
        return getattr(self.module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN or name.startswith("_ortfx") or _hook_state(self, name):
            object.__setattr__(self, name, value)
            return
        with self._ortfx_muted():
            setattr(self.module, name, value)
        self._ortfx_invalidate(f"attribute {name!r} set through the wrapper")

    def __delattr__(self, name: str) -> None:
        if (
            name in _OWN
            or name.startswith("_ortfx")
            or (_hook_state(self, name) and name in self.__dict__)
        ):
            object.__delattr__(self, name)
            return
        with self._ortfx_muted():
            delattr(self.module, name)
        self._ortfx_invalidate(f"attribute {name!r} deleted through the wrapper")

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def named_children(self) -> Iterator[tuple[str, torch.nn.Module]]:
        return self.module.named_children()

    def named_modules(
        self,
        memo: set[torch.nn.Module] | None = None,
        prefix: str = "",
        remove_duplicate: bool = True,
    ) -> Iterator[tuple[str, torch.nn.Module]]:
        modules: Iterator[tuple[str, torch.nn.Module]]
        modules = self.module.named_modules(memo, prefix, remove_duplicate)
        return modules

    def train(self, mode: bool = True) -> ORTModule:
        object.__setattr__(self, "training", mode)
        self.module.train(mode)
        return self

    def apply(self, fn: Callable[[torch.nn.Module], None]) -> ORTModule:
        self.module.apply(fn)
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        with self._ortfx_muted():
            result = self.module.load_state_dict(state_dict, strict, assign)
        if assign:  # new tensor objects replace the parameters
            self._ortfx_invalidate("load_state_dict(assign=True) replaced the parameters")
        return result

    def register_buffer(
        self, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        with self._ortfx_muted():
            self.module.register_buffer(name, tensor, persistent)
        self._ortfx_invalidate(f"buffer {name!r} registered through the wrapper")

    def register_parameter(self, name: str, param: torch.nn.Parameter | None) -> None:
        with self._ortfx_muted():
            self.module.register_parameter(name, param)
        self._ortfx_invalidate(f"parameter {name!r} registered through the wrapper")

    def add_module(self, name: str, module: torch.nn.Module | None) -> None:
        with self._ortfx_muted():
            self.module.add_module(name, module)
        self._ortfx_invalidate(f"submodule {name!r} added through the wrapper")

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ORTModule:
        before = [(t.dtype, t.shape) for t in self.module.state_dict().values()]
        self.module._apply(fn, recurse)  # type: ignore[no-untyped-call]
        after = [(t.dtype, t.shape) for t in self.module.state_dict().values()]
        self.__dict__["_ortfx_tracked"] = None  # the device may have changed: track again
        if before != after:
            self._ortfx_invalidate("parameters or buffers changed dtype (.to()/.half()/...)")
        return self

    def extra_repr(self) -> str:
        return f"exporter={self._ortfx_exporter!r}"

    # ---- state ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _ortfx_muted(self) -> Iterator[None]:
        """The registration hooks stay quiet: the caller bumps the version once itself."""
        own = self.__dict__
        before = own["_ortfx_muted_hooks"]
        own["_ortfx_muted_hooks"] = True
        try:
            yield
        finally:
            own["_ortfx_muted_hooks"] = before

    def _ortfx_invalidate(self, cause: str) -> None:
        self.__dict__["_ortfx_tracked"] = None
        self.__dict__["_ortfx_state"] = bump_module_version(self._ortfx_state, cause)

    def _ortfx_tracked_now(self) -> Tracked:
        tracked: Tracked | None = self._ortfx_tracked
        if tracked is not None and tracked.replaced():
            self._ortfx_invalidate("the parameters were replaced outside the wrapper")
            tracked = None
        if tracked is None or (tracked.params and tracked.params[0].device != tracked.device):
            tracked = _track(self.module)
            self.__dict__["_ortfx_tracked"] = tracked
            self.__dict__["_ortfx_watched"] = frozenset(map(id, self.module.modules()))
        return tracked

    # ---- the call -------------------------------------------------------------------------

    def _ortfx_forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._ortfx_state
        if state.fallbacks:
            key = _ALWAYS if state.fallbacks[0][0] is _ALWAYS else _fallback_key(args, kwargs)
            reason = state.fallback_reason(key)
            if reason is None and not self._ortfx_options.fallback_retry:
                reason = state.fallbacks[-1][1]
            if reason is not None:
                self.__dict__["_ortfx_state"] = note_fallback_call(state, reason)
                return self.module(*args, **kwargs)
        try:
            return self._ortfx_run(args, kwargs)
        except OrtfxError as error:
            self._ortfx_fall_back(error, key=_fallback_key(args, kwargs))
            return self.module(*args, **kwargs)

    def _ortfx_fall_back(
        self, error: OrtfxError, *, key: Hashable, retry: bool = True, during_call: bool = True
    ) -> None:
        """Start running calls like this one in PyTorch, if the policy allows; else raise."""
        flag = next(f for t, f in _FALLBACK_FLAGS if isinstance(error, t))
        options = self._ortfx_options
        if not options.fallback_policy.allows(flag):
            raise error
        reason = f"{type(error).__name__}: {str(error).rstrip('.')}"
        later = (
            "a call with a new input schema will try ONNX Runtime again"
            if retry and options.fallback_retry
            else "every later call runs in PyTorch"
        )
        self._ortfx_log.log(
            logging.WARNING,
            "falling back to PyTorch (policy %s allows it): %s. %s; to make this an error, "
            "pass Options(fallback_policy=ortfx.FallbackPolicy.DISABLE) or set "
            "ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE.",
            flag.name,
            reason,
            later[0].upper() + later[1:],
        )
        self.__dict__["_ortfx_state"] = start_fallback(
            self._ortfx_state, key, reason, during_call=during_call
        )

    def _ortfx_run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves, spec = io.flatten(io.call_tree(args, kwargs))
        tracked = self._ortfx_tracked_now()
        state: ExportState[Compiled] = self._ortfx_state
        last = self._ortfx_last
        if last is not None and not self._ortfx_dynamic:
            # Steady state: the same kind of call as the last one, whose entry is still the
            # most recent. A plain-tuple signature stands in for schema, Call and decide.
            fast = _signature(spec, leaves, self.module.training, state, tracked)
            if fast == last[0] and state.entries and state.entries[-1].key is last[1].key:
                return self._ortfx_execute(
                    args, kwargs, leaves, tracked, last[1], last[2], state, count_reuse(state)
                )
        return self._ortfx_run_slow(args, kwargs, leaves, spec, tracked, state)

    def _ortfx_run_slow(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        spec: optree.PyTreeSpec,
        tracked: Tracked,
        state: ExportState[Compiled],
    ) -> Any:
        io.check_leaves(leaves, spec, root="call", where="input")
        # ZeRO-3 partitioned parameters need ortfx's hooks (issue 16); imported late: no cycle.
        from ortfx.hooks.zero3 import check_partitioned

        check_partitioned(self, tracked.named_tensors)
        tensorized: tuple[int, ...] = ()
        if self._ortfx_dynamic:
            raw = leaves
            leaves = tensorize_scalars(leaves, spec, paths=self._ortfx_dynamic)
            if self._ortfx_static:
                # Leaves found baked in stay Python values (see _baked_dynamic_scalars).
                paths = io.leaf_paths(spec, root="call")
                leaves = [
                    raw[i] if paths[i] in self._ortfx_static else leaf
                    for i, leaf in enumerate(leaves)
                ]
            tensorized = tuple(
                i for i, (a, b) in enumerate(zip(raw, leaves, strict=True)) if a is not b
            )
        schema = ModelSchema.from_flat(leaves, spec)
        _check_input_devices(leaves, schema, tracked.device)
        params_rg = tuple(p.requires_grad for p in tracked.params)
        deterministic = torch.are_deterministic_algorithms_enabled()
        call = Call(
            ExportKey(
                schema,
                # The user module's own flag: model.module.eval() must take effect too.
                self.module.training,
                state.module_version,
                self._ortfx_options.export_options(self._ortfx_exporter),
                VERSIONS,
            ),
            GradState(
                schema.requires_grad,
                params_rg,
                tracked.param_names,
                (self._ortfx_options.memory_opt_level, self._ortfx_options.memory_opt_config),
            ),
            SessionKey(str(tracked.device), deterministic),
        )
        decision = decide(state, call)
        if isinstance(decision, Reuse):
            entry = state.lookup(call.key)
            assert entry is not None
            compiled = entry.payload
        else:
            compiled = self._ortfx_realize(decision, state, call, leaves, args, kwargs)
            baked = _baked_dynamic_scalars(compiled.info, schema, tensorized)
            if baked:
                # The module turned these tensors back into Python values (range(n), if n):
                # the graph holds the export-time value. Correctness first: make them static.
                self._ortfx_log.log(
                    logging.WARNING,
                    "%s %s in dynamic_scalars, but the exported graph does not read %s as a "
                    "tensor: the module turns the value into a Python value (e.g. range(n), "
                    "if n > 0), which the tracer bakes in. ortfx treats %s as static from now "
                    "on; remove %s from Options.dynamic_scalars",
                    ", ".join(baked),
                    "is" if len(baked) == 1 else "are",
                    "it" if len(baked) == 1 else "them",
                    "it" if len(baked) == 1 else "them",
                    "it" if len(baked) == 1 else "them",
                )
                self.__dict__["_ortfx_static"] = self._ortfx_static | set(baked)
                return self._ortfx_run(args, kwargs)
        new_state = apply(state, call, decision, compiled)
        if not compiled.fingerprint:
            compiled.fingerprint = tracked.fingerprint()
        result = self._ortfx_execute(
            args, kwargs, leaves, tracked, call, compiled, state, new_state
        )
        if not self._ortfx_dynamic and self._ortfx_state.entries[-1].key is call.key:
            fast = _signature(spec, leaves, call.key.training, state, tracked)
            self.__dict__["_ortfx_last"] = (fast, call, compiled)
        return result

    def _ortfx_execute(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        tracked: Tracked,
        call: Call,
        compiled: Compiled,
        state: ExportState[Compiled],
        new_state: ExportState[Compiled],
    ) -> Any:
        """Run ORT for a decided call, then swap in ``new_state``."""
        inputs = compiled.info.construct_inputs_flat(leaves, tracked.named_tensors)
        needs_grad = torch.is_grad_enabled() and (any(call.grad.inputs) or any(call.grad.params))
        new_session = (compiled.training if needs_grad else compiled.inference) is None
        try:
            if needs_grad:
                if compiled.training is None:
                    compiled.dims = _input_dims(compiled.info, leaves)
                runner = self._ortfx_training_runner(compiled, tracked.device, call)
                outputs = RunORT.apply(runner, *inputs)  # type: ignore[no-untyped-call]
            else:
                outputs = self._ortfx_inference_runner(compiled, tracked.device, call).run(inputs)
        except OrtfxRuntimeError as error:
            self.__dict__["_ortfx_last"] = None
            changed = _changed_tensor(compiled.fingerprint, _track(self.module).fingerprint())
            if changed is not None:
                # e.g. model.block.double() done on an inner module: ORT rejects the new dtype.
                self._ortfx_invalidate(changed)
                return self._ortfx_run(args, kwargs)
            if not (compiled.ran and call.key.options.exporter == "torchscript"):
                raise
            # The graph ran before on other sizes: the tracer baked a size in. The dynamo
            # exporter keeps sizes symbolic; switching re-exports (the log says why).
            self._ortfx_log.log(
                logging.WARNING,
                "the torchscript graph cannot run these input sizes (%s); switching this "
                "module to the dynamo exporter, which keeps sizes symbolic",
                error,
            )
            self.__dict__["_ortfx_exporter"] = "dynamo"
            return self._ortfx_run(args, kwargs)
        compiled.ran = True
        self.__dict__["_ortfx_state"] = note_session(new_state) if new_session else new_state
        for path in sorted(new_state.warned - state.warned):
            warnings.warn(
                REPEATED_REEXPORT.format(path=path, count=dict(new_state.streaks)[path]),
                OrtfxWarning,
                stacklevel=_user_stacklevel(),
            )
        return compiled.info.restore_outputs(outputs)

    def _ortfx_save_prefix(self) -> str | None:
        options = self._ortfx_options
        if not options.save_onnx:
            return None
        return os.path.join(options.save_path or os.getcwd(), options.onnx_prefix)

    def _ortfx_training_runner(
        self, compiled: Compiled, device: torch.device, call: Call
    ) -> TrainingRunner:
        if compiled.training is not None:
            return compiled.training
        options = self._ortfx_options
        level = options.memory_opt_level
        plans = memory.parse_config(options.memory_opt_config) if level == 0 else ()
        info = passes.seed_dropouts(torch.initial_seed())(compiled.info)
        if level or plans:
            info = with_symbolic_shapes(info)

        def build(plans_on: tuple[str, ...] | None, probe: str) -> TrainingRunner:
            with captured(self._ortfx_log, "the gradient build and session creation"):
                return TrainingRunner(
                    info,
                    device,
                    options,
                    deterministic=call.session.deterministic,
                    save_prefix=self._ortfx_save_prefix(),
                    memory=None if plans_on is None else (probe, plans_on),
                )

        runner = build(None, "1:0")
        if level or plans:
            # Discover the plans of this graph, choose per level (or the user's), rebuild.
            probe = "1:1" if level else "1:0"
            discovered = runner.memory_stat(probe)
            enabled = memory.select(discovered, level, plans)
            if enabled:
                runner = build(enabled, probe)
            compiled.memory = memory.report(discovered, enabled, compiled.dims)
            self._ortfx_log_memory(compiled.memory, discovered, plans)
        compiled.training = runner
        if runner.compute_optimizer_failure:
            self._ortfx_log.log(
                logging.WARNING,
                "ONNX Runtime's compute optimizer failed on this graph (%s); the gradient graph "
                "was built without it. Options(enable_compute_optimizer=False) or "
                "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=0 skips the failing attempt",
                runner.compute_optimizer_failure,
            )
        self._ortfx_log_runner("training", compiled, runner, call)
        return runner

    def _ortfx_log_checkpoint(self, calls: int) -> None:
        level = self._ortfx_options.memory_opt_level
        if level:
            self._ortfx_log.log(
                logging.INFO,
                "the module calls torch.utils.checkpoint %d time(s); ortfx exports the "
                "checkpointed functions as plain code and memory_opt_level %d recomputes "
                "layer-wise inside ONNX Runtime instead",
                calls,
                level,
            )
        else:
            self._ortfx_log.log(
                logging.WARNING,
                "the module calls torch.utils.checkpoint %d time(s); ortfx exports the "
                "checkpointed functions as plain code, so at memory_opt_level 0 their "
                "activations are kept like any others (no recompute). For layer-wise recompute "
                "inside ONNX Runtime pass Options(memory_opt_level=1) or set "
                "ORTMODULE_MEMORY_OPT_LEVEL=1",
                calls,
            )

    def _ortfx_log_memory(
        self,
        rows: tuple[MemoryPlan, ...],
        discovered: Mapping[str, tuple[str, int]],
        plans: tuple[memory.Plan, ...],
    ) -> None:
        options, log = self._ortfx_options, self._ortfx_log
        if (
            options.memory_opt_level
            and options.memory_opt_config
            and not self.__dict__.get("_ortfx_said_ignored")
        ):
            self.__dict__["_ortfx_said_ignored"] = True
            log.log(
                logging.WARNING,
                "memory_opt_level %d turns on every layer-wise plan itself and ignores "
                "memory_opt_config %r; use level 0 to apply only the listed plans",
                options.memory_opt_level,
                options.memory_opt_config,
            )
        found = {c.split(",")[0].rsplit(":", 2)[0] for c in discovered}
        for plan in plans:
            if plan.cluster not in found:
                log.log(
                    logging.WARNING,
                    "memory optimizer plan %s matches nothing in this graph; its plans are: %s",
                    plan,
                    ", ".join(sorted(discovered)) or "none",
                )
        log.log(logging.INFO, "%s", memory.render(rows, options.memory_opt_level))

    def _ortfx_memory_report(self) -> tuple[MemoryPlan, ...]:
        """The recompute plans of the most recent training graph (discovered on demand)."""
        for entry in reversed(self._ortfx_state.entries):
            compiled = entry.payload
            if compiled.training is None:
                continue
            if compiled.memory is None:
                info = with_symbolic_shapes(compiled.info)
                probe = TrainingRunner(
                    info,
                    torch.device(entry.session.device),
                    self._ortfx_options,
                    deterministic=entry.session.deterministic,
                )
                compiled.memory = memory.report(probe.memory_stat("1:0"), (), compiled.dims)
            return compiled.memory
        raise RuntimeError(
            "ortfx.memory_report: this model has not run a training step through ONNX Runtime "
            "yet; call it after the first forward with gradients."
        )

    def _ortfx_inference_runner(
        self, compiled: Compiled, device: torch.device, call: Call
    ) -> InferenceRunner:
        if compiled.inference is None:
            with captured(self._ortfx_log, "the session creation"):
                compiled.inference = InferenceRunner(
                    passes.seed_dropouts(torch.initial_seed())(compiled.info),
                    device,
                    self._ortfx_options,
                    deterministic=call.session.deterministic,
                    save_prefix=self._ortfx_save_prefix(),
                )
            self._ortfx_log_runner("inference", compiled, compiled.inference, call)
        return compiled.inference

    def _ortfx_realize(
        self,
        decision: Decision,
        state: ExportState[Compiled],
        call: Call,
        leaves: list[Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Compiled:
        """Do the effectful part of a transition; the old state stays valid if this raises."""
        grad = call.grad
        marks = passes.with_grad_requirements(
            frozenset(i for i, rg in enumerate(grad.inputs) if rg),
            frozenset(n for n, rg in zip(grad.param_names, grad.params, strict=True) if rg),
        )
        if isinstance(decision, Reexport):
            # Bind first: a wrong call raises the same TypeError PyTorch would, before export.
            inspect.signature(self.module.forward).bind(*args, **kwargs)
            source = self.module
            if self._ortfx_options.deepcopy_before_export:
                source = copy.deepcopy(source)
            # Muted: a forward that reassigns a buffer while traced is not a module change.
            with self._ortfx_muted(), captured(self._ortfx_log, "the ONNX export"):
                exported = export(source, leaves, call.key.schema, call.key.options)
            raw, seconds = exported.info, exported.seconds
            if exported.checkpoint_calls:
                self._ortfx_log_checkpoint(exported.checkpoint_calls)
            if exported.tracer_warnings:
                # Python values computed from tensors are constants of the graph. That is fine
                # for sizes the graph never sees change, wrong for values fed as dynamic scalars.
                self._ortfx_log.log(
                    logging.WARNING if self._ortfx_dynamic else logging.INFO,
                    "the tracer baked %d Python value(s) computed from tensors into the graph, "
                    "first: %s. If such a value changes from call to call (a dynamic scalar "
                    "used in Python control flow, an int taken from a size), the graph is wrong "
                    "for other values: keep it a static argument instead",
                    len(exported.tracer_warnings),
                    exported.tracer_warnings[0],
                )
            process = passes.after_export(_embedding_padding(self.module))
            info = marks(process(attrs.evolve(raw, dynamic_scalars=self._ortfx_dynamic)))
            prefix = self._ortfx_save_prefix()
            if prefix:
                mode = "training" if call.key.training else "inference"
                for stage, model in (("torch_exported", raw.model), ("post_processed", info.model)):
                    with open(f"{prefix}_{stage}_{mode}.onnx", "wb") as f:
                        f.write(model)
            compiled = Compiled(info, Timings(export=seconds))
        else:
            entry = state.lookup(call.key)
            assert entry is not None
            info = (
                marks(entry.payload.info) if isinstance(decision, Reprocess) else entry.payload.info
            )
            compiled = Compiled(info, Timings())
        assert not isinstance(decision, Reuse)
        first = state.stats.exports == 0 and isinstance(decision, Reexport)
        kind = decision_name(decision, first=first)
        line = str(Transition(state.stats.calls, kind, decision.reasons))
        cost = f" [{compiled.timings.render()}]" if compiled.timings.export else ""
        self._ortfx_log.log(logging.INFO, "%s%s", line, cost)
        return compiled

    def _ortfx_log_runner(
        self,
        kind: str,
        compiled: Compiled,
        runner: TrainingRunner | InferenceRunner,
        call: Call,
    ) -> None:
        log = self._ortfx_log
        if not log.enabled(logging.INFO):
            return
        timings = attrs.evolve(
            compiled.timings,
            gradient_build=runner.gradient_build_seconds,
            session=runner.session_seconds,
        )
        log.log(logging.INFO, "%s session ready [one-time cost: %s]", kind, timings.render())
        log.log(
            logging.INFO,
            "%s",
            feature_table(
                self._ortfx_options,
                call.key.options.exporter,
                deterministic=call.session.deterministic,
            ),
        )


def _signature(
    spec: optree.PyTreeSpec,
    leaves: list[Any],
    training: bool,
    state: ExportState[Compiled],
    tracked: Tracked,
) -> tuple[Any, ...]:
    """A plain-tuple stand-in for everything the slow path keys on (schema, mode, module
    version, grad flags, determinism, device), for the steady-state fast path.

    Floats compare by repr (0.0 vs -0.0); anything else unusual just misses the fast path.
    Options are not in it: ``configure`` clears the cached signature.
    """
    kinds = tuple(
        (x.dtype, x.dim(), x.requires_grad, x.device)
        if isinstance(x, torch.Tensor)
        else (type(x), repr(x) if type(x) is float else x)
        for x in leaves
    )
    return (
        spec,
        kinds,
        training,
        state.module_version.number,
        tuple(p.requires_grad for p in tracked.params),
        torch.are_deterministic_algorithms_enabled(),
        tracked.device,
    )


def _baked_dynamic_scalars(
    info: PostExportProcessedModelInfo, schema: ModelSchema, tensorized: tuple[int, ...]
) -> list[str]:
    """Paths of scalars fed as tensors that the graph does not consume: their value was
    turned back into a Python value while traced, and so baked in."""
    if not tensorized:
        return []
    model = onnx.load_model_from_string(info.model)
    consumed = {name for node in model.graph.node for name in node.input}
    fed = {spec.source: spec.name for spec in info.inputs if spec.kind is InputKind.USER}
    return [schema.paths[i] for i in tensorized if fed.get(i) not in consumed]


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside ortfx and torch."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


_INTERNAL_DIRS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    os.path.dirname(os.path.abspath(torch.__file__)),
)


def _changed_tensor(
    built: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...],
    now: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...],
) -> str | None:
    """A cause for the log if a parameter or buffer changed dtype or shape since the build."""
    before = {name: (dtype, shape) for name, dtype, shape in built}
    for name, dtype, shape in now:
        if name in before and before[name] != (dtype, shape):
            was_dtype, was_shape = before[name]
            return (
                f"{name!r} changed from {str(was_dtype).removeprefix('torch.')}{list(was_shape)} "
                f"to {str(dtype).removeprefix('torch.')}{list(shape)} outside the wrapper"
            )
    if {n for n, _, _ in now} != set(before):
        return "the parameters or buffers changed outside the wrapper"
    return None


def _input_dims(info: PostExportProcessedModelInfo, leaves: list[Any]) -> dict[str, int]:
    """Each user input's dim names (as exported: ``{name}_dim{d}``) with their current sizes."""
    return {
        f"{spec.name}_dim{d}": size
        for spec in info.inputs
        if spec.kind is InputKind.USER
        for d, size in enumerate(leaves[spec.source].shape)  # type: ignore[index]
    }


def _embedding_padding(module: torch.nn.Module) -> dict[str, int]:
    """Parameter name -> padding_idx of every nn.Embedding that has one."""
    names = {id(p): n for n, p in module.named_parameters()}
    return {
        names[id(m.weight)]: m.padding_idx
        for m in module.modules()
        if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None
    }


def _check_input_devices(leaves: list[Any], schema: ModelSchema, device: torch.device) -> None:
    for i, spec in enumerate(schema.leaves):
        if isinstance(spec, TensorSpec) and leaves[i].device != device:
            raise OrtfxDeviceError(
                INPUT_ON_OTHER_DEVICE.format(
                    path=schema.paths[i], given=str(leaves[i].device), expected=str(device)
                )
            )


def _user_methods(cls: type) -> list[tuple[str, Callable[..., Any]]]:
    """Plain functions the user's classes define, except forward and anything that overrides
    the nn.Module API (e.g. transformers' ``train``/``eval``): those stay the wrapper's."""
    reserved = set(dir(torch.nn.Module)) | set(vars(ORTModule))
    found: dict[str, Callable[..., Any]] = {}
    for klass in reversed(cls.__mro__):
        if klass in torch.nn.Module.__mro__ or klass.__module__.startswith("torch."):
            continue
        for name, value in vars(klass).items():
            if inspect.isfunction(value) and name not in reserved and not name.startswith("__"):
                found[name] = value
    return sorted(found.items())


_LIVE: weakref.WeakSet[ORTModule] = weakref.WeakSet()
_HOOKS: list[Any] = []


def _on_registration(module: torch.nn.Module, name: str, value: Any) -> None:
    """Invalidate the graphs of every wrapper whose module tree contains ``module``: a
    parameter, buffer or submodule was added or replaced, even directly on an inner module."""
    for wrapper in list(_LIVE):
        own = wrapper.__dict__
        if own.get("_ortfx_muted_hooks") or id(module) not in own.get("_ortfx_watched", ()):
            continue
        kind = type(value).__name__ if value is not None else "None"
        wrapper._ortfx_invalidate(f"{name!r} of {type(module).__name__} set to a {kind}")


def _watch(wrapper: ORTModule) -> None:
    # One set of global hooks for the process, registered once and never removed: removing
    # hooks from a finalizer can run while torch iterates over them.
    if not _HOOKS:
        from torch.nn.modules import module as torch_module

        _HOOKS.extend(
            (
                torch_module.register_module_parameter_registration_hook(_on_registration),
                torch_module.register_module_buffer_registration_hook(_on_registration),
                torch_module.register_module_module_registration_hook(_on_registration),
            )
        )
    wrapper.__dict__["_ortfx_watched"] = frozenset(map(id, wrapper.module.modules()))
    _LIVE.add(wrapper)


def stats(model: torch.nn.Module) -> Stats:
    """Counters of ``model`` (an ``ORTModule``): calls, exports, re-processes, sessions, hits."""
    return _wrapper(model)._ortfx_state.stats


def explain(model: torch.nn.Module) -> tuple[Transition, ...]:
    """Every transition so far (exports, re-processes, new sessions) with its reasons."""
    return _wrapper(model)._ortfx_state.history


def memory_report(model: torch.nn.Module) -> tuple[MemoryPlan, ...]:
    """The memory optimizer's recompute plans for ``model``'s current training graph: cluster,
    ON/OFF, the config string that enables it, frequency and estimated bytes saved per step."""
    return _wrapper(model)._ortfx_memory_report()


def configure(model: torch.nn.Module, **changes: Any) -> None:
    """Change options of a live wrapper, e.g. ``ortfx.configure(model, memory_opt_level=1)``.

    Options that change the exported graph re-export; memory optimizer options re-process;
    invalid values raise and leave the wrapper as it was.
    """
    wrapper = _wrapper(model)
    known = {f.name for f in attrs.fields(Options)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(
            f"ortfx.configure got unknown option(s) {', '.join(map(repr, unknown))}; "
            f"valid options are {', '.join(sorted(known))} (see docs/options.md)."
        )
    options = attrs.evolve(wrapper._ortfx_options, **changes)
    own = wrapper.__dict__
    own["_ortfx_options"] = options
    own["_ortfx_exporter"] = resolve_exporter(options.exporter)
    own["_ortfx_dynamic"] = frozenset(options.dynamic_scalars)
    own["_ortfx_log"] = WrapperLog(options.log_level)
    own["_ortfx_last"] = None  # options are not part of the fast-path signature
    state = wrapper._ortfx_state
    if state.maxsize != options.cache_size:
        entries = state.entries[-options.cache_size :]
        own["_ortfx_state"] = attrs.evolve(state, maxsize=options.cache_size, entries=entries)


def invalidate(model: torch.nn.Module, reason: str = "ortfx.invalidate() was called") -> None:
    """Force a re-export on the next call, after changing an inner module's plain attributes
    directly (``model.block.scale = 2``), which ortfx cannot see cheaply."""
    _wrapper(model)._ortfx_invalidate(reason)


def _wrapper(model: torch.nn.Module) -> ORTModule:
    if not isinstance(model, ORTModule):
        raise TypeError(
            f"expected an ortfx.ORTModule, got {type(model).__qualname__}; "
            "wrap the model first: model = ortfx.ORTModule(model)."
        )
    return model
