"""Hugging Face decoder LMs through ortfx: default config, default call, against the plain model.

Tiny configs built in memory (no downloads). Every test runs with fallback disabled and counts
that the forward ran in ONNX Runtime (``fallback_calls == 0``) and how many exports it took.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import cache_utils

import ortfx
from tests.models import tiny_mixtral

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)
VOCAB = 100


def _gpt2() -> torch.nn.Module:
    # dropout 0: ORT's dropout masks differ from torch's, so train-mode parity needs it off
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _decoder(config_class: Any, model_class: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        # one key/value head for two query heads: grouped-query attention, as in the real ones
        config = config_class(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64,
        )  # fmt: skip
        return model_class(config)

    return build


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "gpt2": _gpt2,
    "llama": _decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    # Mistral's default config has a sliding window: its cache layers are sliding-window layers
    "mistral": _decoder(transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": _decoder(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


def test_a_mixture_of_experts_trains_and_generates_in_ort() -> None:
    """Mixtral with grouped-mm experts: histc and _grouped_mm run in torch inside the ORT graph
    (ATen nodes, the latter with its gradient); loss, gradients and greedy tokens match."""
    import ortfx._bridge  # built by the install: fail, never skip

    torch.manual_seed(0)
    plain = tiny_mixtral()  # transformers' default experts: grouped_mm, histc
    wrapped = ortfx.ORTModule(copy.deepcopy(plain), options=STRICT)
    ids = _ids()
    _train_step(plain, wrapped, ids)
    plain.eval()
    wrapped.eval()
    a = plain.generate(ids[:, :5], max_new_tokens=4, do_sample=False, pad_token_id=0)
    b = wrapped.generate(ids[:, :5], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)
    stats = ortfx.stats(wrapped)
    assert (stats.calls, stats.exports, stats.fallback_calls) == (5, 3, 0)


def _pair(name: str) -> tuple[torch.nn.Module, ortfx.ORTModule]:
    torch.manual_seed(0)
    plain = MODELS[name]()
    return plain, ortfx.ORTModule(copy.deepcopy(plain), options=STRICT)


def _train_step(
    plain: torch.nn.Module, wrapped: torch.nn.Module, ids: torch.Tensor
) -> tuple[Any, Any]:
    """One language-model step on both; the loss and every gradient must match (loss within
    1e-5 absolute, gradients 1e-4 relative / 1e-6 absolute). Returns (plain's, wrapped's) output."""
    expected = plain(input_ids=ids, labels=ids)
    expected.loss.backward()
    got = wrapped(input_ids=ids, labels=ids)
    got.loss.backward()
    torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=1e-5)
    for (n, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)
    return expected, got


def _ids(batch: int = 2, length: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_decoder_trains_in_ort_with_its_default_cache(name: str) -> None:
    """Default config (use_cache=True in train mode too) and default call: loss and every
    gradient match the plain model, the forward ran in ORT, and the returned cache is a cache."""
    plain, wrapped = _pair(name)
    ids = _ids()
    expected, got = _train_step(plain, wrapped, ids)
    assert isinstance(got.past_key_values, cache_utils.DynamicCache)
    for a, b in zip(got.past_key_values.layers, expected.past_key_values.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-5)
        assert a.get_seq_length() == b.get_seq_length()
    stats = ortfx.stats(wrapped)
    assert (stats.exports, stats.fallback_calls) == (1, 0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_cache_as_input_runs_in_ort_and_is_changed_in_place(name: str) -> None:
    """Eval logits match, and a call given a cache runs in ORT and leaves the caller's cache
    object changed in place and returned, as PyTorch does."""
    plain, wrapped = _pair(name)
    plain.eval()
    wrapped.eval()
    ids = _ids()
    with torch.no_grad():
        expected = plain(ids)
        got = wrapped(ids)
        torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=1e-5)
        cache = got.past_key_values
        step = wrapped(ids[:, -1:], past_key_values=cache)
        plain_step = plain(ids[:, -1:], past_key_values=expected.past_key_values)
    assert step.past_key_values is cache
    assert cache.get_seq_length() == plain_step.past_key_values.get_seq_length() == 9
    torch.testing.assert_close(step.logits, plain_step.logits, rtol=0, atol=1e-5)
    stats = ortfx.stats(wrapped)
    assert (stats.calls, stats.exports, stats.fallback_calls) == (2, 2, 0)


# Decoding needs one graph for the prefill and one for every decode step; the no-cache run adds
# one more (the same one serves greedy and beam). Mistral's sliding window (4096) is never full.
EXPORTS_TO_GENERATE = 3


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generate_gives_the_plain_models_tokens(name: str) -> None:
    """Greedy and beam search, with and without the cache: the same tokens as the plain model,
    every forward in ORT, and a bounded number of exports (not one per token)."""
    plain, wrapped = _pair(name)
    plain.eval()
    wrapped.eval()
    ids = _ids(2, 5)
    new = 6
    for kwargs in (
        {},
        {"num_beams": 2},
        {"use_cache": False},
        {"num_beams": 2, "use_cache": False},
    ):
        expected = plain.generate(
            ids, max_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs
        )
        got = wrapped.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)
        assert torch.equal(got, expected), kwargs
    stats = ortfx.stats(wrapped)
    assert stats.fallback_calls == 0
    assert stats.calls == 4 * new
    assert stats.exports == EXPORTS_TO_GENERATE


def test_a_config_change_exports_again_and_saving_does_not(tmp_path: Path) -> None:
    """``model.config.output_hidden_states = True`` after the first call changes what the
    forward returns (the config is no module: ortfx compares it with a copy on each call);
    ``save_pretrained`` only records metadata (``architectures``, ``dtype``): no export."""
    torch.manual_seed(0)
    model = _gpt2()
    wrapped = ortfx.ORTModule(model, options=STRICT)
    ids = _ids()
    assert wrapped(input_ids=ids, labels=ids).hidden_states is None
    model.save_pretrained(tmp_path)
    wrapped(input_ids=ids, labels=ids)
    assert ortfx.stats(wrapped).exports == 1
    model.config.output_hidden_states = True
    got, expected = wrapped(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    assert len(got.hidden_states) == len(expected.hidden_states) == 3
    for a, b in zip(got.hidden_states, expected.hidden_states, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ortfx.stats(wrapped).exports == 2
    assert str(ortfx.explain(wrapped)[-1]) == (
        "re-export: module was version 0, now version 1 "
        "(config changed outside the wrapper ('output_hidden_states'))"
    )


def test_the_trainer_trains_in_ort_saves_and_resumes(tmp_path: Path) -> None:
    """transformers.Trainer with the wrapper as its ``model_wrapped``: the steps run in ORT,
    the loss and weights match a plain Trainer run, and a run resumed from the step-2
    checkpoint ends on the same weights."""
    import accelerate  # noqa: F401  # a test extra: fail, never skip

    torch.manual_seed(0)
    plain = _gpt2()
    model = copy.deepcopy(plain)
    rows = [{"input_ids": _ids(1, 8)[0].roll(i)} for i in range(16)]
    data = [dict(r, labels=r["input_ids"]) for r in rows]

    def trainer(module: torch.nn.Module, out: Path, wrapped: torch.nn.Module | None) -> Any:
        args = transformers.TrainingArguments(
            str(out), per_device_train_batch_size=4, max_steps=4, save_steps=2,
            report_to=[], use_cpu=True, learning_rate=1e-3, seed=0, disable_tqdm=True,
        )  # fmt: skip
        t = transformers.Trainer(model=module, args=args, train_dataset=data)
        if wrapped is not None:
            t.model_wrapped = wrapped  # the outermost model, as DDP or DeepSpeed would be
        return t

    wrapper = ortfx.ORTModule(model, options=STRICT)
    got = trainer(model, tmp_path / "ort", wrapper).train()
    expected = trainer(plain, tmp_path / "plain", None).train()
    assert got.training_loss == pytest.approx(expected.training_loss, abs=1e-5)
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-4)  # Adam amplifies 1e-7 differences
    stats = ortfx.stats(wrapper)
    assert (stats.calls, stats.exports, stats.fallback_calls) == (4, 1, 0)

    again = copy.deepcopy(plain)
    torch.nn.init.zeros_(again.lm_head.weight)  # the checkpoint must bring the weights back
    rewrapped = ortfx.ORTModule(again, options=STRICT)
    trainer(again, tmp_path / "ort", rewrapped).train(
        resume_from_checkpoint=str(tmp_path / "ort" / "checkpoint-2")
    )
    for p, q in zip(plain.parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-4)
    assert ortfx.stats(rewrapped).calls == 2
    assert ortfx.stats(rewrapped).fallback_calls == 0


def test_the_trainer_takes_the_wrapper_itself(tmp_path: Path) -> None:
    """``Trainer(model=ORTModule(model))`` (untied weights: Llama): the steps run in ORT, it
    saves the state dict and a run resumed from the step-1 checkpoint ends on the same weights
    as the uninterrupted one."""
    import accelerate  # noqa: F401  # a test extra: fail, never skip

    torch.manual_seed(0)
    plain = MODELS["llama"]()
    data = [{"input_ids": _ids(1, 8)[0].roll(i), "labels": _ids(1, 8)[0].roll(i)} for i in range(8)]

    def run(model: torch.nn.Module, resume: str | None = None) -> ortfx.ORTModule:
        wrapped = ortfx.ORTModule(model, options=STRICT)
        args = transformers.TrainingArguments(
            str(tmp_path), per_device_train_batch_size=4, max_steps=2, save_steps=1,
            report_to=[], use_cpu=True, learning_rate=1e-3, seed=0, disable_tqdm=True,
        )  # fmt: skip
        transformers.Trainer(model=wrapped, args=args, train_dataset=data).train(
            resume_from_checkpoint=resume
        )
        return wrapped

    first = run(copy.deepcopy(plain))
    assert (ortfx.stats(first).calls, ortfx.stats(first).fallback_calls) == (2, 0)
    resumed = run(copy.deepcopy(plain), resume=str(tmp_path / "checkpoint-1"))
    assert ortfx.stats(resumed).calls == 1
    for p, q in zip(first.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


def test_gradient_checkpointing_trains_in_ort_with_layer_wise_recompute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``gradient_checkpointing_enable()`` (torch.utils.checkpoint per layer) is traced as
    plain code and becomes ORT's layer-wise recompute: the same loss and gradients, in ORT."""
    torch.manual_seed(0)
    plain = MODELS["llama"]()
    options = ortfx.Options(
        fallback_policy=ortfx.FallbackPolicy.DISABLE,
        memory_opt_level=1,
        log_level=ortfx.LogLevel.INFO,
    )
    wrapped = ortfx.ORTModule(copy.deepcopy(plain), options=options)
    plain.gradient_checkpointing_enable()
    wrapped.gradient_checkpointing_enable()
    ids = _ids()
    _train_step(plain, wrapped, ids)
    assert ortfx.stats(wrapped).fallback_calls == 0
    assert "calls torch.utils.checkpoint 2 time(s)" in caplog.text
    assert "memory_opt_level 1 recomputes layer-wise" in caplog.text


