"""Hooks that connect ortfx to training frameworks (see docs/zero3.md)."""

from ortfx.hooks.zero3 import configure_ort_compatible_zero_stage3

__all__ = ["configure_ort_compatible_zero_stage3"]
