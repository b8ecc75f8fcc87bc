"""Test-session setup for tests/ and property_tests/: torchvision importable (Lightning,
transformers and timm import it when installed; see tests/vision_libraries.py)."""

from __future__ import annotations

from tests import vision_libraries

vision_libraries.install_hook()
