"""DeepSpeed ZeRO stage 3 for ``ORTModule``: phase 1 gathers every parameter around each step,
phase 2 (``layerwise=True``) each parameter inside the ORT graph, next to its layer.

DeepSpeed gathers a submodule's parameters from that submodule's forward hooks. ONNX Runtime
runs the whole module as one graph, so those hooks never fire. After
:func:`configure_ort_compatible_zero_stage3`, DeepSpeed hooks an ``ORTModule`` as one unit:

* before the wrapper's forward, every partitioned parameter is all-gathered (the same order on
  every rank: by ``ds_id``), so the graph is exported and run with the full shapes
  (``ds_shape``); DeepSpeed's ``F.linear`` (its ZeRO-3 autograd Function, which DeepSpeed
  puts in place process-wide) stays as it is: ortfx's exports write it as a plain linear
  (:mod:`ortfx.export.functions`), and a call that runs in PyTorch uses it as eager would;
* ORT's gradients reach the same ``nn.Parameter`` objects through ``AccumulateGrad`` (the
  parameters are inputs of ortfx's autograd Function), so DeepSpeed's post-accumulate hooks
  reduce-scatter them as in eager training;
* the gathered parameters are released once the backward pass has finished (a callback on the
  autograd engine, after DeepSpeed's own), or right after a forward nothing can backward through.

Optimizer states and gradients stay partitioned; parameter memory does not (see docs/zero3.md).

Phase 2: the wrapper feeds its parameters through memory-efficient gradients' PythonOps, and
its :class:`_Gatherer` is their :class:`~ortfx.runtime.memgrad.Fetcher`: a forward feed gathers
one parameter and leaves ORT the only reference, a backward re-feed gathers it again, and its
gradient node accumulates and releases (graph side: :mod:`ortfx.passes.layerwise`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import attrs
import torch

from ortfx import io
from ortfx._torch import queue_after_backward
from ortfx.errors import OrtfxInitError
from ortfx.options import LogLevel
from ortfx.runtime import memgrad, partitioned
from ortfx.runtime.api import configure
from ortfx.runtime.logs import WrapperLog
from ortfx.runtime.module import ORTModule

DEEPSPEED_MISSING = (
    "ortfx.hooks.configure_ort_compatible_zero_stage3 needs DeepSpeed, which could not be "
    "imported ({error}). Install it: DS_BUILD_OPS=0 pip install 'deepspeed==0.19.8' (on a CPU "
    "machine also set DS_ACCELERATOR=cpu when running)."
)

DEEPSPEED_MOVED = (
    "DeepSpeed {version} has no {name}, which ortfx's ZeRO-3 hooks replace; ortfx supports "
    "DeepSpeed 0.19.x. Install deepspeed==0.19.8 or report the new name."
)


STATS_FILE_EXISTS = (
    "ZeRO-3 statistics file {path!r} exists; pass stats_overwrite=True to "
    "configure_ort_compatible_zero_stage3 to replace it, or choose another stats_output_dir."
)

NOT_INSTALLED = (
    "{type_name} has no ortfx ZeRO-3 hooks; pass the ortfx.ORTModule that "
    "deepspeed.initialize(model=...) was given after configure_ort_compatible_zero_stage3() "
    "(or the engine itself)."
)


@attrs.frozen
class Settings:
    """What :func:`configure_ort_compatible_zero_stage3` was called with."""

    debug: bool = False
    stats_output_dir: str | None = None
    stats_overwrite: bool = False
    layerwise: bool = False


@attrs.frozen
class Zero3Stats:
    """Counters of one wrapper's gather-all protocol (the test and benchmark seam)."""

    forwards: int = 0  # forwards that ran under the protocol
    # Phase 1: all-gathers of every partitioned parameter, and releases of all of them.
    # Phase 2: after the first step, each gather and release is of one parameter.
    gathers: int = 0
    releases: int = 0
    gathered_elements: int = 0  # parameter elements all-gathered, summed over gathers
    held_elements: int = 0  # parameter elements this wrapper holds gathered now
    peak_elements: int = 0  # the most it held at once
    live: int = 0  # forwards whose backward has not finished (or whose outputs are alive)


# Set by configure_ort_compatible_zero_stage3; None until then.
_settings: Settings | None = None
# DeepSpeedZeRoOffload's own methods, kept to serve modules that are not ORTModules.
_originals: dict[str, Callable[..., Any]] = {}
# The protocol state of each hooked wrapper.
_gatherers: weakref.WeakKeyDictionary[torch.nn.Module, _Gatherer] = weakref.WeakKeyDictionary()


