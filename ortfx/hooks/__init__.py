"""Hooks into ortfx's graph and into training frameworks.

Convergence tooling: activation statistics for PyTorch and ortfx runs (see docs/convergence.md).

``GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(dir)])`` writes, per step, the
summary of every module output and of its gradient; ``inspect_activation(name, tensor)`` adds any
tensor; ``python -m ortfx.hooks.merge_activation_summary`` merges a PyTorch and an ortfx run and
names the first divergence. The names are upstream ORTModule's, so scripts only change imports.

DeepSpeed ZeRO stage 3: ``configure_ort_compatible_zero_stage3()`` before ``deepspeed.initialize``
(see docs/zero3.md).
"""

from __future__ import annotations

import torch

from ortfx.hooks.subscribers import (
    RuntimeStates,
    StatisticsSubscriber,
    SubscriberBase,
    SubscriberManager,
)
from ortfx.hooks.zero3 import configure_ort_compatible_zero_stage3

__all__ = [
    "GlobalSubscriberManager",
    "RuntimeStates",
    "StatisticsSubscriber",
    "SubscriberBase",
    "SubscriberManager",
    "configure_ort_compatible_zero_stage3",
    "inspect_activation",
]

# The manager that inspect_activation reports to.
GlobalSubscriberManager = SubscriberManager()


def inspect_activation(activation_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Identity in value and gradient. While a ``StatisticsSubscriber`` subscribed through
    ``GlobalSubscriberManager`` is active and the step is in its window, writes
    ``<activation_name>_forward`` and ``<activation_name>_backward`` into the step's folder.

    Without such a subscriber it returns ``tensor`` itself (upstream raised instead), so the
    calls can stay in model code.
    """
    manager = GlobalSubscriberManager
    for sub in manager._subscribers:
        if isinstance(sub, StatisticsSubscriber):
            tensor = sub.inspect(manager.get_run_context(), activation_name, 0, tensor)
    return tensor
