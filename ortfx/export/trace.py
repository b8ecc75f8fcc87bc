"""One export: the module called from flat tensors, traced, and the graph's inputs named."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import attrs
import torch

from ortfx import _torch, io, module_state, outside
from ortfx.errors import OrtfxExportError, OrtfxIOError
from ortfx.export import exporters, functions, reads, restore, rewrites
from ortfx.model_info import Guard, InputKind, InputSpec, PostExportProcessedModelInfo, Update
from ortfx.options import ExportOptions
from ortfx.outside import Outside
from ortfx.schema import ModelSchema, TensorSpec

E = TypeVar("E", bound=BaseException)

# torch's exporters keep process-wide state (GLOBALS.in_onnx_export, the tracing state, the
# symbolic registry ortfx registers into for its exports): one of ortfx's exports at a time in
# the process. Reentrant: a module exported inside another's export.
_EXPORT_LOCK = threading.RLock()
_EXPORTING = threading.local()


def exporting() -> bool:
    """Whether this thread is inside :func:`export` (a wrapper called from a forward being
    exported runs its module as plain code, so the outer graph takes it in)."""
    return bool(getattr(_EXPORTING, "depth", 0))


@contextlib.contextmanager
def one_export_at_a_time() -> Iterator[None]:
    with _EXPORT_LOCK:
        _EXPORTING.depth = getattr(_EXPORTING, "depth", 0) + 1
        try:
            yield
        finally:
            _EXPORTING.depth -= 1


RANDOM_IN_PYTHON = (
    "the forward of {module} draws from {stream} while traced: the tracer keeps the number it "
    "drew as a constant, so every later call would reuse it (eager draws anew). Draw with "
    "torch (torch.rand, torch.randint, torch.bernoulli: ortfx draws them in the graph), or run "
    "the module in PyTorch (the default fallback policy does)."
)
EXPORT_FAILED = (
    "exporting {module} to ONNX with the {exporter} exporter failed for inputs {schema}: "
    "{error_type}: {error}. If the model uses an operation this exporter cannot express, try the "
    "other exporter (Options(exporter={other!r})), or let ortfx fall back to PyTorch."
)
AUTOCAST_ACTIVE = (
    " The call ran under autocast (e.g. bf16 or fp16 mixed precision, Lightning's "
    "precision='bf16-mixed'): the exporter traces the casts it inserts, and ONNX Runtime's CPU "
    "training kernels lack most low-precision ops; train in float32 through ortfx, or keep the "
    "fallback to PyTorch for autocast (docs/lightning.md)."
)
FUNCTIONS_UNSEEN = (
    "the dynamo exporter inlines custom autograd Functions (their backward would be lost), and "
    "ortfx sees them through a profile hook, which cannot run beside the C-level profiler "
    "active on this thread (cProfile, torch.profiler). Export with "
    "Options(exporter='torchscript'), export before profiling, or let ortfx run the module in "
    "PyTorch (the default fallback policy does)."
)
CUSTOM_FUNCTIONS_DISABLED = (
    "the module calls the custom torch.autograd.Function(s) {names}, and custom Functions are "
    "turned off (Options(enable_custom_autograd_function=False) or "
    "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0). Exporting would inline their forward and train with "
    "its traced gradient instead of their backward. Turn the option on to run them inside the "
    "ORT graph as PythonOp nodes, or run the module in PyTorch."
)


@attrs.frozen
class Exported:
    """What one export produced."""

    info: PostExportProcessedModelInfo
    seconds: float
    checkpoint_calls: int  # torch.utils.checkpoint calls traced directly
    # Buffers updated inside checkpointed functions (eager updates them again on recompute).
    checkpoint_updates: tuple[str, ...] = ()
    tracer_warnings: tuple[str, ...] = ()  # values the tracer baked in, with their location
    # Graph names of the custom autograd.Functions exported as PythonOp nodes.
    custom_functions: tuple[str, ...] = ()
    # The module asked torch.is_grad_enabled() while traced, or read autograd attributes of
    # tensors it computed: its graph can depend on grad mode (transformers' checkpointed layers
    # take the checkpoint branch only with grad enabled).
    reads_grad_mode: bool = False
    # The forward read requires_grad of an input or a parameter while traced: its graph can
    # depend on which of them require grad.
    reads_grad_flags: bool = False
    # The user's own code turned a tensor (often a size) into a Python number while traced.
    numbers_from_tensors: bool = False
    # The public module attributes the forward set while traced: (module, name).
    writes: tuple[tuple[torch.nn.Module, str], ...] = ()
    # The containers the forward filled while traced (module attributes: (module, name);
    # its arguments: ``arguments_filled``), their contents put back.
    filled: tuple[tuple[torch.nn.Module, str], ...] = ()
    arguments_filled: bool = False
    # Where the user's own code asked torch whether it is traced (``file:line``).
    tracing_queries: tuple[str, ...] = ()
    # What the forward read besides its arguments, parameters and buffers (compared per call).
    outside: Outside = attrs.Factory(Outside)
    # Every attribute the traced forward set or deleted, undone when the trace ended: the
    # call whose graph runs makes them again (module_state.apply).
    changes: module_state.Changes = ()


def graph_name(path: str, taken: set[str]) -> str:
    """A tidy ONNX value name from a leaf path: ``args[1]['mask']`` -> ``args_1_mask``."""
    base = re.sub(r"[^0-9A-Za-z_.]+", "_", path).strip("_") or "value"
    name, n = base, 1
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    taken.add(name)
    return name


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by canonical name (a tied weight under its first name)."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


class FlatCall(torch.nn.Module):
    """Calls the user's module from flat tensors and returns flat tensor outputs.

    Static leaves of the call are put back from the schema; the output structure and the
    static output leaves are recorded on the way out. Tensors the forward changes in place
    (parameters, buffers, inputs: seen through their version counters, or a buffer replaced
    by a new tensor) are returned after the user's outputs, so the graph computes their new
    values (``updates``); an output that is an input tensor itself is noted
    (``returned_inputs``). An exception the forward raises is kept in ``raised``; the public
    module attributes it sets, in ``writes``, and every attribute change, undone, in
    ``changes``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        leaves: Sequence[Any],
        schema: ModelSchema,
        watch: reads.Watch | None = None,
    ):
        super().__init__()
        self.module = module
        self.watch = watch
        self._leaves = list(leaves)
        self._schema = schema
        self._tensor_positions = schema.tensor_indices()
        self.output_schema: ModelSchema | None = None
        self.output_leaves: list[Any] = []
        self.updates: tuple[Update, ...] = ()
        self.returned_inputs: tuple[tuple[int, int], ...] = ()
        self.raised: BaseException | None = None
        self.writes: tuple[tuple[torch.nn.Module, str], ...] = ()
        self.filled: tuple[tuple[torch.nn.Module, str], ...] = ()
        self.arguments_filled = False
        self.changes: module_state.Changes = ()
        self.guards: tuple[Guard, ...] = ()

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self._leaves)
        for pos, t in zip(self._tensor_positions, tensors, strict=True):
            leaves[pos] = t
        args, kwargs = io.unflatten(self._schema.treespec, leaves)
        state = _state(self.module)
        versions = {name: _torch.version(t) for name, t in state.items()}
        input_versions = [_torch.version(t) for t in tensors]
        modules = list(self.module.modules())
        attributes = module_state.attributes(modules)
        before = module_state.snapshot(modules)
        held = module_state.contents(modules)
        given = module_state.arguments((*args, *kwargs.values()))
        watching = self.watch.forward() if self.watch is not None else contextlib.nullcontext()
        if self.watch is not None:  # a retried trace starts afresh
            self.watch.reads.conversions.clear()
            self.watch.reads.guards.clear()
        try:
            with watching:
                out = self.module(*args, **kwargs)
        except BaseException as e:
            self.raised = e
            module_state.restore(before)
            module_state.refill(held)
            raise
        self.writes = module_state.written(attributes, modules)
        # What the forward put in containers (its own, and its arguments): ORT runs the graph,
        # not this Python, so no later call fills them; the trace's own filling is undone.
        self.filled = module_state.filled(held)
        module_state.refill(held)
        self.arguments_filled = bool(module_state.filled(given))  # (rebuilt: not the caller's)
        # The trace leaves no attribute behind (an export that fails, or whose graph never
        # runs, must not count as a call); a run of its graph makes these changes again.
        self.changes = module_state.changes(before)
        module_state.restore(before)
        with io.state_sources(io.call_tree(args, kwargs)):  # caches returned are the inputs'
            out_leaves, out_spec = io.flatten(out)
        io.check_leaves(out_leaves, out_spec, root="output", where="output")
        self.output_schema = ModelSchema.from_flat(out_leaves, out_spec, root="output")
        self.output_leaves = out_leaves
        outputs = [x for x in out_leaves if isinstance(x, torch.Tensor)]
        by_id = {id(t): pos for pos, t in zip(self._tensor_positions, tensors, strict=True)}
        self.returned_inputs = tuple(
            (k, by_id[id(x)]) for k, x in enumerate(outputs) if id(x) in by_id
        )
        after = _state(self.module)
        updates: list[Update] = []
        extra: list[torch.Tensor] = []
        for name, t in after.items():
            if name in state and (state[name] is not t or _torch.version(t) != versions[name]):
                updates.append(Update("state", name))
                extra.append(t)
        for pos, t, version in zip(self._tensor_positions, tensors, input_versions, strict=True):
            if _torch.version(t) != version:
                updates.append(Update("input", pos))
                extra.append(t)
        self.updates = tuple(updates)
        # The tensors behind values the trace baked in, as graph outputs: each run is checked
        # against them (one output per distinct tensor and conversion).
        guards: dict[tuple[int, str], tuple[Guard, torch.Tensor]] = {}
        for guard, tensor in self.watch.reads.guards if self.watch is not None else ():
            guards.setdefault((id(tensor), guard.kind), (guard, tensor))
        self.guards = tuple(g for g, _ in guards.values())
        # Detached where it requires grad: a Python value has no gradient, and ORT must not
        # build one (it cannot for some ops, such as a max). The stop is an ATen node ORT runs
        # by calling torch, about 30 us a run: not for a tensor that needs none (sizes, a mask).
        return (
            *outputs,
            *extra,
            *(t.detach() if t.requires_grad else t for _, t in guards.values()),
        )