class UnknownCache:
    """A cache class ortfx does not know (not a transformers Cache)."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys


class ReturnsUnknownCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        y = self.linear(x)
        return {"out": y, "past_key_values": UnknownCache(y)}


def test_an_unknown_cache_type_names_the_object_its_path_and_the_fix() -> None:
    wrapped = ortfx.ORTModule(ReturnsUnknownCache(), options=STRICT)
    with pytest.raises(ortfx.OrtfxIOError) as info:
        wrapped(torch.randn(2, 4))
    message = str(info.value)
    assert "output['past_key_values']" in message
    assert "UnknownCache" in message
    assert "use_cache=False" in message


def _t5() -> torch.nn.Module:
    config = transformers.T5Config(
        num_layers=2, d_model=32, d_ff=64, d_kv=16, num_heads=2, vocab_size=VOCAB,
        dropout_rate=0.0, decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _bart() -> torch.nn.Module:
    config = transformers.BartConfig(
        encoder_layers=2, decoder_layers=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=2, decoder_attention_heads=2, vocab_size=VOCAB,
        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        eos_token_id=VOCAB + 1,  # out of range: generation runs its full length
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


@pytest.mark.parametrize("build", [_t5, _bart], ids=["t5", "bart"])
def test_an_encoder_decoder_trains_and_generates_with_its_cache(
    build: Callable[[], torch.nn.Module],
) -> None:
    """Loss and gradients in train mode, then greedy and beam tokens with and without the
    cache (an EncoderDecoderCache in and out), all in ORT."""
    torch.manual_seed(0)
    plain = build()
    wrapped = ortfx.ORTModule(copy.deepcopy(plain), options=STRICT)
    ids = _ids()
    expected, got = _train_step(plain, wrapped, ids)
    # T5 returns an EncoderDecoderCache; BART turns the cache off itself when given labels
    assert type(got.past_key_values) is type(expected.past_key_values)
    plain.eval()
    wrapped.eval()
    for kwargs in ({}, {"num_beams": 2}, {"use_cache": False}):
        a = plain.generate(ids[:, :5], max_new_tokens=4, do_sample=False, **kwargs)
        b = wrapped.generate(ids[:, :5], max_new_tokens=4, do_sample=False, **kwargs)
        assert torch.equal(a, b), kwargs
    stats = ortfx.stats(wrapped)
    # train, then per mode of generate its decoder calls (the encoder runs once per generate
    # through model.get_encoder(), in PyTorch: transformers calls it directly)
    assert stats.fallback_calls == 0
    assert stats.calls == 1 + 3 * 4
    # train; generate: without, then with a cache; use_cache=False: a decoder of length 1,
    # then one graph for the longer ones (causal masking, which length 1 skips)
    assert stats.exports <= 5


def test_a_t5_decoder_longer_than_its_first_call_is_masked_as_in_pytorch() -> None:
    """T5's decoder skips its causal mask for one position (a branch on a size the trace
    bakes in): the graph of a length-1 call must not serve longer ones (its logits were off
    by 1.3 before the guards), and the longer lengths share one graph."""
    torch.manual_seed(0)
    plain = _t5().eval()
    wrapped = ortfx.ORTModule(copy.deepcopy(plain), options=STRICT).eval()
    encoder_ids = _ids(length=5)
    for length in (1, 2, 3, 4):
        decoder_ids = _ids(length=length) + 1
        kwargs = {"input_ids": encoder_ids, "decoder_input_ids": decoder_ids, "use_cache": False}
        expected = plain(**kwargs).logits
        got = wrapped(**kwargs).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert ortfx.stats(wrapped).exports == 2


class Base(torch.nn.Module):
    def describe(self) -> str:
        return "base"


class UsesSuper(Base):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        return out

    def describe(self) -> str:
        return "child of " + super().describe()


def test_a_user_method_calling_super_works_on_the_wrapper() -> None:
    """Methods that call zero-argument ``super()`` (Phi-3's ``prepare_inputs_for_generation``)
    run on the wrapped module, found on the wrapper's class and instance alike."""
    wrapped = ortfx.ORTModule(UsesSuper())
    assert wrapped.describe() == "child of base"
    assert type(wrapped).describe(wrapped) == "child of base"


class Predicts(torch.nn.Module):
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).argmax(-1)


