"""Exception and warning types. Every message says what happened, what was expected and the fix."""

from __future__ import annotations


class OrtfxError(Exception):
    """Base class of every error ortfx raises on purpose."""


class OrtfxIOError(OrtfxError, TypeError):
    """An input or output of the module has a type ortfx cannot carry through the graph."""


class OrtfxEmptyTensorError(OrtfxIOError):
    """A call that needs gradients has an empty input: ortfx runs that one call in PyTorch."""


class OrtfxDeviceError(OrtfxError, RuntimeError):
    """Parameters or inputs sit on devices that one ONNX Runtime session cannot serve."""


class OrtfxExportError(OrtfxError, RuntimeError):
    """The module could not be exported to ONNX or the exported graph could not be prepared."""


class OrtfxUnsupportedOpError(OrtfxExportError):
    """ONNX Runtime cannot run or differentiate an operator of the exported graph (no kernel,
    no gradient builder, an unsupported attribute): an unsupported ONNX model for the fallback
    policy. ``op`` is the ONNX operator, ``node`` the node's name (it carries the module path)."""

    def __init__(self, message: str, *, op: str = "", node: str = "") -> None:
        super().__init__(message)
        self.op = op
        self.node = node

    def __reduce__(self) -> tuple[object, ...]:
        return (_unsupported_op, (str(self), self.op, self.node))


def _unsupported_op(message: str, op: str, node: str) -> OrtfxUnsupportedOpError:
    return OrtfxUnsupportedOpError(message, op=op, node=node)


class OrtfxTorchModelError(OrtfxError, TypeError):
    """The torch module itself is not something ortfx can wrap (e.g. DataParallel)."""


class OrtfxInitError(OrtfxError, RuntimeError):
    """ONNX Runtime could not be set up (missing wheel, gradient build or session failure)."""


class OrtfxGraphBuildError(OrtfxInitError):
    """ONNX Runtime could not build the gradient graph of an exported graph, or open a session
    over it, for a reason that names no operator: a property of that graph, so the
    ``UNSUPPORTED_ONNX_MODEL`` fallback covers it (the default policy runs PyTorch)."""


class OrtfxRuntimeError(OrtfxError, RuntimeError):
    """ONNX Runtime failed while running a graph that was built successfully."""


class OrtfxOutputExistsError(OrtfxError, FileExistsError):
    """An output directory of the convergence tools (``ortfx.hooks``) already exists."""


class OrtfxVerificationError(OrtfxError, AssertionError):
    """An inference export's outputs in ONNX Runtime differ from the module's own in PyTorch
    by more than the tolerance (:func:`ortfx.export_for_inference`); nothing was written."""


class OrtfxWarning(UserWarning):
    """Warnings ortfx emits: repeated re-exports, ignored settings, fallbacks."""


SUPPORTED_LEAVES = "torch.Tensor, None, bool, int, float or str"
SUPPORTED_CONTAINERS = (
    "tuple, list, dict, OrderedDict, defaultdict, namedtuple, dataclass, attrs class "
    "or a Mapping such as transformers' ModelOutput"
)

UNSUPPORTED_LEAF = (
    "{where} {path} has type {type_name}, which ortfx cannot carry through an ONNX graph. "
    "Supported leaves are " + SUPPORTED_LEAVES + ", nested in any " + SUPPORTED_CONTAINERS + ". "
    "Convert it to one of these (a tensor for data, a Python scalar for a flag), "
    "or call the module outside ortfx."
)

UNSUPPORTED_CACHE = (
    "{where} {path} {what}, which ortfx cannot carry through an ONNX graph: ortfx knows "
    "transformers' cache classes (DynamicCache, "
    "StaticCache, EncoderDecoderCache and their layers, holding tensors and Python scalars), "
    "not this one. Call the model with use_cache=False (or set model.config.use_cache = False) "
    "to run it in ONNX Runtime without a cache, or call the module outside ortfx."
)

