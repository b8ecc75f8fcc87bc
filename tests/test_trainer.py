"""transformers' Trainer with ortfx, and ``ortfx.hf.ORTTrainer``, each against the plain Trainer.

Tiny GPT-2 (tied embeddings, dropout 0) built in memory, 16 rows, 4 steps; fallback disabled,
so every step that passes ran in ONNX Runtime. Checkpoints are compared file by file with the
plain Trainer's: the same names, the same tensors, the same adapter config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import accelerate  # test extras: fail, never skip
import peft
import pytest
import safetensors.torch
import torch
import transformers

import ortfx
from ortfx.hf import ORTSeq2SeqTrainer, ORTTrainer

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
LORA_TARGETS = ["c_attn"]


def _gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _lora(base: torch.nn.Module) -> Any:
    # No task_type: PEFT records the base class in adapter_config.json's auto_mapping.
    torch.manual_seed(1)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=LORA_TARGETS))


def _data() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 100, (16, 8), generator=torch.Generator().manual_seed(1))
    # attention_mask and an extra column: remove_unused_columns (on by default) keeps what the
    # real model's forward takes and drops "source".
    return [
        {"input_ids": r, "labels": r, "attention_mask": torch.ones_like(r), "source": i}
        for i, r in enumerate(ids)
    ]


def _args(out: Path) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        str(out), per_device_train_batch_size=4, max_steps=4, save_steps=2, logging_steps=1,
        report_to=[], use_cpu=True, learning_rate=1e-3, seed=0, disable_tqdm=True,
    )  # fmt: skip


def _losses(trainer: transformers.Trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def _plain(model: torch.nn.Module, out: Path) -> transformers.Trainer:
    trainer = transformers.Trainer(model=model, args=_args(out), train_dataset=_data())
    trainer.train()
    return trainer


def _same_checkpoint(got: Path, expected: Path) -> None:
    """Same files; same tensors in the weights; same configs."""
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in expected.iterdir())
    for weights in ("model.safetensors", "adapter_model.safetensors"):
        if (expected / weights).exists():
            a = safetensors.torch.load_file(got / weights)
            b = safetensors.torch.load_file(expected / weights)
            assert a.keys() == b.keys()
            for k in b:
                torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-4)  # Adam amplifies 1e-7
    if (expected / "adapter_config.json").exists():
        a = json.loads((got / "adapter_config.json").read_text())
        b = json.loads((expected / "adapter_config.json").read_text())
        assert a == b


def test_the_trainer_given_a_wrapped_tied_weight_model_saves_it_pretrained(
    tmp_path: Path,
) -> None:
    """``Trainer(model=ORTModule(gpt2))``: the Trainer sees a PreTrainedModel (isinstance
    answers as for the wrapped module), so its checkpoint is a save_pretrained folder, and
    GPT-2's tied embeddings no longer fail safetensors' "Some tensors share memory"; the
    losses are the plain Trainer's."""
    wrapped = ortfx.ORTModule(_gpt2(), options=STRICT)
    assert isinstance(wrapped, transformers.PreTrainedModel)
    assert type(wrapped).__name__ == "ORTModule" and repr(wrapped).startswith("ORTModule(")
    got = transformers.Trainer(model=wrapped, args=_args(tmp_path / "ort"), train_dataset=_data())
    got.train()
    expected = _plain(_gpt2(), tmp_path / "plain")
    assert _losses(got) == pytest.approx(_losses(expected), abs=1e-4)
    stats = ortfx.stats(wrapped)
    assert (stats.calls, stats.fallback_calls) == (4, 0)
    _same_checkpoint(tmp_path / "ort" / "checkpoint-2", tmp_path / "plain" / "checkpoint-2")
    assert (tmp_path / "ort" / "checkpoint-2" / "config.json").exists()