class PredictsTwice(Predicts):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        return out

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        # zero-argument super(): runs on the wrapped module, whose self(...) must reach ORT
        return torch.stack([super().predict(x), self.forward(x).argmax(-1)])


def test_a_method_calling_super_runs_its_forward_calls_in_ort() -> None:
    """A ``super()``-calling method runs with the wrapped module as ``self`` (Python checks
    the class), but the module's ``self(...)`` and ``self.forward(...)`` inside it go through
    the wrapper: counted as ORT calls, with PyTorch's results; afterwards the module is as it
    was (no ``forward`` attribute left behind) and calling it directly runs PyTorch."""
    torch.manual_seed(0)
    plain = PredictsTwice()
    wrapped = ortfx.ORTModule(copy.deepcopy(plain), options=STRICT)
    x = torch.randn(5, 4)
    assert torch.equal(wrapped.predict(x), plain.predict(x))
    stats = ortfx.stats(wrapped)
    assert (stats.calls, stats.exports, stats.fallback_calls) == (2, 1, 0)
    assert "forward" not in vars(wrapped.module)
    wrapped.module(x)
    assert ortfx.stats(wrapped).calls == 2


def test_whisper_trains_and_generates_in_ort() -> None:
    """Whisper trains with parity (loss 1e-5, gradients 1e-4 relative). Its ``generate`` override calls ``super().generate``: its decoding steps now run in
    ORT (the encoder, called through ``get_encoder()``, in PyTorch as for T5), greedy and beam,
    with the plain model's tokens; two exports (prefill and decode step) after the training one."""
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=60, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=16, max_target_positions=32,
        decoder_start_token_id=1, pad_token_id=0, eos_token_id=59, bos_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None, dropout=0.0,
    )  # fmt: skip
    plain = transformers.WhisperForConditionalGeneration(config)
    wrapped = ortfx.ORTModule(copy.deepcopy(plain), options=STRICT)
    features = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    # A training step first, default call (labels shift into the decoder's inputs).
    labels = torch.randint(2, 59, (2, 6), generator=torch.Generator().manual_seed(4))
    expected_loss = plain(input_features=features, labels=labels).loss
    expected_loss.backward()
    got_loss = wrapped(input_features=features, labels=labels).loss
    got_loss.backward()
    torch.testing.assert_close(got_loss, expected_loss, rtol=0, atol=1e-5)
    for (n, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)
    plain.eval()
    wrapped.eval()
    for kwargs in ({}, {"num_beams": 2}):
        expected = plain.generate(features, max_new_tokens=5, do_sample=False, **kwargs)
        got = wrapped.generate(features, max_new_tokens=5, do_sample=False, **kwargs)
        assert torch.equal(got, expected), kwargs
    stats = ortfx.stats(wrapped)
    assert (stats.calls, stats.exports, stats.fallback_calls) == (11, 3, 0)


