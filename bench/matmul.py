"""ORT's matrix products (MLAS) against torch's (``torch.mm``) on the GPT-2-like model's shapes.

    python -m bench.matmul [--rounds 9] [--calls 5] [--threads 1]

The lever of issue 18 "route the products where torch is faster to torch inside the graph": one
``Gemm`` node per shape in its own ORT session (I/O binding, CPU provider, spinning off), against
``torch.mm`` on the same tensors, in one process with the two alternating round by round. Shapes
are the GPT-2-like model's (``bench.models.gpt2``: 8 x 128 tokens, width 256, MLP 1024, vocabulary
8192): each layer's forward product, and the two products of its backward (``dX = dY W`` and
``dW = dYᵀ X``, the latter with a transposed first operand, as ORT's gradient builder writes it).
The figure per shape is the minimum over rounds of the mean over ``--calls`` calls.
Results: ``bench/results/matmul-<stamp>.md``.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from pathlib import Path

import onnx
import onnxruntime as ort
import torch

from bench import common

TOKENS, WIDTH, MLP, VOCAB = 8 * 128, 256, 1024, 8192

# name: (M, K, N, transA, transB) for C[M, N] = op(A) @ op(B).
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "attention qkv forward": (TOKENS, WIDTH, 3 * WIDTH, 0, 1),
    "attention qkv dX": (TOKENS, 3 * WIDTH, WIDTH, 0, 0),
    "attention qkv dW": (3 * WIDTH, TOKENS, WIDTH, 1, 0),
    "mlp up forward": (TOKENS, WIDTH, MLP, 0, 1),
    "mlp down forward": (TOKENS, MLP, WIDTH, 0, 1),
    "mlp down dX": (TOKENS, WIDTH, MLP, 0, 0),
    "mlp down dW": (WIDTH, TOKENS, MLP, 1, 0),
    "lm head forward": (TOKENS, WIDTH, VOCAB, 0, 1),
    "lm head dX": (TOKENS, VOCAB, WIDTH, 0, 0),
    "lm head dW": (VOCAB, TOKENS, WIDTH, 1, 0),
}


def one_node_session(op: str, threads: int, **attributes: int) -> ort.InferenceSession:
    """A CPU session of one ``op`` node from inputs ``a``, ``b`` to ``c`` (spinning off)."""
    h, f32 = onnx.helper, onnx.TensorProto.FLOAT
    node = h.make_node(op, ["a", "b"], ["c"], **attributes)
    graph = h.make_graph(
        [node],
        op.lower(),
        [h.make_tensor_value_info("a", f32, None), h.make_tensor_value_info("b", f32, None)],
        [h.make_tensor_value_info("c", f32, None)],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _time(run: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def measure(rounds: int, calls: int, threads: int) -> list[tuple[str, float, float]]:
    """(shape name, ORT ms, torch ms) per shape."""
    torch.set_num_threads(threads)
    rows = []
    for name, (m, k, n, trans_a, trans_b) in SHAPES.items():
        a = torch.randn(k, m) if trans_a else torch.randn(m, k)
        b = torch.randn(n, k) if trans_b else torch.randn(k, n)
        session = one_node_session("Gemm", threads, transA=trans_a, transB=trans_b)
        binding = session.io_binding()
        binding.bind_cpu_input("a", a.numpy())
        binding.bind_cpu_input("b", b.numpy())
        binding.bind_output("c")
        left, right = (a.t() if trans_a else a), (b.t() if trans_b else b)
        run_ort = functools.partial(session.run_with_iobinding, binding)
        run_torch = functools.partial(torch.mm, left, right)
        ort_times, torch_times = [], []
        for _ in range(rounds):
            ort_times.append(_time(run_ort, calls))
            torch_times.append(_time(run_torch, calls))
        rows.append((name, min(ort_times) * 1e3, min(torch_times) * 1e3))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    common.quiet()
    rows = measure(args.rounds, args.calls, args.threads)
    total_ort, total_torch = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines = [
        f"# ORT (MLAS) against torch matrix products ({time.strftime('%Y-%m-%d')})",
        "",
        f"Machine: {common.describe(common.machine())}",
        "",
        f"Command: `python -m bench.matmul --rounds {args.rounds} --calls {args.calls} "
        f"--threads {args.threads}`; minimum over rounds of the mean of {args.calls} calls, "
        "ORT and torch alternating.",
        "",
        "| product | M | K | N | ORT ms | torch ms | ORT / torch |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {name} | {SHAPES[name][0]} | {SHAPES[name][1]} | {SHAPES[name][2]} "
            f"| {o:.2f} | {t:.2f} | {o / t:.2f} |"
            for name, o, t in rows
        ),
        f"| **all, once each** | | | | {total_ort:.1f} | {total_torch:.1f} "
        f"| {total_ort / total_torch:.2f} |",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).resolve().parent / "results" / f"matmul-{common.stamp()}.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