FUNCTORCH_TRANSFORM = (
    "the call runs inside a torch.func transform (vmap, grad, jacrev, jvp, ...), whose "
    "wrapped tensors cannot cross into ONNX Runtime: ortfx runs its graph only for plain "
    "calls. Apply the transform to the wrapped module itself (model.module), or let ortfx run "
    "such calls in PyTorch (the default fallback policy does)."
)

UNSUPPORTED_LAYOUT = (
    "{where} {path} is a {layout} tensor; ortfx carries only dense (torch.strided) tensors "
    "through an ONNX graph. Convert it with .to_dense() before the call, or call the module "
    "outside ortfx."
)

EMPTY_TENSOR_TRAINING = (
    "{where} {path} is empty (shape {shape}); ONNX Runtime 1.19's CPU gradient kernels reject "
    "empty tensors (Gemm) or kill the process on them (Conv), so ortfx runs this call in "
    "PyTorch, as PyTorch would; later calls with data run in ONNX Runtime as before"
)

DATA_PARALLEL = (
    "ortfx.ORTModule was given a {type_name}; wrapping a (Distributed)DataParallel module is not "
    "supported because the wrapper replicates the module outside ONNX Runtime. "
    "Wrap the inner module instead: DataParallel(ORTModule(model)) or "
    "DistributedDataParallel(ORTModule(model))."
)

NOT_A_MODULE = (
    "ortfx.ORTModule expects a torch.nn.Module, got {type_name}. "
    "Pass the model object itself, e.g. ORTModule(MyModel())."
)

ZERO3_NOT_CONFIGURED = (
    "the module wrapped by ortfx.ORTModule has {count} DeepSpeed ZeRO-3 partitioned "
    "parameter(s) (first: {name!r}, full shape {full}, shape here {local}), but ortfx's ZeRO-3 "
    "hooks are not installed on this wrapper. DeepSpeed gathers parameters from each "
    "submodule's forward hooks, which never fire when ONNX Runtime runs the module as one graph. "
    "Call ortfx.hooks.configure_ort_compatible_zero_stage3() before "
    "deepspeed.initialize(model=ortfx.ORTModule(model), ...) (wrap first, then initialize)."
)

BACKWARD_HOOKS = (
    "backward hooks are registered on modules inside the wrapped module ({modules}); ORT "
    "computes the backward of the whole graph and would never run them, so gradients (and "
    "what the hooks record) would differ from PyTorch's. Register them on the ORTModule itself "
    "(they then see the whole module's gradients), use tensor hooks on the parameters, or let "
    "ortfx run the module in PyTorch (the default fallback policy does)."
)
USER_MODES = (
    "a TorchFunctionMode or TorchDispatchMode of the user's is active ({modes}): it must see "
    "the ops, which ORT's graph would run unseen; this call runs in PyTorch"
)
BUFFER_REQUIRES_GRAD = (
    "buffer {name!r} requires grad; ortfx's graph takes gradients for the module's inputs and "
    "parameters only, so the buffer would get none (PyTorch accumulates one into its .grad). "
    "Register it as an nn.Parameter to train it, call requires_grad_(False) on it, or let "
    "ortfx run the module in PyTorch (the default fallback policy does)."
)
PARAMS_ON_SEVERAL_DEVICES = (
    "the module's parameters and buffers are on several devices ({devices}); "
    "one ONNX Runtime session runs on one device. Move the whole module with model.to(device)."
)

INPUT_ON_OTHER_DEVICE = (
    "input {path} is on {given}, but the module is on {expected}. "
    "Move the input with .to({expected!r}) or the module with model.to({given!r})."
)

ORT_MISSING = (
    "ONNX Runtime training is not installed (importing onnxruntime failed: {error}). "
    "Install exactly one training wheel: `pip install ortfx[cpu]` "
    "(onnxruntime-training-cpu==1.19.2) or, on a CUDA 11.8 machine with Python 3.11, "
    "`pip install ortfx[cuda]` (onnxruntime-training==1.19.2)."
)

