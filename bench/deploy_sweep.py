"""Which transformers architectures ``ortfx.export_for_inference`` writes and checks (tiny configs).

Run with ``python -m bench.deploy_sweep [--only gpt2,t5]``. The architectures and configs of
``bench.hf_sweep``, each in its own process. Per architecture, the graphs a deployment needs,
each checked by ``export_for_inference`` itself in a fresh ONNX Runtime session against the
plain model, on the example and on a second call of other sizes:

- decoder LMs: ``nocache`` (``use_cache=False``), ``prefill`` (``use_cache=True``, the new cache
  as outputs), ``decode`` (one new token with a past cache as inputs);
- encoder-decoders (Whisper too): ``nocache`` and ``decode`` (decoder tokens with an
  ``EncoderDecoderCache``);
- encoders and wav2vec2: ``nocache``.

Mixture-of-experts models are exported after ``model.set_experts_implementation("batched_mm")``:
their default grouped_mm experts run ``histc`` and ``torch._grouped_mm``, which ONNX cannot
express (``export_for_inference`` says so and names this fix).

Writes ``bench/results/deploy_sweep-<date>.md`` and prints the table.
"""

from __future__ import annotations

import datetime
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.hf_sweep import ARCHITECTURES, NO_DROPOUT, SMALL, setting, sweep

FORMS = ("nocache", "prefill", "decode")
# Mixture-of-experts models, exported with transformers' batched_mm experts (docs/deploy.md).
MIXTURES = frozenset({"mixtral", "qwen2_moe"})


def _calls(name: str, kind: str, model: Any) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """form -> (the example call, a second call of other sizes), as keyword arguments."""
    import torch

    def ids(batch: int, length: int) -> Any:
        return torch.randint(3, 100, (batch, length))

    def ones(batch: int, length: int) -> Any:
        return torch.ones(batch, length, dtype=torch.long)

    def past(call: dict[str, Any]) -> Any:
        with torch.no_grad():
            return model.eval()(**call, use_cache=True).past_key_values

    if name == "wav2vec2_ctc":
        return {"nocache": ({"input_values": torch.randn(2, 1600)},
                            {"input_values": torch.randn(3, 2000)})}  # fmt: skip
    if name == "whisper":

        def heard(batch: int, done: int, new: int) -> dict[str, Any]:
            features = torch.randn(batch, 8, 32)
            cache = past({"input_features": features, "decoder_input_ids": ids(batch, done)})
            return {"input_features": features, "decoder_input_ids": ids(batch, new),
                    "past_key_values": cache, "use_cache": True}  # fmt: skip

        return {
            "nocache": (
                {"input_features": torch.randn(2, 8, 32), "decoder_input_ids": ids(2, 3),
                 "use_cache": False},
                {"input_features": torch.randn(3, 8, 32), "decoder_input_ids": ids(3, 5),
                 "use_cache": False},
            ),
            "decode": (heard(2, 3, 1), heard(3, 5, 2)),
        }  # fmt: skip
    if kind == "encoder":
        return {"nocache": ({"input_ids": ids(2, 7), "attention_mask": ones(2, 7)},
                            {"input_ids": ids(3, 11), "attention_mask": ones(3, 11)})}  # fmt: skip

    if kind == "seq2seq":

        def step(batch: int, source: int, done: int, new: int) -> dict[str, Any]:
            encoder = {"input_ids": ids(batch, source), "attention_mask": ones(batch, source)}
            cache = past({**encoder, "decoder_input_ids": ids(batch, done)})
            return {**encoder, "decoder_input_ids": ids(batch, new), "past_key_values": cache,
                    "use_cache": True}  # fmt: skip

        return {
            "nocache": (
                {"input_ids": ids(2, 7), "attention_mask": ones(2, 7),
                 "decoder_input_ids": ids(2, 3), "use_cache": False},
                {"input_ids": ids(3, 9), "attention_mask": ones(3, 9),
                 "decoder_input_ids": ids(3, 5), "use_cache": False},
            ),
            "decode": (step(2, 7, 3, 1), step(3, 9, 5, 2)),
        }  # fmt: skip

    def decode(batch: int, done: int, new: int) -> dict[str, Any]:
        cache = past({"input_ids": ids(batch, done), "attention_mask": ones(batch, done)})
        return {"input_ids": ids(batch, new), "attention_mask": ones(batch, done + new),
                "past_key_values": cache, "use_cache": True}  # fmt: skip

    return {
        "nocache": ({"input_ids": ids(2, 7), "attention_mask": ones(2, 7), "use_cache": False},
                    {"input_ids": ids(3, 11), "attention_mask": ones(3, 11), "use_cache": False}),
        "prefill": ({"input_ids": ids(2, 7), "attention_mask": ones(2, 7), "use_cache": True},
                    {"input_ids": ids(3, 11), "attention_mask": ones(3, 11), "use_cache": True}),
        "decode": (decode(2, 6, 1), decode(3, 4, 2)),
    }  # fmt: skip


def check(name: str) -> dict[str, Any]:
    """Export every form of one architecture; per form the largest difference or the error."""
    import torch
    import transformers

    import ortfx

    config_name, model_name, overrides, kind = ARCHITECTURES[name]
    config = getattr(transformers, config_name)(**{**SMALL, **NO_DROPOUT, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    result: dict[str, Any] = {"name": name, "kind": kind}
    if name in MIXTURES:  # their default grouped_mm experts run ops ONNX cannot express
        model.set_experts_implementation("batched_mm")
        result["kind"] = f"{kind} (batched_mm experts)"
    with tempfile.TemporaryDirectory() as directory:
        for form, (example, other) in _calls(name, kind, model).items():
            start = time.perf_counter()
            try:
                record = ortfx.export_for_inference(
                    model, (), Path(directory) / f"{form}.onnx", example, check_inputs=[other]
                )
                result[form] = (
                    f"{record.max_difference:.1e} ({len(record.inputs)} in, "
                    f"{len(record.outputs)} out, {time.perf_counter() - start:.1f} s)"
                )
            except Exception as error:  # the sweep reports every failure
                text = str(error).strip().splitlines()[0] if str(error).strip() else ""
                result[form] = f"**no**: {type(error).__name__}: {text}"[:240]
    return result


def render(results: list[dict[str, Any]]) -> str:
    lines = ["| architecture | kind | " + " | ".join(FORMS) + " |", "|---|---|---|---|---|"]
    for r in results:
        cells = [str(r.get(f, "n/a" if "failed" not in r else r.get("error", ""))) for f in FORMS]
        row = " | ".join(c.replace("|", "/") for c in cells)
        lines.append(f"| {r['name']} | {r.get('kind', '')} | {row} |")
    return "\n".join(lines)


def main() -> None:
    results = sweep(__doc__, check)
    head = (
        f"# export_for_inference over transformers architectures ({datetime.date.today()})\n\n"
        f"{setting()}. Each cell: the largest difference between ONNX Runtime and PyTorch over "
        "the example and a call of other sizes (checked by export_for_inference itself), "
        "inputs, outputs, seconds.\n\n"
    )
    table = render(results)
    out = Path("bench/results") / f"deploy_sweep-{datetime.date.today():%Y%m%d}.md"
    out.write_text(head + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
