"""timm and torchvision for the tests, whatever torchvision's C extension does.

The only torchvision 0.28 wheel the package index serves beside torch 2.13's CPU build is a
CUDA build: its C extension (``torchvision/_C.so``, detection ops) does not load, and then
``import torchvision`` fails registering fake kernels for two operators the extension would
have defined (``torchvision::nms``, ``torchvision::qnms``). The model code (and timm, which
imports torchvision) is pure Python: with those two schemas defined first, it imports and runs.
The detection ops themselves stay unavailable (torchvision raises its own error for them).
"""

from __future__ import annotations

import sys
import types

import torch

# The schemas torchvision's extension defines (torchvision/csrc/ops/nms.cpp and its quantized
# twin); kept referenced: a Library's definitions go when it is collected.
_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",)
_QUANTIZED = ("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",)
_LIBRARY: list[torch.library.Library] = []


def import_torchvision() -> types.ModuleType:
    """``torchvision``, its two operator schemas defined first when its extension fails."""
    try:
        import torchvision
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        if not _LIBRARY:
            library = torch.library.Library("torchvision", "FRAGMENT")
            for schema in (*_SCHEMAS, *_QUANTIZED):
                library.define(schema)
            _LIBRARY.append(library)
        import torchvision
    return torchvision


def import_timm() -> types.ModuleType:
    """``timm``, after :func:`import_torchvision`."""
    import_torchvision()
    import timm

    return timm
