"""Exception and warning types. Every message says what happened, what was expected and the fix."""

from __future__ import annotations


class OrtfxError(Exception):
    """Base class of every error ortfx raises on purpose."""


class OrtfxIOError(OrtfxError, TypeError):
    """An input or output of the module has a type ortfx cannot carry through the graph."""


class OrtfxDeviceError(OrtfxError, RuntimeError):
    """Parameters or inputs sit on devices that one ONNX Runtime session cannot serve."""


class OrtfxExportError(OrtfxError, RuntimeError):
    """The module could not be exported to ONNX or the exported graph could not be prepared."""


class OrtfxTorchModelError(OrtfxError, TypeError):
    """The torch module itself is not something ortfx can wrap (e.g. DataParallel)."""


class OrtfxInitError(OrtfxError, RuntimeError):
    """ONNX Runtime could not be set up (missing wheel, gradient build or session failure)."""


class OrtfxRuntimeError(OrtfxError, RuntimeError):
    """ONNX Runtime failed while running a graph that was built successfully."""


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

UNSUPPORTED_LAYOUT = (
    "{where} {path} is a {layout} tensor; ortfx carries only dense (torch.strided) tensors "
    "through an ONNX graph. Convert it with .to_dense() before the call, or call the module "
    "outside ortfx."
)

EMPTY_TENSOR_TRAINING = (
    "{where} {path} is empty (shape {shape}); ONNX Runtime 1.19's CPU gradient kernels reject "
    "empty tensors (Gemm) or kill the process on them (Conv), so ortfx does not train on them "
    "in ONNX Runtime. The default fallback policy (UNSUPPORTED_DATA) runs such a call in "
    "PyTorch; otherwise skip empty batches, or run them under torch.no_grad(), which ONNX "
    "Runtime serves."
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
