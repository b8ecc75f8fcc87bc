"""ortfx: train PyTorch modules on ONNX Runtime.

``model = ortfx.ORTModule(model)`` and train as before.
"""

from ortfx.deploy import InferenceExport, export_for_inference
from ortfx.errors import (
    OrtfxDeviceError,
    OrtfxError,
    OrtfxExportError,
    OrtfxGraphBuildError,
    OrtfxInitError,
    OrtfxIOError,
    OrtfxOutputExistsError,
    OrtfxRuntimeError,
    OrtfxTorchModelError,
    OrtfxUnsupportedOpError,
    OrtfxVerificationError,
    OrtfxWarning,
)
from ortfx.hooks import inspect_activation
from ortfx.keys import Reason, Transition
from ortfx.memory import MemoryPlan
from ortfx.options import DebugOptions, FallbackPolicy, LogLevel, Options
from ortfx.runtime.api import (
    configure,
    explain,
    invalidate,
    memory_report,
    options_of,
    stats,
)
from ortfx.runtime.module import ORTModule
from ortfx.transitions import Stats

__all__ = [
    "DebugOptions",
    "FallbackPolicy",
    "InferenceExport",
    "LogLevel",
    "MemoryPlan",
    "ORTModule",
    "Options",
    "OrtfxDeviceError",
    "OrtfxError",
    "OrtfxExportError",
    "OrtfxGraphBuildError",
    "OrtfxIOError",
    "OrtfxInitError",
    "OrtfxOutputExistsError",
    "OrtfxRuntimeError",
    "OrtfxTorchModelError",
    "OrtfxUnsupportedOpError",
    "OrtfxVerificationError",
    "OrtfxWarning",
    "Reason",
    "Stats",
    "Transition",
    "configure",
    "explain",
    "export_for_inference",
    "inspect_activation",
    "invalidate",
    "memory_report",
    "options_of",
    "stats",
]