@pytest.mark.parametrize("order", ["ORTModule(peft_model)", "get_peft_model(ORTModule(base))"])
def test_the_trainer_given_a_wrapped_peft_model_keeps_the_columns_and_saves_the_adapter(
    order: str, tmp_path: Path
) -> None:
    """The Trainer given a PEFT model wrapped either way, with the default
    ``remove_unused_columns``: it reads the base model's forward signature (before, for
    ``ORTModule(peft_model)``: the wrapper's ``(*args, **kwargs)`` emptied every batch);
    checkpoints hold the adapter only, with ``base_model_name_or_path`` and ``auto_mapping``
    as the plain run writes them (before, wrapping the base: no name, and the class ORTModule),
    and AutoPeftModel loads them."""
    _gpt2().save_pretrained(tmp_path / "base")  # a name_or_path, as a Hub model has

    def base() -> torch.nn.Module:
        return transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")

    if order == "ORTModule(peft_model)":
        model = ortfx.ORTModule(_lora(base()), options=STRICT)
        wrapper = model
    else:
        wrapper = ortfx.ORTModule(base(), options=STRICT)
        model = _lora(wrapper)
    got = transformers.Trainer(model=model, args=_args(tmp_path / "ort"), train_dataset=_data())
    got.train()
    expected = _plain(_lora(base()), tmp_path / "plain")
    assert _losses(got) == pytest.approx(_losses(expected), abs=1e-4)
    assert (ortfx.stats(wrapper).calls, ortfx.stats(wrapper).fallback_calls) == (4, 0)
    checkpoint = tmp_path / "ort" / "checkpoint-2"
    _same_checkpoint(checkpoint, tmp_path / "plain" / "checkpoint-2")
    assert not (checkpoint / "model.safetensors").exists()
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    assert config["auto_mapping"]["base_model_class"] == "GPT2LMHeadModel"
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(checkpoint)
    assert type(loaded.get_base_model()).__name__ == "GPT2LMHeadModel"


@pytest.mark.parametrize("kind", ["gpt2", "lora"])
def test_ort_trainer_is_the_trainer_with_the_steps_in_ort(kind: str, tmp_path: Path) -> None:
    """The same script with ``Trainer`` -> ``ORTTrainer``: the same logged losses, the same
    checkpoint layout and tensors (save_pretrained folder; the adapter alone for PEFT), the
    plain model in ``trainer.model``, every step in ORT, ortfx's counters in the logs."""

    def model() -> torch.nn.Module:
        return _gpt2() if kind == "gpt2" else _lora(_gpt2())

    got = ORTTrainer(
        model=model(), args=_args(tmp_path / "ort"), train_dataset=_data(), ortfx_options=STRICT
    )
    got.train()
    expected = _plain(model(), tmp_path / "plain")
    assert _losses(got) == pytest.approx(_losses(expected), abs=1e-4)
    assert type(got.model) is type(expected.model)  # the Trainer keeps the plain model
    wrapper = got.ortfx_model
    assert wrapper is not None and got.model_wrapped is wrapper and wrapper.module is got.model
    stats = ortfx.stats(wrapper)
    assert (stats.calls, stats.exports, stats.fallback_calls) == (4, 1, 0)
    assert got.state.log_history[0]["ortfx_exports"] == 1
    for step in (2, 4):
        _same_checkpoint(
            tmp_path / "ort" / f"checkpoint-{step}", tmp_path / "plain" / f"checkpoint-{step}"
        )


def test_ort_trainer_resumes_as_the_trainer_does(tmp_path: Path) -> None:
    """``train(resume_from_checkpoint=...)`` from step 2 logs the uninterrupted run's losses
    for steps 3 and 4 and ends on its weights; the checkpoint is loaded into the plain model,
    which the wrapper reads on every call."""
    first = ORTTrainer(
        model=_gpt2(), args=_args(tmp_path), train_dataset=_data(), ortfx_options=STRICT
    )
    first.train()
    fresh = _gpt2()
    torch.nn.init.zeros_(fresh.lm_head.weight)  # the checkpoint must bring the weights back
    resumed = ORTTrainer(model=fresh, args=_args(tmp_path), train_dataset=_data())
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    # The history holds steps 1-2 from the checkpoint's trainer_state.json, then 3-4 anew.
    assert _losses(resumed) == pytest.approx(_losses(first), abs=1e-4)
    for p, q in zip(first.model.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-4)
    assert resumed.ortfx_model is not None
    assert ortfx.stats(resumed.ortfx_model).calls == 2


