"""Which transformers architectures train, evaluate and generate through ortfx (tiny configs).

Run with ``python -m bench.hf_sweep [--only gpt2,llama]``. Each architecture runs in its own
process (a crash in one cannot end the sweep), with fallback disabled, default config (dropout
off for parity) and the default call: ``model(**batch, labels=...)`` in train mode, then eval
logits, then ``generate`` (greedy) for generative models. Every check is against the plain
model. Writes ``bench/results/hf_sweep-<date>.md`` and prints the table.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import multiprocessing
import platform
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

SMALL: dict[str, Any] = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 64,
}
NO_DROPOUT = {
    k: 0.0
    for k in (
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "dropout",
        "attention_dropout",
        "activation_dropout",
        "dropout_rate",
        "hidden_dropout",
        "classifier_dropout",
        "summary_first_dropout",
        "final_dropout",
        "feat_proj_dropout",
        "layerdrop",  # a random branch per layer: ortfx refuses it in training (see docs)
    )
}

# name -> (config class, model class, config overrides, kind)
# kind: "lm" (decoder LM: train with labels, generate), "seq2seq" (labels, generate),
# "encoder" (masked LM with labels), "audio" (features and labels; whisper also generates)
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}, "lm"),
    "gpt_neo": (
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        {"attention_types": [[["global", "local"], 1]], "num_layers": 2},
        "lm",
    ),
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 64, "word_embed_proj_dim": 32}, "lm"),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"n_head": 2}, "lm"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 1}, "lm"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 1}, "lm"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 1}, "lm"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"num_key_value_heads": 1, "head_dim": 16}, "lm"),
    "phi": ("PhiConfig", "PhiForCausalLM", {}, "lm"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}, "lm"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16, "num_key_value_heads": 1}, "lm"),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"head_dim": 16, "num_key_value_heads": 1},
        "lm",
    ),
    "falcon": ("FalconConfig", "FalconForCausalLM", {}, "lm"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, "lm"),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_key_value_heads": 1, "num_local_experts": 4, "num_experts_per_tok": 2},
        "lm",
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_key_value_heads": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
        "lm",
    ),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        {"d_ff": 64, "d_kv": 16, "num_decoder_layers": 2, "decoder_start_token_id": 0},
        "seq2seq",
    ),
    "bart": (
        "BartConfig",
        "BartForConditionalGeneration",
        {
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64,
            "decoder_attention_heads": 2,
        },
        "seq2seq",
    ),
    "bert": ("BertConfig", "BertForMaskedLM", {}, "encoder"),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", {"pad_token_id": 1}, "encoder"),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        {"dim": 32, "hidden_dim": 64, "n_heads": 2, "n_layers": 2},
        "encoder",
    ),
    "electra": ("ElectraConfig", "ElectraForMaskedLM", {"embedding_size": 32}, "encoder"),
    "wav2vec2_ctc": (
        "Wav2Vec2Config",
        "Wav2Vec2ForCTC",
        {
            "conv_dim": (32, 32),
            "conv_stride": (5, 2),
            "conv_kernel": (10, 3),
            "num_conv_pos_embeddings": 16,
            "num_conv_pos_embedding_groups": 2,
            "vocab_size": 32,
            "mask_time_prob": 0.0,
        },
        "audio",
    ),
    "whisper": (
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        {
            "d_model": 32,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "encoder_attention_heads": 2,
            "decoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64,
            "num_mel_bins": 8,
            "max_source_positions": 16,
            "max_target_positions": 32,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "decoder_start_token_id": 1,
        },
        "audio",
    ),
}


def _close(a: Any, b: Any, tol: float) -> float:
    diff = float((a.detach() - b.detach()).abs().max())
    if not diff <= tol:
        raise AssertionError(f"differs by {diff:.2e} (tolerance {tol:.0e})")
    return diff


def check(name: str) -> dict[str, Any]:
    """Run one architecture's checks; return what passed and the first failure."""
    import torch
    import transformers

    import ortfx

    config_name, model_name, overrides, kind = ARCHITECTURES[name]
    config = getattr(transformers, config_name)(**{**SMALL, **NO_DROPOUT, **overrides})
    torch.manual_seed(0)
    plain = getattr(transformers, model_name)(config)
    model = copy.deepcopy(plain)
    strict = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
    wrapped = ortfx.ORTModule(model, options=strict)
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    batch: dict[str, Any] = {"input_ids": ids, "labels": ids}
    if name == "wav2vec2_ctc":
        batch = {"input_values": torch.randn(2, 1600), "labels": ids[:, :5] % 31 + 1}
    elif name == "whisper":
        batch = {"input_features": torch.randn(2, 8, 32), "labels": ids}
    result: dict[str, Any] = {"name": name, "kind": kind}
    stage = "train"
    try:
        expected = plain(**batch)
        expected.loss.backward()
        got = wrapped(**batch)
        got.loss.backward()
        result["loss_diff"] = _close(got.loss, expected.loss, 1e-4)
        # 1e-3, plus 1e-5 of the tensor's largest entry (a CTC loss summed over frames has
        # gradients in the hundreds, where float32 order alone moves the third decimal)
        result["grad_diff"] = max(
            _close(q.grad, p.grad, 1e-3 + 1e-5 * float(p.grad.abs().max()))
            for p, q in zip(plain.parameters(), model.parameters(), strict=True)
            if p.grad is not None
        )
        result["train"] = True
        stage = "eval"
        plain.eval()
        wrapped.eval()
        with torch.no_grad():
            result["logits_diff"] = _close(wrapped(**batch).logits, plain(**batch).logits, 1e-4)
        result["eval"] = True
        if kind in ("lm", "seq2seq") or name == "whisper":
            stage = "generate"
            prompt: dict[str, Any] = (
                {"input_features": batch["input_features"]}
                if name == "whisper"
                else {"input_ids": ids[:, :5]}
            )
            a = plain.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
            before = ortfx.stats(wrapped).calls
            b = wrapped.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
            if not torch.equal(a, b):
                raise AssertionError(f"tokens differ: {a.tolist()} vs {b.tolist()}")
            # a generate() that calls super() runs on the wrapped module: in PyTorch
            result["generate"] = "yes" if ortfx.stats(wrapped).calls > before else "in PyTorch"
        stats = ortfx.stats(wrapped)
        result["exports"] = stats.exports
        result["calls"] = stats.calls
        if stats.fallback_calls:
            raise AssertionError(f"{stats.fallback_calls} call(s) fell back")
    except Exception as error:  # the sweep reports every failure
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
        result["failed"] = stage
        result["error"] = f"{type(error).__name__}: {text}"[:300]
        result["trace"] = traceback.format_exc()[-1500:]
    return result