CUDA_PROVIDER_MISSING = (
    "the module is on {device}, but the installed ONNX Runtime offers only {providers}. "
    "Install the CUDA training wheel instead of the CPU one: "
    "`pip uninstall -y onnxruntime-training-cpu && pip install onnxruntime-training==1.19.2` "
    "(needs CUDA 11.8 and cuDNN 8), or keep the module on the CPU."
)

ALREADY_WRAPPED = (
    "ortfx.ORTModule was given a module that is already an ORTModule; wrap the original module "
    "once."
)

BAD_DEBUG_OPTIONS = (
    "debug_options must be an ortfx.DebugOptions, got {type_name}; "
    "pass e.g. ortfx.DebugOptions(log_level=ortfx.LogLevel.INFO)."
)

NOT_A_WRAPPER = (
    "expected an ortfx.ORTModule, got {type_name}; wrap the model first: "
    "model = ortfx.ORTModule(model)."
)

UNKNOWN_OPTIONS = (
    "ortfx.configure got unknown option(s) {unknown}; valid options are {known} "
    "(see docs/options.md)."
)

NO_TRAINING_GRAPH = (
    "ortfx.memory_report: this model has not run a training step through ONNX Runtime yet; call "
    "it after the first forward with gradients."
)

TOO_MANY_RECOVERIES = (
    "ortfx tried {count} times to rebuild the graph for this call ({causes}) and ORT still could "
    "not run it; this is an ortfx bug, please report it with the log (LogLevel.INFO)."
)

UNSUPPORTED_OP = (
    "ONNX Runtime 1.19 cannot {what} operator {op}{node} of the exported graph ({detail}). "
    "ortfx runs a graph in ORT only when every operator has an ORT kernel for its dtypes and, "
    "for training, a gradient builder and a CPU gradient kernel (docs/index.md lists the "
    "standard layers that train and those that do not). Replace the layer with a supported "
    "one, run it outside the wrapped module, or let ortfx fall back to PyTorch: the default "
    "policy does (FallbackPolicy.UNSUPPORTED_ONNX_MODEL)."
)

VALUE_DEPENDENT_CONTROL_FLOW = (
    "an If whose condition depends on tensor values (node {node}) lies on the path ORT would "
    "differentiate, and ORT 1.19's gradient builder aborts the process on it"
)

NO_LOOP_GRADIENT = (
    "ORT 1.19 has no gradient for a {op} (torch exports e.g. F.embedding_bag and nn.EmbeddingBag "
    "with one): its gradient builder raises, or aborts the process when the loop's body reads "
    "a value computed outside it"
)

WRONG_AVERAGE_POOL_3D = (
    "its CPU gradient kernel for a 3-d window (AveragePoolGrad) computes wrong gradients: "
    "measured against PyTorch for nn.AvgPool3d and nn.LocalResponseNorm, which torch exports "
    "as a 3-d AveragePool"
)

WRONG_REDUCING_SCATTER = (
    "its gradient of a {op} with reduction '{reduction}' ignores the reduction (measured "
    "against PyTorch: scatter_reduce with amax, amin and prod, and the input of a reducing "
    "scatter, got wrong gradients); ortfx exports scatter_add, scatter_reduce('sum') and "
    "index_put(accumulate=True) in a form ORT differentiates correctly"
)

STATIC_SIZES_SESSION = (
    "ORT's gradient kernels of {ops} read sizes from the graph, so ortfx builds the training "
    "session for concrete input sizes and one session per size"
)

# ---- log lines (WARNING/INFO); the arguments are filled in by ortfx.runtime.logs ----------------

FALLING_BACK = (
    "falling back to PyTorch (policy %s allows it): %s. %s; to make this an error, pass "
    "Options(fallback_policy=ortfx.FallbackPolicy.DISABLE) or set "
    "ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE."
)

TRACED_ATTRIBUTE_WRITES = (
    "the forward sets attribute %s while exporting: ONNX Runtime runs the exported graph, not "
    "the forward's Python, so later calls leave these attributes as the exporting call set "
    "them. Keep such state in a buffer (register_buffer, updated in place: ortfx writes it "
    "back on every call), return it as an output, or run this module in PyTorch."
)

