"""One ``ORTModule`` subclass per wrapped class: the user's forward signature and methods.

``ORTModule(m)`` is an instance of a subclass made once per class of ``m``. It carries ``m``'s
forward signature (inspect, IDEs, transformers' argument checks) and the user's own methods,
which run with the wrapper as ``self`` so that their ``self(...)`` goes through ORT; a method
calling zero-argument ``super()`` runs on the module instead, with the module's own calls routed
through the wrapper (:func:`on_module`).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ortfx import module_state
from ortfx.runtime import watch

W = TypeVar("W", bound=torch.nn.Module)

_CLASSES: dict[type, type[Any]] = {}
_CLASSES_LOCK = threading.Lock()

# True while a wrapper runs its module (export, fallback): the module's calls are its own.
_IN_WRAPPER = watch.IN_WRAPPER


def subclass(cls: type[torch.nn.Module], base: type[W]) -> type[W]:
    """The subclass of ``base`` (``ORTModule``) for modules of class ``cls``, made once."""
    with _CLASSES_LOCK:
        found = _CLASSES.get(cls)
        if found is None:

            def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
                return self._ortfx_forward(*args, **kwargs)

            user_forward = cls.forward
            forward.__signature__ = inspect.signature(user_forward)  # type: ignore[attr-defined]
            forward.__doc__ = user_forward.__doc__
            namespace: dict[str, Any] = dict(_user_methods(cls, base))
            if _is_peft(cls):
                # PEFT's generate calls the base model's generate, whose steps call the base
                # model itself: route them through the wrapper (the adapters' forward).
                namespace["generate"] = on_module("generate", target=_base_model)
            namespace.update(forward=forward, __module__=base.__module__)
            found = type(base.__name__, (base,), namespace)
            found.__qualname__ = base.__qualname__
            _CLASSES[cls] = found
        return found


def _user_methods(cls: type, base: type) -> list[tuple[str, Callable[..., Any]]]:
    """Plain functions the user's classes define, except forward and anything that overrides
    the nn.Module API (e.g. transformers' ``train``/``eval``): those stay the wrapper's."""
    reserved = set(dir(torch.nn.Module)) | set(vars(base))
    found: dict[str, Callable[..., Any]] = {}
    for klass in reversed(cls.__mro__):
        if klass in torch.nn.Module.__mro__ or klass.__module__.startswith("torch."):
            continue
        for name, value in vars(klass).items():
            if inspect.isfunction(value) and name not in reserved and not name.startswith("__"):
                found[name] = on_module(name) if _uses_super(value) else value
    return sorted(found.items())


def _uses_super(function: Callable[..., Any]) -> bool:
    """Zero-argument ``super()`` needs ``self`` to be an instance of the defining class. Looks
    through decorators that keep ``__wrapped__`` (``functools.wraps``), as transformers' own
    deprecation decorators on ``prepare_inputs_for_generation`` do (Phi-3)."""
    return any(
        "__class__" in getattr(getattr(f, "__code__", None), "co_freevars", ())
        for f in (function, inspect.unwrap(function))
    )


def _is_peft(cls: type) -> bool:
    """A PEFT model class (``PeftModel`` and its task subclasses), known without importing
    peft: its ``get_base_model`` gives the model whose forward ``generate`` steps call."""
    return cls.__module__.startswith("peft.") and callable(getattr(cls, "get_base_model", None))


def _base_model(module: torch.nn.Module) -> torch.nn.Module:
    base: torch.nn.Module = module.get_base_model()  # type: ignore[operator]
    return base


def on_module(
    name: str, *, target: Callable[[torch.nn.Module], torch.nn.Module] = lambda m: m
) -> Callable[..., Any]:
    """A method that runs the user's ``name`` on the wrapped module (for methods that call
    ``super()``, e.g. Whisper's ``generate`` and transformers' ``prepare_inputs_for_generation``
    overrides), with the module's own calls (``self(...)``, ``self.forward(...)``) routed
    through the wrapper, so that they run in ORT as when the wrapper is ``self``. ``target``
    names the module whose calls are routed, when the method calls another module's forward
    (a PEFT model's ``generate`` calls its base model's)."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        called = target(module)
        if _IN_WRAPPER.get() or "forward" in vars(called):  # nested, or the user's attribute
            return getattr(module, name)(*args, **kwargs)
        real = type(called).forward

        def routed(*a: Any, **k: Any) -> Any:
            if _IN_WRAPPER.get():  # the wrapper exporting or falling back: the real forward
                return real(called, *a, **k)
            return self._ortfx_forward(*a, **k)

        setattr(routed, module_state.ROUTED, True)  # ortfx's own, for this call only
        object.__setattr__(called, "forward", routed)  # an instance attribute, for this call
        try:
            return getattr(module, name)(*args, **kwargs)
        finally:
            vars(called).pop("forward", None)

    method.__name__ = method.__qualname__ = name
    return method
