"""Test-session setup for tests/ and property_tests/.

torchvision (a test extra) is imported by Lightning, transformers and timm as soon as it is
installed; the wheel the index serves beside the CPU torch cannot load its C extension, and its
import then fails (see tests/vision_libraries.py). Importing it once here, the way that module
does, makes every later ``import torchvision`` in the session work.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("torchvision") is not None:
    from tests import vision_libraries

    vision_libraries.import_torchvision()
