"""Inference runners: a plain ORT session over the forward graph, fed through I/O binding."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from ortfx.function_names import pythonop_functions
from ortfx.model_info import PostExportProcessedModelInfo
from ortfx.options import Options
from ortfx.runtime import pythonop
from ortfx.runtime.dlpack import ort_value, to_torch
from ortfx.runtime.failures import feed_error, run_failed
from ortfx.runtime.ort import providers_for, require_ort
from ortfx.runtime.session import (
    install_aten,
    open_session,
    releases_torch_threads,
    releasing,
    serialized,
)


@attrs.frozen(eq=False)
class InferenceRunner:
    """A plain session over the forward graph, fed through I/O binding (:func:`open_inference`)."""

    info: PostExportProcessedModelInfo
    session: Any
    ort_device: Any
    session_seconds: float
    gradient_build_seconds: float = 0.0
    python_ops: bool = False  # the graph calls Python: its runs hold pythonop.RUN_LOCK
    releases_torch_threads: bool = False  # see TrainingRunner

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        binding = self.session.io_binding()._iobinding
        try:
            for spec, tensor in zip(self.info.inputs, inputs, strict=True):
                binding.bind_ortvalue_input(spec.name, ort_value(tensor))
        except Exception as e:
            raise feed_error(self.info, inputs, e) from e
        for name in self.info.output_names:
            binding.bind_output(name, self.ort_device)
        try:
            with serialized(self.python_ops), releasing(self.releases_torch_threads):
                self.session._sess.run_with_iobinding(binding, None)
        except Exception as e:
            raise run_failed("inference", inputs, e) from e
        return to_torch(binding.get_outputs())


def open_inference(
    info: PostExportProcessedModelInfo,
    device: torch.device,
    options: Options,
    *,
    deterministic: bool,
    save_prefix: str | None = None,
) -> InferenceRunner:
    """Open an inference session over ``info``'s forward graph."""
    require_ort()
    functions = pythonop_functions(info.model)
    start = time.perf_counter()
    if save_prefix:
        with open(f"{save_prefix}_execution_model_inference.onnx", "wb") as f:
            f.write(info.model)
    with serialized(bool(functions)):  # see open_training: ORT's Python function registry
        pythonop.prepare(functions)
        install_aten(info.model)
        session = open_session(
            info.model,
            device,
            options,
            training=False,
            deterministic=deterministic,
            optimized_path=f"{save_prefix}_optimized_inference.onnx" if save_prefix else None,
        )
    _, ort_device = providers_for(device)
    return InferenceRunner(
        info,
        session,
        ort_device,
        time.perf_counter() - start,
        python_ops=bool(functions),
        releases_torch_threads=releases_torch_threads(options, device),
    )
