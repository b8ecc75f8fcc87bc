"""Tensors crossing between torch and ORT through DLPack, without copies where ORT allows."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack  # type: ignore[attr-defined]

from ortfx.runtime.ort import C

_BOOL = torch.bool


def _capsule(tensor: torch.Tensor) -> tuple[Any, bool]:
    """A DLPack capsule for ORT and whether it carries a bool tensor."""
    tensor = tensor.detach()
    if tensor.numel() == 0:
        # torch calls every empty tensor contiguous whatever its strides (an expanded gradient
        # has zeros); ORT's DLPack reader checks the strides: cross a fresh one.
        tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    elif not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype is torch.bool:
        # ORT's DLPack reader has no bool type: cross as uint8 and flag it.
        return to_dlpack(tensor.to(torch.uint8)), True
    return to_dlpack(tensor), False


def to_ort(vector: Any, tensor: torch.Tensor) -> None:
    # The common case inline (no detach: the capsule ignores autograd): 2 of 5 µs per 4 feeds.
    if tensor.dtype is not _BOOL and tensor.is_contiguous() and tensor.numel():
        vector.push_back(to_dlpack(tensor), False)
    else:
        vector.push_back(*_capsule(tensor))


def ort_value(tensor: torch.Tensor) -> Any:
    return C.OrtValue.from_dlpack(*_capsule(tensor))


def to_torch(vector: Any) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = vector.to_dlpacks(from_dlpack)
    for i in vector.bool_tensor_indices():
        tensors[i] = tensors[i].to(torch.bool)
    return tensors
