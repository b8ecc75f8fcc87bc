"""Subscribers: actions run from ``nn.Module`` hooks, and the in-graph identity Functions.

How a step is observed, in PyTorch and inside ONNX Runtime alike:

* every module's forward hook routes its output tensors through :class:`_Inspect`, an
  ``autograd.Function`` that is the identity in value and gradient; its forward records the
  tensor's summary and its backward the gradient's. ortfx's export traces the module once, so
  the exported graph holds one ``_Inspect`` per module output, and (with the PythonOp bridge)
  ORT calls its forward and backward in Python at every step: no re-export per step.
* the root module's outputs then go through :class:`_StepEnd`, whose forward advances the step.
  It consumes every output, so inside ORT it runs after every recording that feeds the outputs:
  ORT's node order follows data, and a counter advanced at the start would not be ordered
  before recordings of tensors that do not depend on the inputs.
* an export trace (``torch.jit.is_tracing()`` / ``torch.onnx.is_in_onnx_export()``) routes the
  tensors (so the graph holds the Functions) but records nothing and does not count as a step.

The Functions take one integer constant, the index of a registered :class:`_Site`, so the graph
carries no Python object.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from ortfx import io
from ortfx.errors import OUTPUT_DIR_EXISTS, OrtfxOutputExistsError
from ortfx.hooks.summary import DEFAULT_BUCKET_SIZE, render, summarize


def tracing() -> bool:
    """Whether the forward runs for an export trace rather than for a training step.

    The TorchScript exporter runs the model only under the tracer, and ``torch.export`` (the
    dynamo exporter) under the compiler; ``torch.onnx.is_in_onnx_export()`` adds nothing to
    these two and costs 3 us a call, which every module pays twice per step.
    """
    return bool(
        torch.jit.is_tracing()  # type: ignore[attr-defined,no-untyped-call]
        or torch.compiler.is_compiling()
    )


class RuntimeStates:
    """The state a manager shares with its subscribers (upstream's names, for their code)."""

    class _GlobalStates:
        def __init__(self) -> None:
            # The step now running: the number of completed forwards of the root module.
            self.execution_step = 0
            self.module_index_to_depth: dict[int, int] = {}
            self.module_to_module_index: dict[torch.nn.Module, int] = {}

    def __init__(self) -> None:
        self.global_states = RuntimeStates._GlobalStates()
        # Names recorded in the running step, to tell repeated calls of one module apart.
        self._seen_step = -1
        self._seen: dict[tuple[int, str], int] = {}
        # True between the root's pre-forward and its step end (PyTorch only: see _pre_root).
        self._open = False

    def occurrence_name(self, subscriber: SubscriberBase, name: str) -> str:
        """``name`` the first time it is recorded in this step, ``name_call<k>`` the k-th time."""
        step = self.global_states.execution_step
        if step != self._seen_step:
            self._seen_step, self._seen = step, {}
        key = (id(subscriber), name)
        k = self._seen.get(key, 0)
        self._seen[key] = k + 1
        return name if k == 0 else f"{name}_call{k}"


class SubscriberBase:
    """Actions run from module hooks, for steps in ``[start_step, end_step)``.

    Override the ``*_impl`` methods: module level (``pre_forward_module_apply_impl``,
    ``post_forward_module_apply_impl``, ``post_forward_outmost_module_apply_impl``), tensor level
    in forward (``pre_forward_tensor_apply_impl``, ``post_forward_tensor_apply_impl``, which may
    return a new tensor), and per tensor in forward and backward (``module_post_forward_impl``,
    ``module_pre_backward_impl``, called from inside the graph for tensors routed through
    :meth:`inspect`).

    Under ortfx, Python hooks run only while the module is exported: what they do to tensors is
    baked into the graph. Work that must happen at every step belongs in a Function such as the
    one :meth:`inspect` inserts.
    """

    def __init__(self, start_step: int | None, end_step: int | None) -> None:
        self._start_step: int = start_step if start_step is not None else 0
        self._end_step: int = end_step if end_step is not None else sys.maxsize

    def _need_skip_step(self, current_step: int) -> bool:
        return not self._start_step <= current_step < self._end_step

    def pre_forward_module_apply(
        self, run_rtx: RuntimeStates, module: torch.nn.Module, args: Any, kwargs: Any
    ) -> tuple[Any, Any]:
        if self._need_skip_step(run_rtx.global_states.execution_step):
            return args, kwargs
        return self.pre_forward_module_apply_impl(run_rtx, module, args, kwargs)

    def pre_forward_module_apply_impl(
        self, run_rtx: RuntimeStates, module: torch.nn.Module, args: Any, kwargs: Any
    ) -> tuple[Any, Any]:
        return args, kwargs

    def pre_forward_tensor_apply(
        self, run_rtx: RuntimeStates, module: torch.nn.Module, tensor_index: int, tensor: Any
    ) -> Any:
        if self._need_skip_step(run_rtx.global_states.execution_step):
            return tensor
        return self.pre_forward_tensor_apply_impl(run_rtx, module, tensor_index, tensor)

    def pre_forward_tensor_apply_impl(
        self, run_rtx: RuntimeStates, module: torch.nn.Module, tensor_index: int, tensor: Any
    ) -> Any:
        return tensor

    def post_forward_module_apply(
        self, run_rtx: RuntimeStates, module: torch.nn.Module, args: Any, outputs: Any
    ) -> tuple[Any, Any]:
        if self._need_skip_step(run_rtx.global_states.execution_step):
            return args, outputs
        return self.post_forward_module_apply_impl(run_rtx, module, args, outputs)

    def post_forward_module_apply_impl(
        self, run_rtx: RuntimeStates, module: torch.nn.Module, args: Any, outputs: Any
    ) -> tuple[Any, Any]:
        return args, outputs

    def post_forward_tensor_apply(
        self, run_rtx: RuntimeStates, module: torch.nn.Module, tensor_index: int, tensor: Any
    ) -> Any:
        if self._need_skip_step(run_rtx.global_states.execution_step):
            return tensor
        return self.post_forward_tensor_apply_impl(run_rtx, module, tensor_index, tensor)

    def post_forward_tensor_apply_impl(
        self, run_rtx: RuntimeStates, module: torch.nn.Module, tensor_index: int, tensor: Any
    ) -> Any:
        return tensor

    def post_forward_outmost_module_apply(
        self, run_rtx: RuntimeStates, module: torch.nn.Module, args: Any, outputs: Any
    ) -> tuple[Any, Any]:
        if self._need_skip_step(run_rtx.global_states.execution_step):
            return args, outputs
        return self.post_forward_outmost_module_apply_impl(run_rtx, module, args, outputs)

    def post_forward_outmost_module_apply_impl(
        self, run_rtx: RuntimeStates, module: torch.nn.Module, args: Any, outputs: Any
    ) -> tuple[Any, Any]:
        return args, outputs

    def module_post_forward_impl(
        self, activation: torch.Tensor, depth: int, name: str, step: int
    ) -> None:
        """Called with a routed tensor in forward, for steps in the window."""

    def module_pre_backward_impl(
        self, activation: torch.Tensor, depth: int, name: str, step: int
    ) -> None:
        """Called with the gradient of a routed tensor in backward, for steps in the window."""

    def inspect(
        self, run_rtx: RuntimeStates, name: str, depth: int, tensor: torch.Tensor
    ) -> torch.Tensor:
        """Route ``tensor`` through the in-graph identity that calls ``module_post_forward_impl``
        and ``module_pre_backward_impl``. Outside an export trace and outside the window the
        tensor is returned as is (nothing to record)."""
        if not tracing() and self._need_skip_step(run_rtx.global_states.execution_step):
            return tensor
        out: torch.Tensor = _Inspect.apply(  # type: ignore[no-untyped-call]
            _site(self, run_rtx, name, depth), tensor
        )
        return out


@attrs.frozen(eq=False)
class _Site:
    """What a Function's integer constant stands for."""

    subscriber: SubscriberBase | None  # None: the step end of run_ctx
    run_ctx: RuntimeStates
    name: str
    depth: int


_SITES: list[_Site] = []
_SITE_INDEX: dict[tuple[int, int, str, int], int] = {}


def _site(subscriber: SubscriberBase | None, run_ctx: RuntimeStates, name: str, depth: int) -> int:
    key = (id(subscriber), id(run_ctx), name, depth)
    index = _SITE_INDEX.get(key)
    if index is None:  # _SITES keeps both objects alive, so their ids stay theirs
        index = len(_SITES)
        _SITES.append(_Site(subscriber, run_ctx, name, depth))
        _SITE_INDEX[key] = index
    return index


class _Inspect(torch.autograd.Function):
    """Identity in value and gradient that reports the tensor and its gradient to a subscriber."""

    @staticmethod
    def forward(ctx: Any, site: int, tensor: torch.Tensor) -> torch.Tensor:
        ctx.record = None
        if tracing():
            # Inlined by an exporter without PythonOp support, a returned input becomes
            # aten::view_as, which fails on 0-dim tensors; a clone becomes an Identity.
            return tensor.clone()
        where = _SITES[site]
        sub = where.subscriber
        step = where.run_ctx.global_states.execution_step
        if sub is None or sub._need_skip_step(step):
            return tensor
        name = where.run_ctx.occurrence_name(sub, where.name)
        sub.module_post_forward_impl(tensor, where.depth, name, step)
        ctx.record = (sub, where.depth, name, step)
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, torch.Tensor | None]:
        if ctx.record is not None and grad is not None:
            sub, depth, name, step = ctx.record
            sub.module_pre_backward_impl(grad, depth, name, step)
        return None, grad