class HoldsAStream(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        cache = cache_utils.DynamicCache()
        cache.extra = object()  # something no graph can carry
        return {"out": x * 2, "past_key_values": cache}


def test_a_cache_holding_an_unknown_object_names_the_attribute_path() -> None:
    with pytest.raises(ortfx.OrtfxIOError) as info:
        ortfx.ORTModule(HoldsAStream(), options=STRICT)(torch.randn(2))
    message = str(info.value)
    assert "output['past_key_values'].extra has type object, inside the cache object" in message
    assert "DynamicCache" in message
    assert "use_cache=False" in message


def test_a_static_cache_is_updated_in_place_through_the_graph() -> None:
    """A StaticCache passed in is written in place (its tensors are graph inputs the graph
    updates) like in PyTorch, and generate(cache_implementation="static") gives the same
    tokens with two exports."""
    plain, wrapped = _pair("llama")
    plain.eval()
    wrapped.eval()
    ids = _ids(2, 5)
    config = plain.config
    expected_cache = transformers.StaticCache(config=config, max_cache_len=16)
    cache = transformers.StaticCache(config=config, max_cache_len=16)
    with torch.no_grad():
        expected = plain(ids, past_key_values=expected_cache)
        got = wrapped(ids, past_key_values=cache)
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=1e-5)
    assert got.past_key_values is cache
    for a, b in zip(cache.layers, expected_cache.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-5)
        assert int(a.cumulative_length) == int(b.cumulative_length) == 5
    before = ortfx.stats(wrapped).exports
    static = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    static["cache_implementation"] = "static"
    assert torch.equal(wrapped.generate(ids, **static), plain.generate(ids, **static))
    stats = ortfx.stats(wrapped)
    assert (stats.exports - before, stats.fallback_calls) == (2, 0)