def _child(name: str, queue: Any, checker: Any) -> None:
    queue.put(checker(name))


def run_one(name: str, timeout: float, checker: Any = check) -> dict[str, Any]:
    """``checker(name)`` (a module-level function) in a process of its own."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_child, args=(name, queue, checker))
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        return {"name": name, "failed": "timeout", "error": f"more than {timeout:.0f} s"}
    if queue.empty():
        return {"name": name, "failed": "crash", "error": f"exit code {process.exitcode}"}
    result: dict[str, Any] = queue.get()
    return result


_NO_GENERATE = frozenset(n for n, a in ARCHITECTURES.items() if a[3] == "encoder") | {
    "wav2vec2_ctc"
}


def _mark(result: dict[str, Any], stage: str) -> str:
    if isinstance(result.get(stage), str):
        return str(result[stage])
    if result.get(stage):
        return "yes"
    if result.get("failed") == stage:
        return "**no**"
    return "-"


def render(results: list[dict[str, Any]]) -> str:
    lines = [
        "| architecture | kind | train (loss, grads) | eval logits | generate (greedy) | "
        "exports | first failure |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['name']} | {r.get('kind', '')} | {_mark(r, 'train')} | {_mark(r, 'eval')} | "
            f"{_mark(r, 'generate') if r.get('name') not in _NO_GENERATE else 'n/a'} | "
            f"{r.get('exports', '')} | {r.get('error', '').replace('|', '/')} |"
        )
    return "\n".join(lines)


def sweep(description: str | None, checker: Any) -> list[dict[str, Any]]:
    """The command line (``--only``, ``--timeout``), and ``checker`` run on each architecture
    in a process of its own, each result printed as a JSON line."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--only", default="", help="comma-separated architecture names")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(ARCHITECTURES)
    results = []
    for name in names:
        result = run_one(name, args.timeout, checker)
        print(json.dumps({k: v for k, v in result.items() if k != "trace"}), flush=True)
        results.append(result)
    return results


def setting() -> str:
    """The command, machine, versions and commit of a sweep, for a results file's header."""
    import torch
    import transformers

    return (
        f"`{' '.join(sys.argv)}` on {platform.machine()} {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, commit "
        f"{_commit()}; tiny configs (2 layers, d 32, vocab 100), dropout off"
    )


def main() -> None:
    results = sweep(__doc__, check)
    head = (
        f"# transformers architectures through ortfx ({datetime.date.today()})\n\n"
        f"{setting()}, fallback disabled, each against the plain model.\n\n"
    )
    table = render(results)
    out = Path("bench/results") / f"hf_sweep-{datetime.date.today():%Y%m%d}.md"
    out.write_text(head + table + "\n")
    (out.with_suffix(".jsonl")).write_text("\n".join(json.dumps(r) for r in results) + "\n")
    print(table)


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
