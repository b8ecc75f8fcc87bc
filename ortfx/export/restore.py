"""What a forward run once by ortfx (an export, a probe of PyTorch's answer) changes in the
module, put back when the run ends: buffers by value, parameters from copies taken right before
their first write, every module attribute. An attempt that does not end in ORT running the call
then leaves the module exactly as it was, and the fallback's eager run is the only one that
counts.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ortfx import _torch, module_state
from ortfx.errors import OrtfxExportError
from ortfx.export import reads
from ortfx.export.rewrites import user_line


@contextlib.contextmanager
def attributes_preserved(module: torch.nn.Module) -> Iterator[None]:
    """Every module attribute (``__dict__`` entry) of ``module``'s tree is put back when the
    block ends: a run that must leave no trace (a probe of PyTorch's answer)."""
    before = module_state.snapshot(module.modules())
    try:
        yield
    finally:
        module_state.restore(before)


PARAMETER_CHANGED_IN_EXPORT = (
    "the forward of {module} changes parameter {name!r} in place where no tensor operation "
    "shows it (through a view of it, or a kernel that writes it); ortfx ran that forward once "
    "to export it and could not put the parameter back, so the change would be made twice on "
    "this call. Write the parameter itself in place (p.copy_(...), p.mul_(...) under "
    "torch.no_grad(): exported as an update), make the change outside forward (e.g. after "
    "optimizer.step()), or call the module outside ortfx."
)


# Python's in-place operators (``p += x``) and item assignment, beside the ``*_`` methods.
_IN_PLACE_OPERATORS = frozenset(
    {
        "__iadd__",
        "__isub__",
        "__imul__",
        "__itruediv__",
        "__ifloordiv__",
        "__imod__",
        "__ipow__",
        "__iand__",
        "__ior__",
        "__ixor__",
        "__ilshift__",
        "__irshift__",
        "__setitem__",
    }
)
# Methods named like in-place ones that change no values.
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad"})


def _written(func: Any, args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The tensor an op writes in place (``x.add_(...)``, ``x += ...``, ``out=x``), if any."""
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out
    name = getattr(func, "__name__", "")
    if not (args and isinstance(args[0], torch.Tensor)) or name in _NOT_WRITES:
        return None
    if name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("_")):
        return args[0]
    return None


ALIAS_WRITE_REFUSED = (
    "the forward of {module} writes {kind} {name!r} in place through {how} ({where}); the "
    "exporter records such a write on the alias, not on the {kind}, so the graph would not "
    "carry it. Write the {kind} itself (e.g. {kind_var}.mul_(m).add_(x) or {kind_var}.copy_(x) "
    "under torch.no_grad(); indexing it, {kind_var}[i].copy_(x), is followed too), or let "
    "ortfx run the module in PyTorch (the default fallback policy does)."
)


class _Writes(torch.overrides.TorchFunctionMode):
    """The forward's in-place writes into the module's parameters and buffers, op by op.

    Before a parameter's first write it is copied, to be put back (parameters are not copied
    up front: that would double a large model's memory), whether the write goes to the
    parameter or through an alias of it (``.data``, ``detach()``, a view). In an export
    (``refuse``), a write through an alias the tracer does not follow (anything but indexing)
    is refused before it happens: the graph would silently leave it out. Copies are made
    outside the trace."""

    def __init__(
        self,
        module: torch.nn.Module,
        parameters: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        *,
        refuse: bool,
    ) -> None:
        super().__init__()
        self.module = module
        self.refuse = refuse
        # id -> (tensor, kind, name) of each parameter and buffer
        self.roots: dict[int, tuple[torch.Tensor, str, str]] = {}
        for kind, named in (("parameter", parameters), ("buffer", buffers)):
            for name, t in named.items():
                self.roots.setdefault(id(t), (t, kind, name))
        self.saved: dict[int, torch.Tensor] = {}
        # id -> (alias, its root's id, how it was made: None for indexing, which the tracer
        # follows); the alias is kept alive so that its id stays its own.
        self.aliases: dict[int, tuple[torch.Tensor, int, str | None]] = {}

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        target = _written(func, args, kwargs)
        if target is not None:
            root, how = self._root(target)
            if root is not None:
                tensor, kind, name = self.roots[root]
                if how is not None and self.refuse:
                    raise OrtfxExportError(
                        ALIAS_WRITE_REFUSED.format(
                            module=type(self.module).__name__,
                            kind=kind,
                            kind_var="p" if kind == "parameter" else "buf",
                            name=name,
                            how=how,
                            where=user_line(sys._getframe(1)),
                        )
                    )
                if kind == "parameter" and root not in self.saved:
                    self._save(root, tensor)
        # In an export, inside the read watch (which calls ops as eager does, skipping this
        # frame); alone, called as eager here: warnings on the forward's line either way.
        out = func(*args, **kwargs) if self.refuse else reads.call_as_eager(func, args, kwargs)
        if args and isinstance(args[0], torch.Tensor):
            root, how = self._root(args[0])
            if root is not None:
                self._note_aliases(func, root, how, out)
        return out

    def _root(self, t: torch.Tensor) -> tuple[int | None, str | None]:
        if id(t) in self.roots:
            return id(t), None
        alias = self.aliases.get(id(t))
        return (None, None) if alias is None else (alias[1], alias[2])

    def _note_aliases(self, func: Any, root: int, how: str | None, out: Any) -> None:
        """Outputs of ``func`` that share the root's memory become its aliases."""
        name = getattr(func, "__name__", "")
        made = how or (None if name == "__getitem__" else _alias_name(func, name))
        storage = _storage(self.roots[root][0])
        for t in out if isinstance(out, tuple | list) else (out,):
            if (
                isinstance(t, torch.Tensor)
                and id(t) not in self.roots
                and storage is not None
                and _storage(t) == storage
            ):
                self.aliases.setdefault(id(t), (t, root, made))

    def _save(self, root: int, parameter: torch.Tensor) -> None:
        get, put = _torch.tracing_state_access()
        tracing = get()
        put(None)  # not a node of the graph
        try:
            with torch.no_grad():
                self.saved[root] = parameter.detach().clone()
        finally:
            put(tracing)


# Compared with ==: each attribute read makes a new method-wrapper object.
_DATA_GET = torch.Tensor.data.__get__  # type: ignore[attr-defined]


def _alias_name(func: Any, name: str) -> str:
    return ".data" if func == _DATA_GET else f"{name}()"


def _storage(t: torch.Tensor) -> int | None:
    """Where ``t``'s memory starts (None for tensors without one storage, or an empty one)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage.data_ptr() if storage.nbytes() else None


@contextlib.contextmanager
def state_preserved(module: torch.nn.Module, *, exporting: bool = False) -> Iterator[_Writes]:
    """The forward runs once (an export, or a probe of PyTorch's answer): buffers it changes
    (in place, by replacing the tensor, or by a kernel of torch's that moves no version
    counter, as eager BatchNorm's running statistics) are put back by value; a buffer that an
    update under grad gave a ``grad_fn`` becomes the plain tensor it was. Parameters are not
    copied up front (that would double a large model's memory): the :class:`_Writes` watch
    copies one right before the forward first writes it, and it is put back; one changed
    where no op shows it raises. ``exporting``: the watch (yielded) refuses writes through
    aliases the tracer does not follow, and the export enters it inside its read watch
    (``reads.watched(inner=...)``); otherwise it is entered here."""
    buffers = [
        (m, name, t, _torch.version(t), t.detach().clone(), t.requires_grad, t.grad_fn is None)
        for m in module.modules()
        for name, t in _torch.own_buffers(m).items()
        if t is not None
    ]
    params = [
        (m, name, p, _torch.version(p))
        for m in module.modules()
        for name, p in _torch.own_parameters(m).items()
        if p is not None
    ]
    writes = _Writes(
        module,
        dict(module.named_parameters()),
        dict(module.named_buffers()),
        refuse=exporting,
    )
    try:
        with contextlib.nullcontext() if exporting else writes:
            yield writes
    finally:
        with torch.no_grad():
            for m, name, t, seen, saved, requires_grad, leaf in buffers:
                _torch.own_buffers(m)[name] = t
                if _torch.version(t) != seen or not _same_values(t, saved):
                    if leaf and t.grad_fn is not None:
                        t.detach_()  # in place: the module's own object, not a new one
                    t.copy_(saved)
                    t.requires_grad_(requires_grad)
            for m, name, p, _ in params:
                _torch.own_parameters(m)[name] = p
                if id(p) in writes.saved:  # .data writes move no version counter
                    p.copy_(writes.saved[id(p)])
    changed = [
        n for m, n, p, seen in params if _torch.version(p) != seen and id(p) not in writes.saved
    ]
    if changed:
        raise OrtfxExportError(
            PARAMETER_CHANGED_IN_EXPORT.format(module=type(module).__name__, name=changed[0])
        )


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (a NaN never is: such a buffer is copied back, to the same bits)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


reads.TRANSPARENT.add(_Writes.__torch_function__.__code__)