def _assert_same_grads(plain: torch.nn.Module, wrapped: torch.nn.Module) -> None:
    """Every gradient within 1e-4 of the model's largest gradient entry, plus 1e-6: float32
    sums in another order, where some gradients (an attention query bias) are small
    differences of large terms."""
    grads = [p.grad for p in plain.parameters() if p.grad is not None]
    atol = 1e-4 * max(float(g.abs().max()) for g in grads) + 1e-6
    for (n, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=atol, msg=n)


def test_t5_trains_with_an_attention_mask_over_changing_sizes() -> None:
    """ORT's Where gradient never sums over broadcast axes: T5's position bias [1, heads, q, k],
    selected against the mask of every batch row, got the full [batch, ...] gradient and the
    backward failed in a Squeeze (``passes.where_gradients_reduce``). Loss within 1e-5,
    gradients 1e-4 relative, two sizes, one export."""
    torch.manual_seed(0)
    plain = _t5()
    wrapped = ortfx.ORTModule(copy.deepcopy(plain), options=STRICT)
    for batch, length in ((2, 7), (3, 5)):
        ids = _ids(batch, length)
        mask = torch.ones_like(ids)
        mask[1, length - 2 :] = 0
        labels = _ids(batch, 4)
        plain.zero_grad()
        wrapped.zero_grad()
        expected = plain(input_ids=ids, attention_mask=mask, labels=labels)
        got = wrapped(input_ids=ids, attention_mask=mask, labels=labels)
        expected.loss.backward()
        got.loss.backward()
        torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=1e-5)
        _assert_same_grads(plain, wrapped)
    stats = ortfx.stats(wrapped)
    assert (stats.exports, stats.fallback_calls) == (1, 0)


