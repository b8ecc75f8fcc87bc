"""timm and torchvision for the tests, whatever torchvision's C extension does.

The only torchvision 0.28 wheel the package index serves beside torch 2.13's CPU build is a
CUDA build: its C extension (``torchvision/_C.so``, detection ops) does not load, and then
``import torchvision`` fails registering fake kernels for two operators the extension would
have defined (``torchvision::nms``, ``torchvision::qnms``). Lightning, transformers and timm
import torchvision whenever it is installed. The model code is pure Python: with those two
schemas defined first, it imports and runs; the detection ops stay unavailable (torchvision
raises its own error for them).

:func:`install_hook` puts a finder on ``sys.meta_path`` that does this right before the first
``import torchvision``. ``make`` installs it into the test venv's startup (a ``.pth`` line, see
``tests/install_torchvision_hook.py``), so that test subprocesses get it too; ``conftest.py``
installs it in the pytest process. This module imports nothing heavy at startup.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

# The schemas torchvision's extension defines (torchvision/csrc/ops/nms.cpp and its quantized
# twin); the Library is kept referenced: its definitions go when it is collected.
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY: list[Any] = []


def define_missing_schemas(folder: Path) -> None:
    """Load torchvision's extension from ``folder``; if it does not load, define the two
    schemas its Python code registers fake kernels for (unless something already did)."""
    import torch

    for extension in folder.glob("_C*.so"):
        try:
            torch.ops.load_library(str(extension))
            return
        except (OSError, ImportError, RuntimeError):
            pass
    try:
        torch.ops.torchvision.nms  # noqa: B018 (defined by another copy of this module)
        return
    except (AttributeError, RuntimeError):
        pass
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        library.define(schema)
    _LIBRARY.append(library)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs :func:`define_missing_schemas` once, before ``torchvision`` is first imported."""

    ran = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torchvision" and not self.ran:
            self.ran = True  # before find_spec below, which comes back here
            spec = importlib.util.find_spec("torchvision")
            if spec is not None and spec.submodule_search_locations:
                define_missing_schemas(Path(next(iter(spec.submodule_search_locations))))
        return None  # the import itself is left to the other finders


def install_hook() -> None:
    """Put the finder on ``sys.meta_path`` (once per process)."""
    if not any(type(f).__name__ == "_BeforeTorchvision" for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())


def import_torchvision() -> types.ModuleType:
    """``torchvision``, importable as above."""
    install_hook()
    import torchvision

    return torchvision


def import_timm() -> types.ModuleType:
    """``timm``, after :func:`import_torchvision`."""
    import_torchvision()
    import timm

    return timm
