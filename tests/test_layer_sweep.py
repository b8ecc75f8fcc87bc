"""Standard torch.nn layers through ortfx: never a crash; parity with PyTorch or a typed error.

Every case runs in a subprocess (``python -m tests.layer_cases``): ORT 1.19's CPU gradient
kernels kill the process on some graphs (MaxPool: SIGSEGV, AveragePool: SIGFPE, an ``If`` in
the gradient builder: SIGABRT), and no fallback can catch a signal.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import ortfx
from tests.layer_cases import CASES, TOL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The cases ORT 1.19 (CPU) cannot train, and the operator each error must name. Every other
# case must match PyTorch. docs/index.md shows this table.
UNSUPPORTED = {
    "ConvTranspose1d": "ConvTranspose",
    "ConvTranspose2d": "ConvTranspose",
    "ConvTranspose3d": "ConvTranspose",
    "AvgPool3d": "AveragePool",
    "LPPool1d": "Sign",
    "LPPool2d": "Sign",
    "AdaptiveAvgPool2d": "adaptive_avg_pool2d",  # the torch exporter refuses dynamic sizes
    "AdaptiveMaxPool1d": "GlobalMaxPool",
    "AdaptiveMaxPool2d-global": "GlobalMaxPool",
    "AdaptiveMaxPool2d": "adaptive_max_pool2d",
    "Upsample-nearest": "Resize",
    "Upsample-bilinear": "Resize",
    "Upsample-size": "Resize",
    "ReflectionPad2d": "Pad",
    "ReplicationPad2d": "Pad",
    "PixelShuffle": "DepthToSpace",
    "LocalResponseNorm": "AveragePool",
    "EmbeddingBag": "Loop",
    "embedding_bag-computed-table": "Loop",
    "RNN": "RNN",
    "LSTM-2layer-bidir": "LSTM",
}


def _run_worker(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.layer_cases", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def sweep(names: list[str]) -> dict[str, dict[str, Any]]:
    """Each case's record; a case during which the worker died is a ``crash`` (with the exit
    code), and the worker starts again on the cases after it."""
    results: dict[str, dict[str, Any]] = {}
    pending = list(names)
    while pending:
        proc = _run_worker(pending)
        started = None
        for line in proc.stdout.splitlines():
            if line.startswith("START "):
                started = line.removeprefix("START ")
            elif line.startswith("RESULT "):
                record = json.loads(line.removeprefix("RESULT "))
                results[record["case"]] = record
                started = None
        if started is not None:
            results[started] = {"case": started, "status": "crash", "rc": proc.returncode}
        left = [n for n in pending if n not in results]
        if left and started is None:  # died outside any case: nothing to attribute
            raise AssertionError(f"worker failed ({proc.returncode}): {proc.stderr[-3000:]}")
        pending = left
    return results


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return sweep(list(CASES))


def test_no_layer_crashes_the_process(results: dict[str, dict[str, Any]]) -> None:
    """No case kills the interpreter (the worker ran every case to its RESULT line)."""
    crashes = {n: r["rc"] for n, r in results.items() if r["status"] == "crash"}
    assert crashes == {}


def test_every_layer_matches_pytorch_or_names_the_operator(
    results: dict[str, dict[str, Any]],
) -> None:
    """Supported layers: outputs and gradients within TOL of eager PyTorch at two input sizes.
    Unsupported ones: a typed ortfx error (never a raw one) that names the ONNX operator."""
    assert set(results) == set(CASES)
    for name, record in results.items():
        if name in UNSUPPORTED:
            assert record["status"] == "error", record
            assert record["type"] in ("OrtfxUnsupportedOpError", "OrtfxExportError"), record
            assert UNSUPPORTED[name] in record["message"], record
        else:
            assert record["status"] == "parity", record
            assert record["max_diff"] <= TOL


def test_pooling_sessions_are_built_per_size_and_reused(
    results: dict[str, dict[str, Any]],
) -> None:
    """Sizes 0, 1, 0: a pooling graph gets one training session per input size (the third
    call reuses the first); a graph without such kernels keeps one session for all sizes."""
    assert results["MaxPool2d"]["sessions"] == 2
    assert results["AvgPool2d"]["sessions"] == 2
    assert results["Conv2d"]["sessions"] == 1


def test_pooling_cnn_trains_with_parity_over_steps_and_sizes() -> None:
    """Conv/BatchNorm/MaxPool2d/AvgPool2d CNN, 6 SGD steps alternating two image and batch
    sizes: parameters, buffers and losses match PyTorch; one export, one session per size."""
    proc = _run_worker(["--train-cnn"])
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    record = json.loads(line.removeprefix("RESULT "))
    assert record["max_diff"] <= TOL
    assert (record["exports"], record["sessions"]) == (1, 2)


def _transpose() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.ConvTranspose2d(4, 2, 3))


def test_default_policy_falls_back_naming_the_operator(caplog: pytest.LogCaptureFixture) -> None:
    """An operator ORT cannot differentiate: the default policy runs the call in PyTorch (same
    results) and warns naming the operator and the node."""
    model = _transpose()
    reference = _transpose()
    wrapped = ortfx.ORTModule(model)
    x = torch.randn(2, 3, 6, 6)
    with caplog.at_level(logging.WARNING, logger="ortfx"):
        y = wrapped(x)
    y.sum().backward()
    reference(x).sum().backward()
    assert torch.equal(y, reference(x))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING)
    text = warning.getMessage()
    assert "falling back to PyTorch (policy UNSUPPORTED_ONNX_MODEL allows it)" in text
    assert "OrtfxUnsupportedOpError" in text
    assert "cannot train operator ConvTranspose (node /module/module.1/ConvTranspose)" in text
    assert ortfx.stats(wrapped).fallback is not None


def test_fallback_disabled_raises_naming_the_operator() -> None:
    options = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
    wrapped = ortfx.ORTModule(_transpose(), options=options)
    with pytest.raises(ortfx.OrtfxUnsupportedOpError) as info:
        wrapped(torch.randn(2, 3, 6, 6))
    assert isinstance(info.value, ortfx.OrtfxExportError)
    assert (info.value.op, info.value.node) == ("ConvTranspose", "/module/module.1/ConvTranspose")
    assert "let ortfx fall back to PyTorch: the default policy does" in str(info.value)


def test_inference_of_an_untrainable_operator_still_runs_in_ort() -> None:
    """Only the gradient is missing: under no_grad the graph runs in ORT and matches."""
    options = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
    model = _transpose()
    wrapped = ortfx.ORTModule(model, options=options)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        assert (wrapped(x) - _transpose()(x)).abs().max() <= TOL


# ---- the passes behind it, on hand-built graphs ------------------------------------------------


def _if_graph(condition_from_shape: bool) -> Any:
    """x (user input), w (parameter) -> If(cond) over x * w; cond from x's shape or values."""
    from onnx import TensorProto as T
    from onnx import helper as h

    from ortfx.model_info import InputKind, InputSpec, PostExportProcessedModelInfo
    from ortfx.schema import ModelSchema

    x = torch.zeros(2, 3)
    nodes = [h.make_node("Mul", ["x", "w"], ["xw"], name="mul")]
    if condition_from_shape:
        nodes.append(h.make_node("Shape", ["x"], ["s"], name="shape"))
        nodes.append(h.make_node("ReduceSum", ["s"], ["n"], name="sum"))
    else:
        nodes.append(h.make_node("ReduceSum", ["x"], ["n"], name="sum"))
    nodes.append(h.make_node("Cast", ["n"], ["cond"], name="cast", to=T.BOOL))
    then = h.make_graph(
        [h.make_node("Identity", ["xw"], ["t"])],
        "then",
        [],
        [h.make_tensor_value_info("t", 1, None)],
    )
    other = h.make_graph(
        [h.make_node("Neg", ["xw"], ["e"])], "else", [], [h.make_tensor_value_info("e", 1, None)]
    )
    nodes.append(
        h.make_node("If", ["cond"], ["y"], name="the_if", then_branch=then, else_branch=other)
    )
    graph = h.make_graph(
        nodes,
        "g",
        [
            h.make_tensor_value_info("x", T.FLOAT, ["x_dim0", "x_dim1"]),
            h.make_tensor_value_info("w", T.FLOAT, [3]),
        ],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    schema = ModelSchema.from_call((x,), {})
    return PostExportProcessedModelInfo(
        model=model.SerializeToString(),
        inputs=(
            InputSpec("x", InputKind.USER, 0),
            InputSpec("w", InputKind.PARAMETER, "w", requires_grad=True),
        ),
        input_schema=schema,
        output_schema=schema,
        output_names=("y",),
    )


def test_value_dependent_if_on_the_gradient_path_is_refused_before_the_build() -> None:
    """ORT's gradient builder aborts on it: a typed error naming the node, never the build."""
    from ortfx import passes

    with pytest.raises(ortfx.OrtfxUnsupportedOpError) as info:
        passes.refuse_unsafe_gradients(_if_graph(condition_from_shape=False))
    assert (info.value.op, info.value.node) == ("If", "the_if")
    assert "depends on tensor values" in str(info.value)


def test_shape_only_if_gets_concrete_sizes_instead() -> None:
    """A shape-only condition is folded by ORT once sizes are concrete: marked, then pinned."""
    import onnx

    from ortfx import passes

    info = passes.mark_static_sizes(_if_graph(condition_from_shape=True))
    assert info.static_size_ops == ("If",)
    assert passes.refuse_unsafe_gradients(info) is info
    assert info.user_sizes([torch.zeros(2, 3)]) == ((2, 3),)
    pinned = onnx.load_model_from_string(passes.pin_sizes(((2, 3),))(info).model)
    dims = [[d.dim_value for d in v.type.tensor_type.shape.dim] for v in pinned.graph.input]
    assert dims == [[2, 3], [3]]
