"""ORT's CPU gradient kernels against torch's on the benchmark models' shapes.

    python -m bench.grad_kernels [--repeats 20] [--threads 1]

Each kernel runs alone in an ORT session (one ``com.microsoft`` gradient node) and as the torch
op on the same tensors, alternating, median over rounds. ORT's time includes handing the outputs
to numpy (one allocation per output), so it slightly favours torch. Used to decide which
gradient nodes ``passes`` hands to torch through the ATen executor.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import onnx
import torch
from onnx import TensorProto, helper

from bench import common

THREADS = [1]


def _session(
    node: onnx.NodeProto | list[onnx.NodeProto],
    inputs: dict[str, list[int]],
    outputs: dict[str, list[int]],
) -> Any:
    import onnxruntime as ort

    def info(name: str, shape: list[int]) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    graph = helper.make_graph(
        node if isinstance(node, list) else [node],
        "kernel",
        [info(k, v) for k, v in inputs.items()],
        [info(k, v) for k, v in outputs.items()],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS[0]
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as ortfx
    return ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])


def _time(run: Callable[[], Any], repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats


def log_softmax_grad(repeats: int) -> tuple[str, float, float]:
    n, v = 1024, 8192  # batch 8 x 128 tokens, vocabulary 8192
    node = helper.make_node(
        "LogSoftmaxGrad_13", ["dY", "Y"], ["dX"], domain="com.microsoft", axis=1
    )
    session = _session(node, {"dY": [n, v], "Y": [n, v]}, {"dX": [n, v]})
    y = torch.log_softmax(torch.randn(n, v), 1)
    dy = torch.zeros(n, v)
    dy[torch.arange(n), torch.randint(0, v, (n,))] = -1.0 / n  # what the loss hands back
    feeds = {"dY": dy.numpy(), "Y": y.numpy()}
    op = torch.ops.aten._log_softmax_backward_data.default
    ort_s = _time(lambda: session.run(None, feeds), repeats)
    torch_s = _time(lambda: op(dy, y, 1, torch.float32), repeats)
    return "LogSoftmaxGrad [1024, 8192]", ort_s, torch_s


def layer_norm_grad(repeats: int) -> tuple[str, float, float]:
    n, d = 1024, 256
    node = helper.make_node(
        "LayerNormalizationGrad",
        ["dY", "X", "S", "M", "R"],
        ["dX", "dS", "dB"],
        domain="com.microsoft",
        axis=-1,
        epsilon=1e-5,
    )
    shapes = {"dY": [n, d], "X": [n, d], "S": [d], "M": [n, 1], "R": [n, 1]}
    session = _session(node, shapes, {"dX": [n, d], "dS": [d], "dB": [d]})
    x, w, b, dy = torch.randn(n, d), torch.randn(d), torch.randn(d), torch.randn(n, d)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [d], w, b, 1e-5)
    feeds = {"dY": dy.numpy(), "X": x.numpy(), "S": w.numpy(), "M": mean.numpy(), "R": rstd.numpy()}
    op = torch.ops.aten.native_layer_norm_backward.default
    ort_s = _time(lambda: session.run(None, feeds), repeats)
    torch_s = _time(lambda: op(dy, x, [d], mean, rstd, w, b, [True, True, True]), repeats)
    return "LayerNormalizationGrad [1024, 256]", ort_s, torch_s


def _relu_against_torch(
    nodes: list[onnx.NodeProto], label: str, repeats: int
) -> tuple[str, float, float]:
    """ORT running ``nodes`` (dY, Y -> dX) against torch's ``threshold_backward``, on the
    MLP's hidden layer: [256, 1024]."""
    shape = [256, 1024]
    session = _session(nodes, {"dY": shape, "Y": shape}, {"dX": shape})
    y, dy = torch.relu(torch.randn(*shape)), torch.randn(*shape)
    feeds = {"dY": dy.numpy(), "Y": y.numpy()}
    op = torch.ops.aten.threshold_backward.default
    ort_s = _time(lambda: session.run(None, feeds), repeats)
    torch_s = _time(lambda: op(dy, y, 0.0), repeats)
    return f"{label} [256, 1024]", ort_s, torch_s


def relu_grad(repeats: int) -> tuple[str, float, float]:
    node = helper.make_node("ReluGrad", ["dY", "Y"], ["dX"], domain="com.microsoft")
    return _relu_against_torch([node], "ReluGrad", repeats)


def relu_grad_where(repeats: int) -> tuple[str, float, float]:
    """``passes.relu_grad_passes_nan``'s form: ``Where(Y <= 0, 0, dY)``."""
    zero = helper.make_tensor("zero_value", TensorProto.FLOAT, [], [0.0])
    nodes = [
        helper.make_node("Constant", [], ["zero"], value=zero),
        helper.make_node("LessOrEqual", ["Y", "zero"], ["off"]),
        helper.make_node("Where", ["off", "zero", "dY"], ["dX"]),
    ]
    return _relu_against_torch(nodes, "LessOrEqual + Where", repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    ns = p.parse_args()
    common.quiet()
    THREADS[0] = ns.threads
    torch.set_num_threads(ns.threads)
    mach = common.machine()
    print(common.describe(mach))
    lines = ["| kernel | ORT ms | torch ms | ORT / torch |", "|---|---:|---:|---:|"]
    for bench in (log_softmax_grad, layer_norm_grad, relu_grad, relu_grad_where):
        runs = [bench(ns.repeats) for _ in range(ns.rounds)]
        ort_ms = 1e3 * common.median([r[1] for r in runs])
        torch_ms = 1e3 * common.median([r[2] for r in runs])
        lines.append(f"| {runs[0][0]} | {ort_ms:.2f} | {torch_ms:.2f} | {ort_ms / torch_ms:.2f} |")
    table = "\n".join(lines)
    print(table)
    out = common.RESULTS / f"grad_kernels-{common.stamp()}-{ns.threads}t.md"
    out.write_text(
        f"# ORT vs torch gradient kernels ({mach['date'][:10]})\n\nMachine: "
        f"{common.describe(mach)}\n\nCommand: `python -m bench.grad_kernels --threads "
        f"{ns.threads}`\n\n{ns.threads} thread(s), median over {ns.rounds} rounds of "
        f"{ns.repeats} runs.\n\n{table}\n"
    )
    print(f"results: {out}")


if __name__ == "__main__":
    main()
