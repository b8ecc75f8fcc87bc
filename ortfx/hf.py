"""``ORTTrainer``: transformers' ``Trainer`` with the model's forward and backward in ORT.

The Trainer keeps the plain model in ``trainer.model`` and its outermost wrapper (DDP,
DeepSpeed) in ``trainer.model_wrapped``, wrapping at one place, ``_wrap_model``. ``ORTTrainer``
wraps there with :class:`ortfx.ORTModule`, so that everything the Trainer does with
``trainer.model`` (``save_pretrained`` checkpoints, PEFT adapters, loading on resume, the
forward signature for ``remove_unused_columns``) is exactly what the plain Trainer does.
Importing this module imports ``transformers``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import transformers

from ortfx.options import LogLevel, Options
from ortfx.runtime.api import options_of, stats
from ortfx.runtime.module import ORTModule

__all__ = ["ORTSeq2SeqTrainer", "ORTTrainer"]

logger = logging.getLogger("ortfx")

BOTH_GIVEN = (
    "ORTTrainer was given an ORTModule and ortfx_options: pass the plain model with "
    "ortfx_options=..., or the wrapper alone (ortfx.configure(wrapper, ...) changes its options)."
)
OUTER_WRAPPER = (
    "ORTTrainer: the Trainer wrapped the model in %s, which ortfx cannot wrap: the model runs "
    "in PyTorch. Use one process without DataParallel (ortfx trains on one device)."
)
MIXED_PRECISION = (
    "ORTTrainer: mixed precision (%s) is accelerate's autocast around the model's forward, "
    "which the Trainer applies only to a model it prepares itself; ORTTrainer's model is "
    "wrapped by ortfx instead and computes in its parameters' dtype. ONNX Runtime 1.19 has no "
    "bf16/fp16 training kernels for CPU; train in float32."
)


class _ORTTrainerMixin:
    """What ``ORTTrainer`` adds to a ``transformers.Trainer`` subclass (see :class:`ORTTrainer`)."""

    # Attributes the Trainer defines (declared for mypy; transformers is untyped here).
    model: torch.nn.Module
    model_wrapped: torch.nn.Module
    args: transformers.TrainingArguments

    def __init__(self, *args: Any, ortfx_options: Options | None = None, **kwargs: Any) -> None:
        model = kwargs.get("model", args[0] if args else None)
        wrapper: ORTModule | None = None
        if isinstance(model, ORTModule):  # the user wrapped it already: train the plain model
            if ortfx_options is not None:
                raise TypeError(BOTH_GIVEN)
            wrapper = model
            if "model" in kwargs:
                kwargs["model"] = model.module
            else:
                args = (model.module, *args[1:])
        # INFO: each export, re-export and fallback is one log line, as it happens.
        default = Options(log_level=LogLevel.INFO) if wrapper is None else options_of(wrapper)
        self.ortfx_options = ortfx_options or default
        self._ortfx_wrapper = wrapper
        super().__init__(*args, **kwargs)
        mixed = "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else None
        if mixed is not None:
            logger.warning(MIXED_PRECISION, mixed)

    @property
    def ortfx_model(self) -> ORTModule | None:
        """The ``ORTModule`` that runs ``self.model`` (None before the first train/evaluate)."""
        return self._ortfx_wrapper

    def _wrap_model(
        self, model: torch.nn.Module, training: bool = True, dataloader: Any = None
    ) -> torch.nn.Module:
        if isinstance(model, ORTModule):
            return model  # ours, from an earlier train() (model_wrapped)
        outer: torch.nn.Module = super()._wrap_model(  # type: ignore[misc]
            model, training=training, dataloader=dataloader
        )
        if outer is not model:
            logger.warning(OUTER_WRAPPER, type(outer).__name__)
            return outer
        wrapper = self._ortfx_wrapper
        if wrapper is None or wrapper.module is not model:
            wrapper = ORTModule(model, options=self.ortfx_options)
            self._ortfx_wrapper = wrapper
        return wrapper

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: torch.nn.Module | None = None
    ) -> None:
        # Load into the plain model, as the plain Trainer does; the wrapper reads its
        # parameters on every call.
        if isinstance(model, ORTModule):
            model = model.module
        super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log, plus ortfx's counters: exports and calls run in PyTorch."""
        if self._ortfx_wrapper is not None:
            counters = stats(self._ortfx_wrapper)
            logs = {
                **logs,
                "ortfx_exports": float(counters.exports),
                "ortfx_fallback_calls": float(counters.fallback_calls),
            }
        super().log(logs, start_time)  # type: ignore[misc]


class ORTTrainer(_ORTTrainerMixin, transformers.Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` whose model's forward and backward run in ONNX Runtime.

    A drop-in: same arguments, same checkpoints (``save_pretrained`` folders, PEFT adapters),
    same ``resume_from_checkpoint``. ``ortfx_options=ortfx.Options(...)`` sets the wrapper's
    options (default: ``Options(log_level=LogLevel.INFO)``, one log line per transition);
    ``trainer.ortfx_model`` is the wrapper, for ``ortfx.stats`` and ``ortfx.explain``. The
    Trainer's logs gain ``ortfx_exports`` and ``ortfx_fallback_calls``.
    """


class ORTSeq2SeqTrainer(_ORTTrainerMixin, transformers.Seq2SeqTrainer):  # type: ignore[misc]
    """``transformers.Seq2SeqTrainer`` with ORTTrainer's behaviour. Its
    ``predict_with_generate`` calls ``trainer.model.generate`` on the plain model, so that
    generation runs in PyTorch; training and loss evaluation run in ONNX Runtime."""
