"""ortfx: train PyTorch modules on ONNX Runtime.

``model = ortfx.ORTModule(model)`` and train as before.
"""

from ortfx.errors import (
    OrtfxDeviceError,
    OrtfxError,
    OrtfxExportError,
    OrtfxInitError,
    OrtfxIOError,
    OrtfxTorchModelError,
    OrtfxWarning,
)
from ortfx.options import LogLevel, Options
from ortfx.runtime.module import ORTModule, explain, invalidate, stats
from ortfx.transitions import Reason, Stats, Transition

__all__ = [
    "LogLevel",
    "ORTModule",
    "Options",
    "OrtfxDeviceError",
    "OrtfxError",
    "OrtfxExportError",
    "OrtfxIOError",
    "OrtfxInitError",
    "OrtfxTorchModelError",
    "OrtfxWarning",
    "Reason",
    "Stats",
    "Transition",
    "explain",
    "invalidate",
    "stats",
]
