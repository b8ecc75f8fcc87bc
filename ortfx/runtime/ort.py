"""Importing ONNX Runtime (without upstream's Python front end), and the providers per device.

The only module that imports ``onnxruntime`` at import time; the rest of the runtime takes
``ort`` and ``C`` (its C++ training layer) from here.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

import torch

from ortfx.errors import (
    CUDA_PROVIDER_MISSING,
    ORT_MISSING,
    OrtfxDeviceError,
    OrtfxInitError,
)


class _WithoutFrontEnd(importlib.abc.MetaPathFinder):
    """Refuses ``onnxruntime.training`` while ``import onnxruntime`` runs.

    The training wheel's package ``__init__`` imports upstream's ORTModule front end only to
    find out whether it is there (``onnxruntime_validation``). That pulls in DeepSpeed, sympy
    and pydantic: about 1 s of import and 90 MB of resident memory, for code ortfx never calls
    (the C++ training layer is in ``_pybind_state``), and it replaces ``torch.manual_seed``.
    The package handles an ImportError there by design; the finder is removed right after, so
    a user's own ``import onnxruntime.training`` works as usual.
    """

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "onnxruntime.training" or name.startswith("onnxruntime.training."):
            raise ImportError(f"{name} is not imported by ortfx", name=name)
        return None


def _import_onnxruntime() -> tuple[Any, Any]:
    finder = None if "onnxruntime" in sys.modules else _WithoutFrontEnd()
    if finder is not None:
        sys.meta_path.insert(0, finder)
    try:
        import onnxruntime
        from onnxruntime.capi import _pybind_state
    finally:
        if finder is not None:
            sys.meta_path.remove(finder)
    return onnxruntime, _pybind_state


try:
    ort, C = _import_onnxruntime()
    _IMPORT_ERROR: Exception | None = None
except Exception as e:  # pragma: no cover - exercised only without the wheel
    ort = C = None
    _IMPORT_ERROR = e


def require_ort() -> None:
    if _IMPORT_ERROR is not None:
        raise OrtfxInitError(ORT_MISSING.format(error=_IMPORT_ERROR))


def providers_for(device: torch.device) -> tuple[list[Any], Any]:
    """Execution providers and the OrtDevice for ``device``."""
    if device.type == "cpu":
        return ["CPUExecutionProvider"], C.OrtDevice(
            C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0
        )
    if device.type == "cuda":
        available = ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            raise OrtfxDeviceError(
                CUDA_PROVIDER_MISSING.format(device=device, providers=", ".join(available))
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        return (
            [("CUDAExecutionProvider", {"device_id": str(index)}), "CPUExecutionProvider"],
            C.OrtDevice(C.OrtDevice.cuda(), C.OrtDevice.default_memory(), index),
        )
    raise OrtfxDeviceError(
        f"the module is on {device}, but ortfx runs ONNX Runtime on 'cpu' or 'cuda' only. "
        "Move the module with model.to('cpu') or model.to('cuda')."
    )