def test_ort_trainer_given_a_wrapper_trains_its_module_with_its_options(tmp_path: Path) -> None:
    """An ``ORTModule`` given to ORTTrainer is used as the wrapper and its module as the
    Trainer's model; options given twice are refused."""
    wrapped = ortfx.ORTModule(_gpt2(), options=STRICT)
    with pytest.raises(TypeError, match="ortfx_options"):
        ORTTrainer(model=wrapped, args=_args(tmp_path), ortfx_options=STRICT)
    trainer = ORTTrainer(model=wrapped, args=_args(tmp_path), train_dataset=_data())
    assert trainer.model is wrapped.module
    trainer.train()
    assert trainer.ortfx_model is wrapped
    assert ortfx.stats(wrapped).calls == 4
    trainer.evaluate(_data()[:4])  # the same wrapper evaluates: one more graph, no new wrapper
    assert trainer.ortfx_model is wrapped and ortfx.stats(wrapped).exports == 2


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_peft_generate_through_the_wrapper_decodes_in_ort(task_type: str | None) -> None:
    """``ORTModule(peft_model).generate(...)``: PEFT's generate calls the base model's, whose
    steps call the base model; ortfx routes them through the wrapper, so every step runs the
    adapters' graph in ORT (before: all of it in PyTorch, nothing logged). Greedy, beam and
    no-cache tokens equal the plain PeftModel's, and so do they with the adapter disabled."""
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4, target_modules=LORA_TARGETS, task_type=task_type, init_lora_weights=False
    )
    model = peft.get_peft_model(_gpt2(), config).eval()
    wrapped = ortfx.ORTModule(model, options=STRICT)
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(3))
    new = 6

    def both(**kwargs: Any) -> None:
        kwargs.update(max_new_tokens=new, do_sample=False, pad_token_id=0)
        expected = model.generate(input_ids=ids, **kwargs)
        assert torch.equal(wrapped.generate(input_ids=ids, **kwargs), expected), kwargs

    for kwargs in ({}, {"num_beams": 2}, {"use_cache": False}):
        both(**kwargs)
    with model.disable_adapter():
        both()
    stats = ortfx.stats(wrapped)
    assert (stats.calls, stats.fallback_calls) == (4 * new, 0)
    assert model.get_base_model().forward.__func__ is type(model.get_base_model()).forward


def test_ort_seq2seq_trainer_is_the_seq2seq_trainer_with_the_steps_in_ort(tmp_path: Path) -> None:
    """``Seq2SeqTrainer`` -> ``ORTSeq2SeqTrainer`` on a tiny T5: the same logged losses and
    evaluation loss, every call in ORT (the training graph, then the eval graph)."""

    def t5() -> torch.nn.Module:
        torch.manual_seed(0)
        config = transformers.T5Config(
            num_layers=2, d_model=32, d_ff=64, d_kv=16, num_heads=2, vocab_size=100,
            dropout_rate=0.0, decoder_start_token_id=0,
        )  # fmt: skip
        return transformers.T5ForConditionalGeneration(config)

    ids = torch.randint(1, 100, (8, 6), generator=torch.Generator().manual_seed(2))
    data = [{"input_ids": r, "labels": r.flip(0)} for r in ids]

    def run(cls: Any, out: Path, **kwargs: Any) -> tuple[list[float], float, Any]:
        args = transformers.Seq2SeqTrainingArguments(
            str(out), per_device_train_batch_size=4, max_steps=2, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, learning_rate=1e-3, seed=0,
            disable_tqdm=True,
        )  # fmt: skip
        trainer = cls(model=t5(), args=args, train_dataset=data, **kwargs)
        trainer.train()
        evaluation = trainer.evaluate(data[:4])["eval_loss"]
        return _losses(trainer), evaluation, trainer

    got_losses, got_eval, got = run(ORTSeq2SeqTrainer, tmp_path / "ort", ortfx_options=STRICT)
    losses, evaluation, _ = run(transformers.Seq2SeqTrainer, tmp_path / "plain")
    assert got_losses == pytest.approx(losses, abs=1e-4)
    assert got_eval == pytest.approx(evaluation, abs=1e-4)
    stats = ortfx.stats(got.ortfx_model)
    assert (stats.calls, stats.exports, stats.fallback_calls) == (3, 2, 0)


def test_accelerate_prepares_trains_and_saves_the_wrapper(tmp_path: Path) -> None:
    """accelerate with ``ORTModule(gpt2)``: ``prepare`` keeps the wrapper (one process, no
    DDP), ``backward`` and ``save_model`` work, and losses and the saved tensors (tied
    weights stored once) equal the plain model's run."""
    ids = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(1))
    losses: dict[str, list[float]] = {}
    wrapper = ortfx.ORTModule(_gpt2(), options=STRICT)
    for name, module in (("ort", wrapper), ("plain", _gpt2())):
        accelerator = accelerate.Accelerator(cpu=True)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(module, optimizer)
        assert model is module
        losses[name] = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
        accelerator.save_model(model, tmp_path / name)
    assert losses["ort"] == pytest.approx(losses["plain"], abs=1e-4)
    assert (ortfx.stats(wrapper).calls, ortfx.stats(wrapper).fallback_calls) == (3, 0)
    _same_checkpoint(tmp_path / "ort", tmp_path / "plain")