def _wav2vec2(norm: str) -> torch.nn.Module:
    config = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        feat_extract_norm=norm, do_stable_layer_norm=norm == "layer", hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0, ctc_loss_reduction="mean", ctc_zero_infinity=True,
    )  # fmt: skip
    return transformers.Wav2Vec2ForCTC(config)


def _wav2vec2_steps(plain: torch.nn.Module, wrapped: torch.nn.Module) -> None:
    labels = torch.randint(1, 12, (2, 5), generator=torch.Generator().manual_seed(2))
    for samples in (1400, 1400, 1600, 1400):
        audio = torch.randn(2, samples, generator=torch.Generator().manual_seed(samples))
        plain.zero_grad()
        wrapped.zero_grad()
        expected = plain(audio, labels=labels)
        got = wrapped(audio, labels=labels)
        expected.loss.backward()
        got.loss.backward()
        torch.testing.assert_close(got.loss, expected.loss, rtol=1e-6, atol=1e-5)
        _assert_same_grads(plain, wrapped)


@pytest.mark.parametrize("norm", ["group", "layer"])
def test_wav2vec2_ctc_trains_in_ort_with_parity(norm: str) -> None:
    """wav2vec2-CTC with either feature extractor (GroupNorm, now exported trainable; or
    LayerNorm with pre-norm layers), over audio lengths that change and repeat: loss and every
    gradient equal PyTorch's, all in ORT. Its positional convolution is a grouped 1-d Conv,
    whose ORT gradient wrote out of bounds and gave a silently wrong gradient on the first
    step at each new length (``passes.conv1d_grouped_as_2d``)."""
    torch.manual_seed(0)
    plain = _wav2vec2(norm)
    wrapped = ortfx.ORTModule(copy.deepcopy(plain), options=STRICT)
    _wav2vec2_steps(plain, wrapped)
    stats = ortfx.stats(wrapped)
    assert (stats.exports, stats.fallback_calls) == (1, 0)