def configure_ort_compatible_zero_stage3(
    debug: bool = False,
    stats_output_dir: str | None = None,
    stats_overwrite: bool = False,
    layerwise: bool = True,
) -> None:
    """Make DeepSpeed ZeRO stage 3 hook an ``ortfx.ORTModule`` as one unit. Call it before
    ``deepspeed.initialize(model=ortfx.ORTModule(model), config=...)``.

    ``debug`` logs each gather and release (the ``ortfx`` logger, INFO). With
    ``stats_output_dir`` (and ``debug``) each rank also appends them as JSON lines to
    ``<stats_output_dir>/zero3_rank<rank>.jsonl``; ``stats_overwrite`` replaces an existing
    file instead of raising. Calling it again replaces the settings (for wrappers initialized
    after it); other modules keep DeepSpeed's own hooks.

    ``layerwise`` (phase 2, the default) gathers each parameter inside the ORT graph right
    before the layer that reads it and again in the backward, holding what eager DeepSpeed
    holds; it turns on ``Options(enable_mem_efficient_grad_management=True,
    zero3_layerwise=True)`` for the wrapper. ``layerwise=False`` (phase 1) gathers the whole
    model around each step: faster (no gathers inside the graph) but it holds every parameter
    at once. See docs/zero3.md.
    """
    global _settings
    try:
        import deepspeed
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    except ImportError as e:
        raise OrtfxInitError(DEEPSPEED_MISSING.format(error=e)) from e
    for name in ("setup_zero_stage3_hooks", "_register_deepspeed_module"):
        if not hasattr(DeepSpeedZeRoOffload, name):
            raise OrtfxInitError(DEEPSPEED_MOVED.format(version=deepspeed.__version__, name=name))
    if not _originals:
        _originals["setup"] = DeepSpeedZeRoOffload.setup_zero_stage3_hooks
        _originals["register"] = DeepSpeedZeRoOffload._register_deepspeed_module
        DeepSpeedZeRoOffload.setup_zero_stage3_hooks = _setup_zero_stage3_hooks
        DeepSpeedZeRoOffload._register_deepspeed_module = _register_deepspeed_module
    _settings = Settings(debug, stats_output_dir, stats_overwrite, layerwise)


def stats(model: torch.nn.Module) -> Zero3Stats:
    """The ZeRO-3 counters of ``model`` (the ``ORTModule``, or the DeepSpeed engine around it)."""
    return _gatherer_of(model).stats


def release_gathered(model: torch.nn.Module) -> None:
    """Release what ``model`` holds gathered now, e.g. after a training-mode forward that will
    never be backwarded (eval and ``no_grad`` forwards release by themselves). A backward
    through a forward whose parameters were released this way is wrong: do not run one."""
    _gatherer_of(model).release()


def _gatherer_of(model: torch.nn.Module) -> _Gatherer:
    wrapper = getattr(model, "module", None) if model not in _gatherers else model
    gatherer = _gatherers.get(wrapper) if wrapper is not None else None
    if gatherer is None:
        raise TypeError(NOT_INSTALLED.format(type_name=type(model).__qualname__))
    return gatherer


# ---- the DeepSpeed side: DeepSpeedZeRoOffload's hook setup, replaced for ORTModules -------------


def _is_wrapper(module: torch.nn.Module) -> bool:
    return isinstance(module, ORTModule)


def _setup_zero_stage3_hooks(offload: Any) -> None:
    """``DeepSpeedZeRoOffload.setup_zero_stage3_hooks``: for an ORTModule, no per-submodule
    hooks and no trace of submodules (ORT runs none of them); the gather-all hooks instead."""
    if not _is_wrapper(offload.module):
        _originals["setup"](offload)
        return
    from deepspeed.runtime.zero import parameter_offload

    offload.hierarchy = 0
    # DeepSpeed removes this handle on destroy(); the step reset it stands for has no trace here.
    offload.fwd_pre_hook = torch.utils.hooks.RemovableHandle(collections.OrderedDict())
    offload._register_deepspeed_module(offload.module)
    # As DeepSpeed does: a parameter reached outside any hooked forward is charged to the root.
    parameter_offload.FWD_MODULE_STACK.append(offload.module)


def _register_deepspeed_module(
    offload: Any, module: torch.nn.Module, *args: Any, **kwargs: Any
) -> None:
    """``DeepSpeedZeRoOffload._register_deepspeed_module``: DeepSpeed calls it again after
    removing its hooks (e.g. ``unwrap_model_for_generation``); for an ORTModule root it
    (re)attaches the gather-all hooks."""
    if module is not offload.module or not _is_wrapper(module):
        _originals["register"](offload, module, *args, **kwargs)
        return
    gatherer = _gatherers.get(module)
    if gatherer is None:
        gatherer = _Gatherer(module, _settings or Settings())
        _gatherers[module] = gatherer
        partitioned.register(module.module, gatherer)
    if gatherer.layerwise:
        configure(module, enable_mem_efficient_grad_management=True, zero3_layerwise=True)
        for p in gatherer.params:
            memgrad.fetch_through(p, gatherer)
    offload.forward_hooks.extend(gatherer.attach())