TRACED_CONTAINER_WRITES = (
    "the forward changes the contents of %s (a list, dict or set: appended to, items set) "
    "while exporting: ONNX Runtime runs the exported graph, not the forward's Python, so no "
    "call through ortfx changes them (the export's own change is undone). Return such values "
    "as outputs, or run this module in PyTorch."
)

TRACING_QUERIES = (
    "the forward asks whether it is traced (%s): ortfx's export traces it, so the graph holds "
    "the branch taken while traced, which no eager call takes. Make both branches compute the "
    "same values, or run this module in PyTorch."
)

TRACED_FORWARD_HOOKS = (
    "forward hooks on %s ran once, while exporting: what they compute with tensors is part of "
    "the graph, but their Python side effects (storing activations, printing, counting) will "
    "not happen on the calls ONNX Runtime runs. Register such hooks on the ORTModule itself "
    "(they run around the graph on every call), or run this module in PyTorch."
)

BAKED_DYNAMIC_SCALARS = (
    "%s %s in dynamic_scalars, but the exported graph does not read %s as a tensor: the module "
    "turns the value into a Python value (e.g. range(n), if n > 0), which the tracer bakes in. "
    "ortfx treats %s as static from now on; remove %s from Options.dynamic_scalars"
)

SIZES_PINNED = (
    "the forward returns Python numbers its own code computed from tensors (int(x.shape[0]), "
    "len(x), .item()): the graph holds their export-time values, so it serves input sizes %s "
    "only, and a call with other sizes exports again. Return such values as tensors to keep "
    "one graph for all sizes"
)
PINNED_SIZES_CHANGED = (
    "the graph returns Python numbers computed for input sizes {before}, and this call has "
    "sizes {now}"
)
GUARDED = (
    "the trace took %d Python value(s) from tensors (a branch on them, a number computed from "
    "them), which the graph holds as constants: %s. ortfx checks each after every run, and a "
    "call that gives another value is computed again with a graph for that value (said once "
    "per graph)"
)
VALUE_KEEPS_CHANGING = (
    "the forward takes a Python value from a tensor at {where} ({kind}), which the traced graph "
    "holds as a constant, and it has taken {count} different values so far ({values}): each "
    "needs a graph of its own. Keep it a tensor (e.g. `loss / mask.sum()` instead of "
    "`loss / float(mask.sum())`, `torch.where` instead of an `if`), make it a static argument, "
    "or let ortfx run the module in PyTorch (the default fallback policy does)."
)
STRICT_TRACING_REFUSED = (
    "strict_tracing is on and the trace of {module} took {count} Python value(s) from tensors, "
    "first: {first}. The graph holds them as constants (ortfx would check them after every run "
    "and export again for other values); strict_tracing refuses such graphs. The default "
    "fallback policy runs this module in PyTorch; turn strict_tracing off to accept the graph."
)


SWITCHING_TO_DYNAMO = (
    "the torchscript graph cannot run these input sizes (%s); switching this module to the "
    "dynamo exporter, which keeps sizes symbolic"
)

COMPUTE_OPTIMIZER_FAILED = (
    "ONNX Runtime's compute optimizer failed on this graph (%s); the gradient graph was built "
    "without it. Options(enable_compute_optimizer=False) or ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=0 "
    "skips the failing attempt"
)

CHECKPOINT_RECOMPUTED = (
    "the module calls torch.utils.checkpoint %d time(s); ortfx exports the checkpointed "
    "functions as plain code and memory_opt_level %d recomputes layer-wise inside ONNX Runtime "
    "instead"
)

CHECKPOINT_NOT_RECOMPUTED = (
    "the module calls torch.utils.checkpoint %d time(s); ortfx exports the checkpointed "
    "functions as plain code, so at memory_opt_level 0 their activations are kept like any "
    "others (no recompute). For layer-wise recompute inside ONNX Runtime pass "
    "Options(memory_opt_level=1) or set ORTMODULE_MEMORY_OPT_LEVEL=1"
)