def test_layerdrop_in_training_is_refused_with_the_fix(caplog: pytest.LogCaptureFixture) -> None:
    """LayerDrop draws per step whether to skip a layer and branches on it in Python: a graph
    would keep the export's draw forever (a layer always or never skipped, silently). Training
    such a model in ORT is refused, naming the setting and the fix; the default policy trains
    it in PyTorch with a warning; with ``layerdrop = 0`` it trains in ORT."""
    torch.manual_seed(0)
    model = _wav2vec2("layer")
    model.config.layerdrop = 0.1  # transformers' default for wav2vec2
    strict = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    audio, labels = torch.randn(2, 1400), torch.randint(1, 12, (2, 5))
    with pytest.raises(
        ortfx.OrtfxTorchModelError, match=r"config.layerdrop = 0.1.*layerdrop = 0.0"
    ):
        strict(audio, labels=labels)
    caplog.set_level(logging.WARNING, logger="ortfx")
    loud = ortfx.ORTModule(copy.deepcopy(model))
    loud(audio, labels=labels).loss.backward()
    assert ortfx.stats(loud).fallback_calls == 1
    assert any("LayerDrop" in r.getMessage() for r in caplog.records)
    strict.eval()  # evaluation never drops layers
    with torch.no_grad():
        strict(audio)
    strict.module.config.layerdrop = 0.0
    strict.train()
    strict(audio, labels=labels).loss.backward()
    assert ortfx.stats(strict).fallback_calls == 0


def test_sliding_window_decoding_crosses_the_window_in_three_graphs() -> None:
    """A sliding window shorter than the sequences (7): prompts below, near and above it,
    decoded past it. Every step's logits match the plain model's (1e-5), and the whole run
    takes four graphs: prefill, decode before the window is full, decode after (the layers'
    token count is fed as a tensor; the graph is keyed on "window full", what transformers
    branches on), and the step where ``max(count - window + 1, 0)`` first takes its other
    argument (a guarded comparison, one step before the window is full). Chunks of several
    tokens on a full cache share one graph too."""
    torch.manual_seed(0)
    plain = MODELS["mistral"]().eval()
    plain.config.sliding_window = 7
    wrapped = ortfx.ORTModule(copy.deepcopy(plain), options=STRICT).eval()
    for length in (3, 6, 9):
        ids = _ids(2, length)
        kwargs: dict[str, Any] = {
            "max_new_tokens": 8,
            "do_sample": False,
            "pad_token_id": 0,
            "output_logits": True,
            "return_dict_in_generate": True,
        }
        expected = plain.generate(ids, **kwargs)
        got = wrapped.generate(ids, **kwargs)
        assert torch.equal(got.sequences, expected.sequences), length
        for step, (a, b) in enumerate(zip(got.logits, expected.logits, strict=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"{length}: step {step}")
    stats = ortfx.stats(wrapped)
    assert (stats.calls, stats.exports, stats.fallback_calls) == (24, 4, 0)
    # Three new tokens at once on a full cache (chunked prefill, assisted decoding).
    ids = _ids(2, 9)
    with torch.no_grad():
        cache, plain_cache = (
            m(input_ids=ids, use_cache=True).past_key_values for m in (wrapped, plain)
        )
        more = _ids(2, 12)[:, 9:]
        got_logits = wrapped(input_ids=more, past_key_values=cache).logits
        expected_logits = plain(input_ids=more, past_key_values=plain_cache).logits
    torch.testing.assert_close(got_logits, expected_logits, rtol=0, atol=1e-5)
    assert cache.layers[0].cumulative_length == plain_cache.layers[0].cumulative_length == 12
    assert type(cache.layers[0].cumulative_length) is int
    # Called directly (other keywords than generate's): a prefill graph and a full-window one.
    assert ortfx.stats(wrapped).exports == 6
    with torch.no_grad():
        more = _ids(2, 14)[:, 12:]
        got_logits = wrapped(input_ids=more, past_key_values=cache).logits
        expected_logits = plain(input_ids=more, past_key_values=plain_cache).logits
    torch.testing.assert_close(got_logits, expected_logits, rtol=0, atol=1e-5)
    assert ortfx.stats(wrapped).exports == 6