class _StepEnd(torch.autograd.Function):
    """Identity over the root's output tensors whose forward ends the step."""

    @staticmethod
    def forward(ctx: Any, site: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if tracing():
            return tuple(t.clone() for t in tensors)  # see _Inspect.forward
        _end_step(_SITES[site].run_ctx)
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return (None, *grads)


def _end_step(run_ctx: RuntimeStates) -> None:
    run_ctx.global_states.execution_step += 1
    run_ctx._open = False


def _map_tensors(tree: Any, fn: Any) -> Any:
    """Apply ``fn(index, tensor)`` to the tensor leaves of ``tree`` (index among tensors)."""
    leaves, spec = io.flatten(tree)
    count = 0
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            leaf = fn(count, leaf)
            count += 1
        out.append(leaf)
    return io.unflatten(spec, out)


def _inner_module(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """(module to hook, the ORTModule wrapping it or None)."""
    from ortfx.runtime.module import ORTModule  # the runtime imports ORT; hooks alone do not

    if isinstance(module, ORTModule):
        return module.module, module
    return module, None


def _reexport(wrapper: torch.nn.Module | None, why: str) -> None:
    """A wrapper that already exported must export again to put the hooks' Functions in."""
    if wrapper is None:
        return
    import ortfx

    if ortfx.stats(wrapper).exports:
        ortfx.invalidate(wrapper, why)


class SubscriberManager:
    """Registers subscribers' actions as hooks on every module of one model."""

    def __init__(self) -> None:
        self._run_ctx = RuntimeStates()
        self._subscribers: list[SubscriberBase] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._wrapper: torch.nn.Module | None = None

    def subscribe(self, module: torch.nn.Module, subscribers: Sequence[SubscriberBase]) -> None:
        """Hook ``subscribers`` (in order) onto ``module`` and its submodules, replacing what this
        manager subscribed before; the step count starts again at 0.

        ``module`` may be a plain ``nn.Module`` or an ``ortfx.ORTModule`` (its inner module is
        hooked, and a wrapper that already exported re-exports on its next call).
        """
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"subscribe expects a torch.nn.Module or ortfx.ORTModule, got "
                f"{type(module).__qualname__}"
            )
        bad = [type(s).__qualname__ for s in subscribers if not isinstance(s, SubscriberBase)]
        if bad:
            raise TypeError(
                f"subscribers must be ortfx.hooks.SubscriberBase instances, got {', '.join(bad)}"
            )
        if not subscribers:
            raise ValueError("subscribe needs at least one subscriber")
        self.unsubscribe()
        self._run_ctx = RuntimeStates()
        self._subscribers = list(subscribers)
        root, self._wrapper = _inner_module(module)
        self._register(root)
        _reexport(self._wrapper, "subscribers were added (ortfx.hooks)")

    def unsubscribe(self) -> None:
        """Remove every hook this manager registered."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._subscribers = []
        wrapper, self._wrapper = self._wrapper, None
        _reexport(wrapper, "subscribers were removed (ortfx.hooks)")

    def get_subscriber(self, subscriber_type: type) -> SubscriberBase:
        for subscriber in self._subscribers:
            if isinstance(subscriber, subscriber_type):
                return subscriber
        raise RuntimeError(f"no subscriber of type {subscriber_type.__qualname__} is subscribed")

    def get_run_context(self) -> RuntimeStates:
        return self._run_ctx

    def _idle(self) -> bool:
        """Nothing to do in this call: not exporting, and every subscriber skips this step."""
        step = self._run_ctx.global_states.execution_step
        return all(s._need_skip_step(step) for s in self._subscribers) and not tracing()

    def _register(self, root: torch.nn.Module) -> None:
        states = self._run_ctx.global_states
        depths: dict[torch.nn.Module, int] = {root: 1}
        for index, mod in enumerate(root.modules()):  # depth-first, each module once
            for child in mod.children():
                depths.setdefault(child, depths[mod] + 1)
            states.module_to_module_index[mod] = index
            states.module_index_to_depth[index] = depths[mod]
        hook_pre = self._handles.append
        hook_pre(root.register_forward_pre_hook(self._pre_root))
        for mod in root.modules():
            hook_pre(mod.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            hook_pre(mod.register_forward_hook(self._post_forward))
        hook_pre(root.register_forward_hook(self._post_root))

    def _pre_root(self, module: torch.nn.Module, args: Any) -> None:
        if tracing():
            return
        if self._run_ctx._open:
            # The previous forward raised before its step ended: end it, so this step's records
            # do not land on top of a half-written one.
            _end_step(self._run_ctx)
        self._run_ctx._open = True

    def _pre_forward(
        self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]
    ) -> tuple[Any, dict[str, Any]] | None:
        if self._idle():
            return None
        ctx = self._run_ctx
        for sub in self._subscribers:
            args, kwargs = sub.pre_forward_module_apply(ctx, module, args, kwargs)
            args, kwargs = _map_tensors(
                (args, kwargs),
                lambda i, t, sub=sub: sub.pre_forward_tensor_apply(ctx, module, i, t),
            )
        return args, kwargs

    def _post_forward(self, module: torch.nn.Module, args: Any, outputs: Any) -> Any:
        if self._idle():
            return None
        ctx = self._run_ctx
        for sub in self._subscribers:
            _, outputs = sub.post_forward_module_apply(ctx, module, args, outputs)
            outputs = _map_tensors(
                outputs, lambda i, t, sub=sub: sub.post_forward_tensor_apply(ctx, module, i, t)
            )
        return outputs

    def _post_root(self, module: torch.nn.Module, args: Any, outputs: Any) -> Any:
        ctx = self._run_ctx
        if not tracing():
            # PyTorch runs this hook at every step: end the step here, no Function needed.
            for sub in self._subscribers:
                args, outputs = sub.post_forward_outmost_module_apply(ctx, module, args, outputs)
            _end_step(ctx)
            return outputs
        # Export trace: put the step end into the graph, after everything feeding the outputs.
        for sub in self._subscribers:
            args, outputs = sub.post_forward_outmost_module_apply(ctx, module, args, outputs)
        leaves, spec = io.flatten(outputs)
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        ended = _StepEnd.apply(  # type: ignore[no-untyped-call]
            _site(None, ctx, "", 0), *(leaves[i] for i in positions)
        )
        for i, t in zip(positions, ended, strict=True):
            leaves[i] = t
        return io.unflatten(spec, leaves)


class StatisticsSubscriber(SubscriberBase):
    """Writes a summary of every module output, and of its gradient, for each step in the window.

    Layout: ``<output_dir>/step_<n>/order.txt`` lists the files of step ``n`` in the order they
    were written; ``<ModuleClass>_<module index>_<i>th_output_forward`` and ``..._backward``
    hold the summary of the module's ``i``-th output tensor and of its gradient.
    ``ortfx.hooks.merge_activation_summary`` merges two such directories and finds the first
    divergence.

    Args:
        output_dir: where to write; it must not exist unless ``override_output_dir``.
        start_step, end_step: steps in ``[start_step, end_step)`` are written (default: all).
        override_output_dir: delete an existing ``output_dir`` first.
        run_on_cpu: copy each tensor to the CPU before summarizing it (saves device memory).
        bucket_size: elements summarized at a time; each bucket is copied to float64.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        start_step: int | None = None,
        end_step: int | None = None,
        override_output_dir: bool = False,
        run_on_cpu: bool = False,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
    ) -> None:
        super().__init__(start_step=start_step, end_step=end_step)
        if bucket_size < 1:
            raise ValueError(
                f"bucket_size must be a positive number of elements, got {bucket_size}"
            )
        self._output_dir = Path(output_dir)
        self._run_on_cpu = run_on_cpu
        self._bucket_size = bucket_size
        if self._output_dir.exists():
            if not override_output_dir:
                raise OrtfxOutputExistsError(
                    OUTPUT_DIR_EXISTS.format(
                        path=str(self._output_dir), fix="pass override_output_dir=True"
                    )
                )
            warnings.warn(
                f"StatisticsSubscriber: deleting the existing {self._output_dir} "
                "(override_output_dir=True)",
                stacklevel=2,
            )
            shutil.rmtree(self._output_dir)
        self._output_dir.mkdir(parents=True)

    @property
    def output_dir(self) -> Path:
        return self._output_dir

    def post_forward_tensor_apply(
        self, run_rtx: RuntimeStates, module: torch.nn.Module, tensor_index: int, tensor: Any
    ) -> Any:
        # Not gated on the step here: during an export trace the Function must enter the graph
        # whatever the step; inspect() gates the PyTorch path itself.
        index = run_rtx.global_states.module_to_module_index[module]
        name = f"{type(module).__name__}_{index}_{tensor_index}th_output"
        return self.inspect(
            run_rtx, name, run_rtx.global_states.module_index_to_depth[index], tensor
        )

    def module_post_forward_impl(
        self, activation: torch.Tensor, depth: int, name: str, step: int
    ) -> None:
        self._write(activation, depth, f"{name}_forward", step)

    def module_pre_backward_impl(
        self, activation: torch.Tensor, depth: int, name: str, step: int
    ) -> None:
        self._write(activation, depth, f"{name}_backward", step)

    def _write(self, tensor: torch.Tensor, depth: int, file_name: str, step: int) -> None:
        if self._run_on_cpu:
            tensor = tensor.detach().cpu()
        text = render(">" * depth + file_name, summarize(tensor, bucket_size=self._bucket_size))
        folder = self._output_dir / f"step_{step}"
        folder.mkdir(exist_ok=True)
        (folder / file_name).write_text(text, encoding="utf-8")
        with (folder / "order.txt").open("a", encoding="utf-8") as order:
            order.write(file_name + "\n")
