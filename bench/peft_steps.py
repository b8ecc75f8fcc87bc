"""LoRA training step time: a PEFT model in PyTorch against the same model through ortfx.

    python -m bench.peft_steps [--steps 30] [--rounds 5] [--threads 1]

Models: GPT-2 with LoRA (r 8 on ``c_attn``, no dropout), tiny (2 layers, d 32, vocab 100,
batch 4 x 16) and the benchmark size (4 layers, d 256, vocab 8192, batch 8 x 128). Steps:

- ``train``: forward with labels, backward, AdamW over the adapter's parameters;
- ``dpo``: the same plus a reference forward without gradients under ``disable_adapter()``
  (the DPO-like loop of issue 30: two graphs, both found again every step).

Each of ``eager``, ``ortfx (wrap PeftModel)`` and ``ortfx (wrap base)`` is warmed up (exports),
then rounds of ``--steps`` steps alternate between them in this process; the table gives the
median step time over rounds. Results: ``bench/results/peft_steps-<stamp>.md``, with the host.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import common

SIZES = {
    "tiny": {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 100, "batch": (4, 16)},
    "4x256": {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "batch": (8, 128)},
}


def _model(size: str, wrap: str) -> tuple[Any, Any]:
    """(the module to call, the PeftModel) for ``wrap`` in eager / peft / base."""
    import peft
    import transformers

    import ortfx

    spec = dict(SIZES[size])
    spec.pop("batch")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        **spec, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False
    )
    base: torch.nn.Module = transformers.GPT2LMHeadModel(config)
    lora = peft.LoraConfig(r=8, target_modules=["c_attn"], lora_dropout=0.0)
    if wrap == "base":
        model = peft.get_peft_model(ortfx.ORTModule(base), lora)
        return model, model
    model = peft.get_peft_model(base, lora)
    return (ortfx.ORTModule(model) if wrap == "peft" else model), model


def _stepper(size: str, wrap: str, kind: str) -> tuple[Callable[[], None], Any]:
    call, model = _model(size, wrap)
    batch, length = SIZES[size]["batch"]
    vocab = int(SIZES[size]["vocab_size"])
    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        loss = call(input_ids=ids, labels=ids).loss
        if kind == "dpo":
            with torch.no_grad(), model.disable_adapter():
                reference = call(input_ids=ids, labels=ids).loss
            loss = loss + 0.0 * reference
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", default="tiny,4x256")
    a = parser.parse_args()
    common.quiet()
    torch.set_num_threads(a.threads)
    import ortfx

    host = common.describe(common.machine())
    rows = []
    for size in a.sizes.split(","):
        for kind in ("train", "dpo"):
            steppers = {w: _stepper(size, w, kind) for w in ("eager", "peft", "base")}
            for step, _ in steppers.values():
                for _ in range(3):  # exports, sessions, allocator warm-up
                    step()
            times: dict[str, list[float]] = {w: [] for w in steppers}
            for _ in range(a.rounds):
                for w, (step, _) in steppers.items():
                    start = time.perf_counter()
                    for _ in range(a.steps):
                        step()
                    times[w].append((time.perf_counter() - start) / a.steps * 1e3)
            exports = {
                w: ortfx.stats(c).exports if isinstance(c, ortfx.ORTModule) else None
                for w, (_, c) in steppers.items()
            }
            base_call = steppers["base"][1].get_base_model()
            exports["base"] = ortfx.stats(base_call).exports
            eager = common.median(times["eager"])
            rows.append(
                f"| {size} | {kind} | {eager:.2f} | {common.median(times['peft']):.2f} "
                f"({common.median(times['peft']) / eager:.2f}x, {exports['peft']} exports) | "
                f"{common.median(times['base']):.2f} "
                f"({common.median(times['base']) / eager:.2f}x, {exports['base']} exports) |"
            )
            print(rows[-1], flush=True)
    text = "\n".join(
        [
            "# LoRA step time: PyTorch against ortfx",
            "",
            f"`python -m bench.peft_steps --steps {a.steps} --rounds {a.rounds} "
            f"--threads {a.threads} --sizes {a.sizes}`",
            "",
            f"Host: {host}",
            "",
            "Median ms per step over rounds (ratio to eager; exports after all steps).",
            "",
            "| model | step | eager | ORTModule(peft_model) | get_peft_model(ORTModule(base)) |",
            "|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    out = Path("bench/results") / f"peft_steps-{common.stamp()}.md"
    out.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
