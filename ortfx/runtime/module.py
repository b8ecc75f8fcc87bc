"""``ORTModule``: the drop-in ``nn.Module`` façade (its public functions: :mod:`ortfx.runtime.api`).

The façade holds one frozen :class:`~ortfx.runtime.shell.Shell` in its ``_ortfx`` slot and
replaces it whole: each forward hands it to :func:`ortfx.runtime.shell.call` and commits the
shell that comes back (or the one a failed call carries). Everything else here is delegation of
the ``nn.Module`` API to the wrapped module, pickling, and the user's own methods.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch

from ortfx import _torch, io
from ortfx.errors import (
    ALREADY_WRAPPED,
    BAD_DEBUG_OPTIONS,
    DATA_PARALLEL,
    NOT_A_MODULE,
    OrtfxError,
    OrtfxInitError,
    OrtfxTorchModelError,
)
from ortfx.options import DebugOptions, Options
from ortfx.runtime import shell as engine
from ortfx.runtime import state_dicts, watch, wrapper_classes
from ortfx.runtime.ort import require_ort

# Names that live on the wrapper itself; everything else is forwarded to the user's module.
_OWN = frozenset({"training", state_dicts.INNER, "_ortfx"})

# Read from the model's instance dict (``model.__dict__.get(...)``), not through getattr: PEFT
# takes ``name_or_path`` for adapter_config.json's ``base_model_name_or_path`` (and
# AutoPeftModel loads the base from it). The wrapper keeps a copy in its own ``__dict__`` for
# such readers, taken when wrapping and when set through the wrapper; attribute reads go to
# the module (a class-level property wins over the copy).
_INSTANCE_DICT_READS = ("name_or_path",)

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
    ``ORTModule(m)`` is an instance of a subclass made once per class of ``m``, which carries
    ``m``'s forward signature and methods (so class-level lookups such as transformers'
    decoding methods find them, and no bound method makes a reference cycle).
    """

    _ortfx: engine.Shell  # the one engine slot, replaced whole by _ortfx_commit

    def __new__(cls, module: Any = None, *args: Any, **kwargs: Any) -> ORTModule:
        if (
            cls is ORTModule
            and isinstance(module, torch.nn.Module)
            and not isinstance(module, ORTModule)
        ):
            cls = wrapper_class(type(module))
        instance: ORTModule = super().__new__(cls)
        return instance

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
            raise TypeError(BAD_DEBUG_OPTIONS.format(type_name=type(debug_options).__name__))
        if isinstance(module, ORTModule):
            raise OrtfxTorchModelError(ALREADY_WRAPPED)
        resolved = options if options is not None else Options()
        if debug_options is not None:
            resolved = debug_options.apply(resolved)
        resolved = Options.from_env(resolved)  # the environment wins, as upstream
        super().__init__()
        torch.nn.Module.__setattr__(self, state_dicts.INNER, module)
        self.register_load_state_dict_post_hook(state_dicts.unnest)  # type: ignore[no-untyped-call]
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
            error = unsupported
            self._ortfx_update(
                lambda shell: engine.fall_back(
                    shell, error, key=engine.ALWAYS, retry=False, during_call=False
                )
            )

    # inspect (help(), IDEs, docs) reads __new__ first: show the constructor's parameters, not
    # the (module=None, *args, **kwargs) that __new__ takes to pick the per-class subclass.
    __new__.__signature__ = inspect.signature(__init__).replace(  # type: ignore[attr-defined]
        return_annotation=inspect.Signature.empty
    )

    # isinstance() answers as for the wrapped module: Python falls back to ``__class__`` when
    # the type itself is no subclass, as it does for proxies (unittest.mock's spec). Libraries
    # dispatch on the model's class (the Trainer on PreTrainedModel and PeftModel for saving,
    # loading and the forward signature, PEFT's auto_mapping names it) and would otherwise
    # treat the wrapper as an unknown module. ``type(wrapper)`` stays the wrapper class.
    @property  # type: ignore[misc]
    def __class__(self) -> type:
        module = self.__dict__.get("_modules", {}).get(state_dicts.INNER)
        return type(self) if module is None else type(module)

    def _get_name(self) -> str:
        return "ORTModule"  # repr() names the wrapper, not the class __class__ answers

    @property
    def name_or_path(self) -> Any:
        """The module's own (the copy in the wrapper's ``__dict__`` is for ``__dict__`` readers)."""
        return getattr(self.module, "name_or_path")  # noqa: B009  # the property's own name

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped user module."""
        module: torch.nn.Module = self._modules[state_dicts.INNER]  # type: ignore[assignment]
        return module

    @property
    def training(self) -> bool:
        """The wrapped module's own flag: one flag, so nothing (``parent.apply(fn)``,
        ``wrapped.module.eval()``) can make the wrapper and its module disagree."""
        module = self.__dict__.get("_modules", {}).get(state_dicts.INNER)
        return True if module is None else bool(module.training)

    @training.setter
    def training(self, mode: bool) -> None:
        module = self.__dict__.get("_modules", {}).get(state_dicts.INNER)
        if module is not None:  # None while nn.Module.__init__ runs
            module.training = mode

    # ---- the engine slot -------------------------------------------------------------------

    def _ortfx_mirror(self) -> None:
        """Copy the attributes read through ``__dict__`` (_INSTANCE_DICT_READS)."""
        for name in _INSTANCE_DICT_READS:
            value = vars(self.module).get(name, _ABSENT)
            if value is _ABSENT:
                self.__dict__.pop(name, None)
            else:
                self.__dict__[name] = value

    def _ortfx_setup(self, options: Options) -> None:
        self._ortfx_mirror()
        shell = engine.Shell.create(options)
        self.__dict__["_ortfx"] = attrs.evolve(shell, watched=watch.module_ids(self.module))
        watch.watch(self)

    def _ortfx_commit(self, shell: engine.Shell, *, base: engine.Shell) -> None:
        """Store ``shell``, the result of work that started from ``base``: compare and swap.
        Another commit made meanwhile (an invalidation from a registration hook firing inside
        the call, ``configure`` from another thread) is not overwritten: the result is rebased
        onto it (:func:`ortfx.runtime.shell.rebase`)."""
        with _COMMIT_LOCK:
            current = self.__dict__["_ortfx"]
            if current is not base:
                shell = engine.rebase(shell, base=base, current=current)
            self.__dict__["_ortfx"] = shell

    def _ortfx_update(self, change: Callable[[engine.Shell], engine.Shell]) -> None:
        """Replace the record by ``change(record)``, read and written under the commit lock
        (``change`` is quick and pure)."""
        with _COMMIT_LOCK:
            self.__dict__["_ortfx"] = change(self.__dict__["_ortfx"])

    def _ortfx_watches(self, module_id: int) -> bool:
        return module_id in self._ortfx.watched

    def _ortfx_invalidate(self, cause: str) -> None:
        self._ortfx_update(lambda shell: engine.invalidate(shell, cause))

    def _ortfx_forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Under torch.compile: ortfx's call runs as it is, a graph break (Dynamo would
            # trace ortfx's bookkeeping). Dynamo is imported by then; importing it here only
            # then keeps it (and its torch.manual_seed wrapper, its memory) out otherwise.
            return _torch.opaque_to_dynamo(ORTModule._ortfx_call)(self, *args, **kwargs)
        return self._ortfx_call(*args, **kwargs)

    def _ortfx_call(self, *args: Any, **kwargs: Any) -> Any:
        failed: engine.CallFailed | None = None
        base = self._ortfx
        token = _IN_WRAPPER.set(True)  # the module's own forward from here on (wrapper_classes)
        try:
            # Caches in the call are changed in place, as in PyTorch (see ortfx.io.originals).
            with io.originals(io.call_tree(args, kwargs)):
                result, shell = engine.call(base, self.module, args, kwargs)
        except engine.CallFailed as e:
            failed = e
        finally:
            _IN_WRAPPER.reset(token)
        if failed is not None:
            self._ortfx_commit(failed.shell, base=base)
            raise failed.error  # outside the except block: no "during handling" chain
        self._ortfx_commit(shell, base=base)
        return result

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._ortfx_forward(*args, **kwargs)

    # ---- pickling, copying -----------------------------------------------------------------

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The per-class subclass is not importable by name: rebuild it from the module's class.
        return (_blank, (type(self.module),), self.__getstate__())

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k != "_ortfx"}
        state["_ortfx_pickled"] = self._ortfx.options
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        options = state.pop("_ortfx_pickled")
        self.__dict__.update(state)
        self._ortfx_setup(options)

    # ---- delegation of the nn.Module API ---------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name == state_dicts.INNER:
            return super().__getattr__(name)
        return getattr(self.module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN or name.startswith("_ortfx") or _hook_state(self, name):
            object.__setattr__(self, name, value)
            return
        module = self.module
        registered = (
            isinstance(value, torch.Tensor | torch.nn.Module)
            or name in _torch.own_parameters(module)
            or name in _torch.own_buffers(module)
            or name in _torch.own_modules(module)
        )
        with watch.muted(module):
            setattr(module, name, value)
        if name in _INSTANCE_DICT_READS:
            self._ortfx_mirror()
        if registered:  # a parameter, buffer or submodule: the hooks were muted for it
            self._ortfx_invalidate(f"attribute {name!r} set through the wrapper")
        # A plain value: each call compares what the graphs read (public attributes, and the
        # private ones a trace loaded): an equal value, or one no graph reads, exports nothing.

    def __delattr__(self, name: str) -> None:
        if (
            name in _OWN
            or name.startswith("_ortfx")
            or (_hook_state(self, name) and name in self.__dict__)
        ):
            object.__delattr__(self, name)
            return
        with watch.muted(self.module):
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
        self.module.train(mode)
        return self

    def apply(self, fn: Callable[[torch.nn.Module], None]) -> ORTModule:
        self.module.apply(fn)
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Reached only through a parent's load_state_dict, whose walk goes on into
        # _modules["_original_module"]: name the keys so that it finds them there.
        state_dicts.nest(
            self,
            state_dict,
            prefix,
            assign=bool(local_metadata.get("assign_to_params_buffers")),
            missing=missing_keys,
            errors=error_msgs,
        )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        with watch.muted(self.module):
            result = self.module.load_state_dict(state_dict, strict, assign)
        if assign:  # new tensor objects replace the parameters
            self._ortfx_invalidate(state_dicts.ASSIGNED)
        return result

    def register_buffer(
        self, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        with watch.muted(self.module):
            self.module.register_buffer(name, tensor, persistent)
        self._ortfx_invalidate(f"buffer {name!r} registered through the wrapper")

    def register_parameter(self, name: str, param: torch.nn.Parameter | None) -> None:
        with watch.muted(self.module):
            self.module.register_parameter(name, param)
        self._ortfx_invalidate(f"parameter {name!r} registered through the wrapper")

    def add_module(self, name: str, module: torch.nn.Module | None) -> None:
        with watch.muted(self.module):
            self.module.add_module(name, module)
        self._ortfx_invalidate(f"submodule {name!r} added through the wrapper")

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ORTModule:
        before = [(t.dtype, t.shape) for t in self.module.state_dict().values()]
        self.module._apply(fn, recurse)  # type: ignore[no-untyped-call]
        after = [(t.dtype, t.shape) for t in self.module.state_dict().values()]
        if before != after:
            self._ortfx_invalidate("parameters or buffers changed dtype (.to()/.half()/...)")
        else:  # the device may have changed: track again
            self._ortfx_update(lambda shell: attrs.evolve(shell, tracked=None, fast=None))
        return self

    def extra_repr(self) -> str:
        return f"exporter={self._ortfx.exporter!r}"


_ABSENT = object()

# Commits of every wrapper: each is a few attribute reads and one store.
_COMMIT_LOCK = threading.RLock()

# True while a wrapper runs its module (export, fallback): the module's calls are its own.
_IN_WRAPPER = watch.IN_WRAPPER


# ---- one subclass per wrapped class (ortfx/runtime/wrapper_classes.py) ----------------------


def wrapper_class(cls: type[torch.nn.Module]) -> type[ORTModule]:
    """The ORTModule subclass for modules of class ``cls`` (made once per class)."""
    return wrapper_classes.subclass(cls, ORTModule)


def _blank(cls: type[torch.nn.Module]) -> ORTModule:
    """An uninitialized wrapper of modules of class ``cls`` (for unpickling and copies; pickles
    name this function, so it stays here)."""
    instance: ORTModule = object.__new__(wrapper_class(cls))
    return instance