# ---- the protocol ----------------------------------------------------------------------------


class _Gatherer:
    """One wrapper's gather-all state: what it holds gathered and how many forwards use it."""

    def __init__(self, wrapper: torch.nn.Module, settings: Settings) -> None:
        unique = {id(p): p for p in wrapper.parameters()}.values()
        # Sorted by DeepSpeed's id: collectives must run in the same order on every rank.
        self.params = tuple(sorted(unique, key=lambda p: p.ds_id))  # type: ignore[attr-defined]
        self.wrapper = weakref.ref(wrapper)
        self.held: tuple[torch.nn.Parameter, ...] = ()
        self.live = 0
        self.stats = Zero3Stats()
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.log = WrapperLog(LogLevel.INFO if settings.debug else LogLevel.WARNING)
        self.sink = _stats_sink(settings) if settings.debug else None
        self.layerwise = settings.layerwise
        # Phase 2: parameters a backward re-gather brought in, released after accumulation.
        self.pending: dict[int, torch.Tensor] = {}

    def attach(self) -> list[torch.utils.hooks.RemovableHandle]:
        for handle in self.handles:
            handle.remove()
        wrapper = self.wrapper()
        assert wrapper is not None
        self.handles = [
            wrapper.register_forward_pre_hook(self._pre_forward),
            wrapper.register_forward_hook(self._post_forward, always_call=True),
        ]
        return self.handles

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        # Counted first: if anything here raises, the always-called post hook undoes both.
        self.live += 1
        self.stats = attrs.evolve(self.stats, forwards=self.stats.forwards + 1, live=self.live)
        if not self._layer_by_layer():
            self.gather()

    def _layer_by_layer(self) -> bool:
        """Phase 2 for this forward: ORT's training graph (with its in-graph gathers) will
        run. An inference graph reads the weights as inputs: those forwards gather everything,
        as phase 1 does. An export gathers for itself (:meth:`for_export`)."""
        return (
            self.layerwise and torch.is_grad_enabled() and any(p.requires_grad for p in self.params)
        )

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        leaves, spec = io.flatten(output)
        grads = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not grads:
            self.end()  # eval, no_grad, or the forward raised: nothing will backward
            return None
        tied = _ReleaseAfterBackward.apply(  # type: ignore[no-untyped-call]
            _Pass(self), *(leaves[i] for i in grads)
        )
        for i, t in zip(grads, tied, strict=True):
            leaves[i] = t
        return io.unflatten(spec, leaves)

    def gather(self) -> tuple[torch.nn.Parameter, ...]:
        """All-gather every partitioned parameter; returns them."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        missing = [p for p in self.params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]  # type: ignore[attr-defined]
        if not missing:
            return ()
        missing[0].all_gather(param_list=missing)  # type: ignore[attr-defined]
        self.held = (*self.held, *missing)
        elements = sum(p.ds_numel for p in missing)  # type: ignore[attr-defined]
        held = self.stats.held_elements + elements
        self.stats = attrs.evolve(
            self.stats,
            gathers=self.stats.gathers + 1,
            gathered_elements=self.stats.gathered_elements + elements,
            held_elements=held,
            peak_elements=max(self.stats.peak_elements, held),
        )
        self._note("gather", len(missing), elements)
        return tuple(missing)

    def end(self) -> None:
        """One forward no longer needs the parameters; the last one out releases them."""
        self.live -= 1
        self.stats = attrs.evolve(self.stats, live=self.live)
        if self.live == 0:
            self.release()

    def release(self, only: Sequence[torch.Tensor] | None = None) -> None:
        """Release what this wrapper holds gathered (``only``: just those, from a gather)."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        if only is None:
            if not self.held and not self.pending:
                return  # nothing gathered since the last release (phase 2 releases per layer)
            chosen = (*self.held, *self.pending.values())
            self.held, self.pending = (), {}
        else:
            if not only:
                return
            chosen = tuple(only)
            self.held = tuple(p for p in self.held if all(p is not q for q in chosen))
        # Persistent parameters stay gathered, as DeepSpeed keeps them; parameters someone else
        # released meanwhile (engine.step partitions everything) need nothing.
        drop = [
            p
            for p in chosen
            if p.ds_status is ZeroParamStatus.AVAILABLE and not getattr(p, "ds_persist", False)  # type: ignore[attr-defined]
        ]
        elements = sum(p.ds_numel for p in drop)  # type: ignore[attr-defined]
        if drop:
            drop[0].partition(param_list=drop)  # type: ignore[attr-defined]
        held = 0
        if only is not None:
            held = self.stats.held_elements - sum(p.ds_numel for p in chosen)  # type: ignore[attr-defined]
        self.stats = attrs.evolve(self.stats, releases=self.stats.releases + 1, held_elements=held)
        self._note("release", len(drop), elements)

    # ---- phase 2: memgrad.Fetcher, called from the graph's feed nodes ----

    @contextlib.contextmanager
    def for_export(self) -> Iterator[None]:
        """Phase 2 (:class:`ortfx.runtime.partitioned.Gathering`): the partitioned parameters
        whole while ortfx exports the module, released after (phase 1 gathers them around
        every forward already)."""
        if not self.layerwise:
            yield
            return
        brought = self.gather()
        try:
            yield
        finally:
            self.release(brought)

    def fetch(self, param: torch.Tensor, *, backward: bool) -> torch.Tensor:
        """The full value of ``param`` for one feed node. A forward feed hands ORT the only
        reference (DeepSpeed's is released at once), so the value dies with ORT's last
        forward reader; a backward re-gather stays gathered until its gradient is in."""
        gathered = self._gather_one(param)
        data = param.data
        if gathered and not backward:
            self._release_one(param)
        elif gathered:
            self.pending[id(param)] = param
        return data

    def accumulate(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """``AccumulateGrad`` needs the full shape: gather if no re-gather did, accumulate
        (DeepSpeed's post-accumulate hook reduce-scatters), release."""
        gathered = self._gather_one(param)
        torch.autograd.backward(param, grad)
        if gathered or self.pending.pop(id(param), None) is not None:
            self._release_one(param)

    def _gather_one(self, param: torch.Tensor) -> bool:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        if param.ds_status is not ZeroParamStatus.NOT_AVAILABLE:  # type: ignore[attr-defined]
            return False
        param.all_gather(param_list=[param])  # type: ignore[attr-defined]
        elements: int = param.ds_numel  # type: ignore[attr-defined]
        held = self.stats.held_elements + elements
        self.stats = attrs.evolve(
            self.stats,
            gathers=self.stats.gathers + 1,
            gathered_elements=self.stats.gathered_elements + elements,
            held_elements=held,
            peak_elements=max(self.stats.peak_elements, held),
        )
        self._note("gather", 1, elements)
        return True

    def _release_one(self, param: torch.Tensor) -> None:
        elements: int = param.ds_numel  # type: ignore[attr-defined]
        if not getattr(param, "ds_persist", False):
            param.partition(param_list=[param])  # type: ignore[attr-defined]
        self.stats = attrs.evolve(
            self.stats,
            releases=self.stats.releases + 1,
            held_elements=self.stats.held_elements - elements,
        )
        self._note("release", 1, elements)

    def _note(self, event: str, params: int, elements: int) -> None:
        self.log.log(
            logging.INFO,
            "ZeRO-3 %s of %d parameter(s), %d element(s) (forward %d, %d live)",
            event,
            params,
            elements,
            self.stats.forwards,
            self.live,
        )
        if self.sink is not None:
            record = {
                "event": event,
                "forward": self.stats.forwards,
                "params": params,
                "elements": elements,
                "live": self.live,
            }
            self.sink.write(json.dumps(record) + "\n")
            self.sink.flush()


class _Pass:
    """One forward whose outputs can be backwarded. It ends exactly once: after its backward
    pass has finished, or when its outputs are freed without one."""

    def __init__(self, gatherer: _Gatherer) -> None:
        self._gatherer: _Gatherer | None = gatherer

    def end(self) -> None:
        gatherer, self._gatherer = self._gatherer, None
        if gatherer is not None:
            gatherer.end()

    def end_after_backward(self) -> None:
        # Two hops: the second callback runs after every callback queued during the backward
        # pass, DeepSpeed's end-of-backward gradient epilogue included.
        queue_after_backward(lambda: queue_after_backward(self.end))

    def __del__(self) -> None:
        if not sys.is_finalizing():  # at exit DeepSpeed may be half torn down: nothing to free
            self.end()


class _ReleaseAfterBackward(torch.autograd.Function):
    """Identity on the wrapper's outputs; its backward (the first node to run) schedules the
    release for after the whole backward pass, every ``AccumulateGrad`` included."""

    @staticmethod
    def forward(ctx: Any, token: _Pass, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.token = token
        ctx.set_materialize_grads(False)  # unused outputs stay None for ortfx's backward
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        ctx.token.end_after_backward()
        return (None, *grads)


def _stats_sink(settings: Settings) -> IO[str] | None:
    if settings.stats_output_dir is None:
        return None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    os.makedirs(settings.stats_output_dir, exist_ok=True)
    path = os.path.join(settings.stats_output_dir, f"zero3_rank{rank}.jsonl")
    if os.path.exists(path) and not settings.stats_overwrite:
        raise FileExistsError(STATS_FILE_EXISTS.format(path=path))
    return open(path, "w")  # lives as long as the hooked wrapper
