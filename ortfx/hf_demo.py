"""A Hugging Face decoder LM trained and then generating through ortfx, beside the plain model.

Run with ``python -m ortfx.hf_demo [--model llama|gpt2|qwen2|mistral] [--steps N]``. The model
is built from a tiny config (no download), wrapped as is (default config: ``use_cache=True``,
grouped-query attention) and trained on a toy task (continue a counting sequence). Every forward,
the decoding steps of ``generate`` included, runs in ONNX Runtime: the run ends with ortfx's
counters and the tokens of both models.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import torch

import ortfx

VOCAB = 64


def build(name: str) -> torch.nn.Module:
    import transformers

    if name == "gpt2":
        config: Any = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    config_class, model_class = classes[name]
    config = config_class(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
    )  # fmt: skip
    model: torch.nn.Module = model_class(config)
    return model


def batch(step: int, size: int = 16, length: int = 12) -> torch.Tensor:
    """Counting sequences modulo the vocabulary, from random starts."""
    starts = torch.randint(0, VOCAB, (size, 1), generator=torch.Generator().manual_seed(step))
    return (starts + torch.arange(length)) % VOCAB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama", choices=("llama", "gpt2", "qwen2", "mistral"))
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.manual_seed(0)
    plain = build(args.model)
    wrapped = ortfx.ORTModule(copy.deepcopy(plain))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (plain, wrapped.module)]
    print(f"training {type(plain).__name__} for {args.steps} steps: plain PyTorch | ortfx")
    start = time.perf_counter()
    for step in range(args.steps):
        ids = batch(step)
        losses = []
        models: tuple[torch.nn.Module, ...] = (plain, wrapped)
        for model, optimizer in zip(models, optimizers, strict=True):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"  step {step:3d}  loss {losses[0]:.4f} | {losses[1]:.4f}")
    print(f"  ({time.perf_counter() - start:.1f} s for both)")
    plain.eval()
    wrapped.eval()
    prompt = batch(10_000, size=2, length=4)
    for label, kwargs in (("greedy", {}), ("beam search (3 beams)", {"num_beams": 3})):
        generate_plain: Any = plain.generate  # transformers' GenerationMixin, untyped here
        expected = generate_plain(prompt, max_new_tokens=8, do_sample=False, **kwargs)
        got = wrapped.generate(prompt, max_new_tokens=8, do_sample=False, **kwargs)
        same = torch.equal(got, expected)
        print(f"{label}: plain {expected[0].tolist()}")
        print(f"{' ' * len(label)}  ortfx {got[0].tolist()}  same tokens: {same}")
    stats = ortfx.stats(wrapped)
    print(
        f"ortfx: {stats.calls} forward calls in ONNX Runtime ({stats.fallback_calls} in "
        f"PyTorch), {stats.exports} exports (train, prefill, decode step)"
    )
    for transition in ortfx.explain(wrapped):
        print(f"  {transition}")


if __name__ == "__main__":
    main()