reads.mark_traced_call(FlatCall.forward.__code__)


def _parameter_sources(module: torch.nn.Module) -> dict[str, tuple[InputKind, str]]:
    """Graph name -> (kind, canonical name). Aliases of tied weights map to one canonical name."""
    sources: dict[str, tuple[InputKind, str]] = {}
    canonical: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
        sources["module." + name] = (InputKind.PARAMETER, canonical[id(p)])
    for name, b in module.named_buffers(remove_duplicate=False):
        canonical.setdefault(id(b), name)
        sources["module." + name] = (InputKind.BUFFER, canonical[id(b)])
    return sources


def like_caller(tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A copy of the caller's input that autograd treats as the caller's: it requires grad if
    the caller's does (the trace runs with the call's grad mode, so what the forward computes
    from it requires grad as in eager), and is a leaf exactly when the caller's is (in-place
    changes of a leaf that requires grad raise, of a computed tensor do not)."""
    with torch.no_grad():
        copied = tensor.detach().clone()
    if not (requires_grad and (copied.is_floating_point() or copied.is_complex())):
        return copied
    copied.requires_grad_(True)
    return copied if tensor.is_leaf else copied.clone()  # a computed (non-leaf) copy


def _refusal(module: torch.nn.Module, refused: tuple[str, str, str]) -> OrtfxExportError:
    attribute, where, what = refused
    name = type(module).__name__
    if what == "input":
        return OrtfxExportError(
            reads.AN_INPUT_READ.format(module=name, attribute=attribute, where=where)
        )
    if what == "random":
        return OrtfxExportError(
            reads.RANDOM_VALUE.format(module=name, attribute=attribute, where=where)
        )
    if what == "made":
        return OrtfxExportError(reads.MADE_TO_REQUIRE_GRAD.format(module=name, where=where))
    return OrtfxExportError(
        reads.INTERMEDIATE_REQUIRES_GRAD.format(
            module=name, attribute=attribute, where=where, what=what
        )
    )


def export(
    module: torch.nn.Module,
    leaves: Sequence[Any],
    schema: ModelSchema,
    options: ExportOptions,
    grad_enabled: bool = False,
) -> Exported:
    """Export ``module`` for calls of ``schema`` (example ``leaves``) made with grad mode
    ``grad_enabled``; return the raw record.

    The record's ``inputs`` are the graph's inputs as exported (user tensors by path, then
    parameters and buffers by module path); grad flags are filled in by processing.
    """
    if torch.is_inference_mode_enabled():
        # The tracer cannot record inference tensors (they have no version counter): a call
        # under torch.inference_mode() is traced outside it, on normal copies of them.
        with torch.inference_mode(False):
            normal = [
                t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t for t in leaves
            ]
            return export(module, normal, schema, options, grad_enabled)
    start = time.perf_counter()
    taken: set[str] = set()
    positions = schema.tensor_indices()
    input_names = [graph_name(schema.paths[i], taken) for i in positions]
    # Clones: the forward may change its inputs in place, and export must not touch the
    # caller's tensors (the graph's run does, as PyTorch would).
    tensors = tuple(like_caller(leaves[i], schema.requires_grad[i]) for i in positions)
    flat = FlatCall(module, leaves, schema)  # replaced by the watched one below
    dynamo = options.exporter != "torchscript"
    exporter = exporters.dynamo if dynamo else exporters.torchscript
    any_grad = any(schema.requires_grad[i] for i in positions) or any(
        t.requires_grad for t in (*module.parameters(), *module.buffers())
    )
    traced = rewrites.checkpoints_traced_directly(module, unsure=dynamo and any_grad)
    try:
        with (
            one_export_at_a_time(),
            rewrites.preserved_random_state(module),
            restore.state_preserved(module, exporting=True) as writes,
            rewrites.batch_norm_updates_in_graph(module),
            traced as checkpoints,
            reads.watched(
                grad_enabled=grad_enabled,
                inputs=tensors,
                buffers=tuple(module.buffers()),
                dynamo=dynamo,
                any_grad=any_grad,
                inner=writes,
            ) as watch,
            rewrites.generators_restored(watch.reads.generators),
        ):
            seen = watch.reads
            flat = FlatCall(module, leaves, schema, watch)
            retry = False
            try:
                model = exporter(flat, tensors, input_names, options.opset_version)
            except Exception as e:
                # Likely a custom Function's forward using a tensor that requires grad without
                # taking it as an input: trace again without Function bodies (only then: the
                # profile hook slows tracing by about a tenth).
                retry = not dynamo and functions.CONSTANT_NEEDS_GRAD in str(e)
                if not (retry or (dynamo and seen.functions)):
                    raise
            if retry:
                # The first attempt's exception holds its frames, whose locals hold `flat`,
                # which holds the exception: break that cycle, or the frames of this whole call
                # (with the call's outputs and their autograd contexts) live until a GC pass.
                flat.raised = None
                flat = FlatCall(module, leaves, schema, watch)
                checkpoints.calls = 0
                with functions.bodies_untraced():
                    model = exporter(flat, tensors, input_names, options.opset_version)
            if seen.hooks:  # only recorded for calls with grad
                raise OrtfxExportError(
                    reads.GRADIENT_HOOK_IN_FORWARD.format(
                        module=type(module).__name__, where=seen.hooks[0]
                    )
                )
            if seen.refused is not None:
                raise _refusal(module, seen.refused)
            if seen.unseen:
                raise OrtfxExportError(FUNCTIONS_UNSEEN)
            if seen.drew is not None:
                raise OrtfxExportError(
                    RANDOM_IN_PYTHON.format(module=type(module).__name__, stream=seen.drew)
                )
            if seen.functions and not options.enable_custom_autograd_function:
                raise OrtfxExportError(
                    CUSTOM_FUNCTIONS_DISABLED.format(names=", ".join(sorted(seen.functions)))
                )
            if seen.functions and dynamo:
                # The dynamo exporter inlines Functions (their backward would be lost): only
                # the TorchScript exporter keeps them, as PythonOp nodes.
                flat = FlatCall(module, leaves, schema, watch)
                checkpoints.calls = 0
                model = exporters.torchscript(flat, tensors, input_names, options.opset_version)
    except OrtfxExportError:
        raise
    except Exception as e:
        unsupported = _in_chain(e, OrtfxIOError)
        if unsupported is not None:
            raise unsupported from None  # data ortfx cannot carry: the data policy decides
        refused = _in_chain(e, OrtfxExportError)
        if refused is not None:
            raise refused from None  # ortfx's own refusal from a symbolic or a translation
        if flat.raised is not None:
            with rewrites.generators_restored(seen.generators):  # the eager run draws too
                raise_if_pytorch_raises(module, leaves, schema, grad_enabled)
        other = "dynamo" if options.exporter == "torchscript" else "torchscript"
        rendered = ", ".join(
            f"{p}: {s.render()}" for p, s in zip(schema.paths, schema.leaves, strict=True)
        )
        raise OrtfxExportError(
            EXPORT_FAILED.format(
                module=type(module).__name__,
                exporter=options.exporter,
                schema="{" + rendered + "}",
                error_type=type(e).__name__,
                error=str(e).strip().splitlines()[0] if str(e).strip() else "",
                other=other,
            )
            + (AUTOCAST_ACTIVE if _torch.any_autocast() else "")
        ) from e
    if flat.output_schema is None:
        raise OrtfxExportError(f"the {options.exporter} exporter never ran the module's forward")
    try:
        read = outside.collect(seen.ran, module.modules())
    except outside.Unguardable as e:
        raise OrtfxExportError(outside.refusal(type(module).__name__, e)) from None
    baked, numbers = exporters.baked(seen.conversions)
    custom = tuple(sorted(seen.functions))
    info = _info(module, model, schema, flat, input_names, positions, dynamo and not custom)
    return Exported(
        info,
        time.perf_counter() - start,
        checkpoints.calls,
        tuple(sorted(checkpoints.updated)),
        baked,
        custom,
        reads_grad_mode=seen.mode or checkpoints.reads_grad,
        reads_grad_flags=seen.leaves or checkpoints.reads_grad,
        numbers_from_tensors=numbers,
        writes=flat.writes,
        filled=flat.filled,
        arguments_filled=flat.arguments_filled,
        tracing_queries=tuple(seen.ran.tracing_queries) if seen.ran is not None else (),
        outside=read,
        changes=flat.changes,
    )


def _info(
    module: torch.nn.Module,
    model: Any,
    schema: ModelSchema,
    flat: FlatCall,
    input_names: list[str],
    positions: tuple[int, ...],
    dynamo_names: bool,
) -> PostExportProcessedModelInfo:
    """The raw record of an exported graph: its inputs by kind, the call's schemas."""
    by_name = dict(zip(input_names, positions, strict=True))
    params = _parameter_sources(module)
    if dynamo_names:
        params.update({k.removeprefix("module."): v for k, v in params.items()})
    inputs = []
    for value in model.graph.input:
        if value.name in by_name:
            inputs.append(InputSpec(value.name, InputKind.USER, by_name[value.name]))
        elif value.name in params:
            kind, source = params[value.name]
            inputs.append(InputSpec(value.name, kind, source))
        else:
            raise OrtfxExportError(
                f"the exported graph has an input {value.name!r} that is neither a user input nor "
                "a parameter or buffer of the module; this is an ortfx bug, please report it."
            )
    assert flat.output_schema is not None
    output_names = tuple(o.name for o in model.graph.output)
    tensor_outputs = [s for s in flat.output_schema.leaves if isinstance(s, TensorSpec)]
    if len(tensor_outputs) + len(flat.updates) + len(flat.guards) != len(output_names):
        raise OrtfxExportError(
            f"the module returned {len(tensor_outputs)} tensors, changed {len(flat.updates)} "
            f"in place and baked in {len(flat.guards)} values, but the exported graph has "
            f"{len(output_names)} outputs; this is an ortfx bug, please report it."
        )
    return PostExportProcessedModelInfo(
        model=model.SerializeToString(),
        inputs=tuple(inputs),
        input_schema=schema,
        output_schema=flat.output_schema,
        output_names=output_names,
        updates=flat.updates,
        guards=flat.guards,
        returned_inputs=flat.returned_inputs,
    )


