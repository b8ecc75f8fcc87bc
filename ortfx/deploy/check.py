"""The written file in ONNX Runtime: optimized on request, run in fresh CPU sessions on each
checked call, compared with PyTorch's outputs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ortfx.deploy.names import tensor_names
from ortfx.deploy.tracing import first_line, numpy
from ortfx.errors import OrtfxVerificationError
from ortfx.runtime.ort import ort
from ortfx.schema import ModelSchema

MISMATCH = (
    "ONNX Runtime's outputs of {path} differ from {module}'s own PyTorch eval outputs for "
    "{which}: {details} (tolerance: |difference| <= {atol:g} + {rtol:g} * |expected|). Nothing "
    "was written to {target}. If the differences are rounding, pass a larger atol/rtol; if "
    "they are not, the trace did not capture the forward (a branch or a value taken from a "
    "tensor): check the export's warnings."
)
RUN_FAILED = (
    "ONNX Runtime could not {which} the file written for {module}: {error}. "
    "Nothing was written to {target}."
)


def optimized(written: str, module: str, target: str) -> str:
    """ORT's extended graph optimizations of ``written``, saved beside it."""
    stem = os.path.basename(written).removesuffix(".onnx")
    file = os.path.join(os.path.dirname(written), stem + ".optimized.onnx")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = file
    if os.path.exists(written + ".data"):
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name",
            os.path.basename(file) + ".data",
        )
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
        )
    try:
        ort.InferenceSession(written, options, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise OrtfxVerificationError(
            RUN_FAILED.format(module=module, which="optimize", error=first_line(e), target=target)
        ) from e
    return file


def feeds(
    leaves: Sequence[Any], schema: ModelSchema, inputs: tuple[str, ...]
) -> dict[str, np.ndarray[Any, Any]]:
    """The session's feeds for a call's ``leaves``: its tensors under the graph's names (those
    of ``inputs``: the exporter leaves out inputs the graph does not read)."""
    tensors = [leaves[i] for i in schema.tensor_indices()]
    pairs = zip(tensor_names(schema), tensors, strict=True)
    return {n: numpy(t) for n, t in pairs if n in inputs}


def verify(
    file: str,
    module: str,
    calls: Sequence[tuple[str, dict[str, np.ndarray[Any, Any]]]],
    expected: Sequence[Sequence[np.ndarray[Any, Any]]],
    target: str,
    atol: float,
    rtol: float,
) -> tuple[tuple[str, float], ...]:
    """Run ``file`` in a fresh CPU session on each call's feeds; per output, the largest
    difference from PyTorch's; raise :class:`OrtfxVerificationError` beyond the tolerance."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(file, options, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise OrtfxVerificationError(
            RUN_FAILED.format(module=module, which="load", error=first_line(e), target=target)
        ) from e
    names = [o.name for o in session.get_outputs()]
    worst = dict.fromkeys(names, 0.0)
    for (which, feed), reference in zip(calls, expected, strict=True):
        try:
            got = session.run(names, feed)
        except Exception as e:
            raise OrtfxVerificationError(
                RUN_FAILED.format(
                    module=module, which=f"run on {which}", error=first_line(e), target=target
                )
            ) from e
        bad = []
        for name, actual, wanted in zip(names, got, reference, strict=True):
            difference, within = _compare(np.asarray(actual), wanted, atol, rtol)
            worst[name] = max(worst[name], difference)
            if not within:
                bad.append(f"{name}: max |difference| {difference:.3g}")
        if bad:
            raise OrtfxVerificationError(
                MISMATCH.format(
                    path=os.path.basename(file),
                    module=module,
                    which=which,
                    details="; ".join(bad),
                    atol=atol,
                    rtol=rtol,
                    target=target,
                )
            )
    return tuple(worst.items())


def _compare(
    actual: np.ndarray[Any, Any], wanted: np.ndarray[Any, Any], atol: float, rtol: float
) -> tuple[float, bool]:
    """The largest ``|actual - wanted|`` (inf for other shapes, or NaN against a number) and
    whether every element is within ``atol + rtol * |wanted|``."""
    if actual.shape != wanted.shape:
        return float("inf"), False
    if actual.size == 0:
        return 0.0, True
    a, w = actual.astype(np.float64), wanted.astype(np.float64)
    both_nan = np.isnan(a) & np.isnan(w)
    same = (a == w) | both_nan  # equal infinities too
    difference = np.where(same, 0.0, np.abs(a - w))
    difference = np.where(np.isnan(difference), np.inf, difference)
    return float(difference.max()), bool((difference <= atol + rtol * np.abs(w)).all())