CHECKPOINT_UPDATES_ONCE = (
    "buffers updated inside torch.utils.checkpoint functions (%s): PyTorch's recompute in the "
    "backward runs those functions again and updates them a second time per step (BatchNorm "
    "statistics move twice, num_batches_tracked counts 2 per step); ortfx's graph updates them "
    "once, as the same model does without checkpointing. Running statistics therefore differ "
    "from eager's with checkpointing (and equal eager's without it)"
)

RANDOM_DRAWS = (
    "the exported graph draws random numbers (%s) from ONNX Runtime's generators, seeded from "
    "torch's state: the same distribution, reproducible for a given torch.manual_seed, but not "
    "the values eager PyTorch draws, and torch's own generator does not advance (a later "
    "torch.manual_seed does not reseed the graph's). Compare losses with dropout off "
    "(docs/runtime.md, Dropout and random ops). Said once per process."
)

OPS_IN_TORCH = (
    "%s cannot be expressed in ONNX; ortfx exported it as ATen node(s) that ONNX Runtime runs "
    "by calling torch inside the graph (no gradient flows through them)"
)

MEMORY_CONFIG_IGNORED = (
    "memory_opt_level %d turns on every layer-wise plan itself and ignores memory_opt_config %r; "
    "use level 0 to apply only the listed plans"
)

MEMORY_PLAN_UNMATCHED = "memory optimizer plan %s matches nothing in this graph; its plans are: %s"

OUTPUT_DIR_EXISTS = (
    "the output directory {path} already exists, and writing into it would mix this run's files "
    "with older ones. Choose a new directory, delete it, or {fix} to replace it."
)

INPUT_CHANGED_IN_PLACE = (
    "input {path} requires grad and the module's forward changes it in place; ortfx runs that "
    "change inside ONNX Runtime, where torch autograd cannot record it (PyTorch itself refuses "
    "an in-place change of a leaf that requires grad). Clone it at the top of forward "
    "(x = x.clone()) or pass a tensor that does not require grad."
)

OUTPUT_DTYPE_CHANGED = (
    "ONNX Runtime returned {path} as {given}, but the module returns {expected}: ORT's CPU "
    "training kernels do not run {expected}, and its graph computed in {given}. Train in float32 "
    "(model.float()) or let ortfx fall back to PyTorch (the default policy does)."
)

WATCHED_INNER_OUTPUT = (
    "output {position} of the module has a gradient hook or retain_grad(), and the module's "
    "graph also uses that tensor inside: ONNX Runtime adds the gradient from inside the "
    "module within its graph, so the hook (or .grad) would see only the part from outside the "
    "module, where eager's sees the whole gradient. Return a clone of it (h.clone()) for the "
    "hook, register the hook inside the forward, or run this module in PyTorch."
)

HIGHER_ORDER_GRADIENTS = (
    "higher-order gradients (backward or autograd.grad with create_graph=True) through a module "
    "run by ortfx are not supported: ONNX Runtime computes the first-order gradient, which torch "
    "cannot differentiate again. Compute them without ortfx (call model.module directly for that "
    "step), or use create_graph=False."
)

NO_GRADIENT_GRAPH = (
    "these outputs came from ONNX Runtime's inference graph, because it could not build a "
    "gradient graph for this eval-mode call ({why}); backward through them is not supported. "
    "Train in float32 (model.float()), run the validation loop under torch.no_grad(), or call "
    "the module outside ortfx."
)

NOT_FLOAT32 = (
    "The graph computes in {dtypes}: ORT 1.19's CPU kernels, and its gradient kernels above all, "
    "cover float32 (many have no float64, float16 or bfloat16 version). Train in float32 "
    "(model.float()), or keep the fallback policy's UNSUPPORTED_ONNX_MODEL flag (on by default) "
    "so such calls run in PyTorch."
)