def _in_chain(error: BaseException, kind: type[E]) -> E | None:
    """The first exception of type ``kind`` in ``error``'s cause/context chain."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def raise_if_pytorch_raises(
    module: torch.nn.Module,
    leaves: Sequence[Any],
    schema: ModelSchema,
    grad_enabled: bool = False,
) -> None:
    """The forward raised while traced, or ORT could not run a call. If the call raises in
    plain PyTorch too (run on copies that autograd treats as the caller's tensors, in the
    call's grad mode), the exception is the input's or the user's (a check in their forward, a
    shape PyTorch rejects, an in-place change of a leaf that requires grad): raise PyTorch's
    own, with its type and message, instead of an export or run failure, so that nothing
    (fallback, exporter) changes for later calls."""
    tensor_leaves = list(leaves)
    for i in schema.tensor_indices():
        tensor_leaves[i] = like_caller(leaves[i], schema.requires_grad[i] and grad_enabled)
    args, kwargs = io.unflatten(schema.treespec, tensor_leaves)
    try:
        with (
            rewrites.preserved_random_state(module),
            restore.state_preserved(module),
            restore.attributes_preserved(module),
            torch.set_grad_enabled(grad_enabled),
        ):
            module(*args, **kwargs)
    except Exception as eager:
        eager.add_note(
            "ortfx: the module raises this in plain PyTorch too, so ortfx neither falls back "
            "nor switches exporters for it."
        )
        raise eager.with_traceback(eager.__traceback__) from None
