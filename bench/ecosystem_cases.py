"""The cases of ``bench.ecosystem_sweep``: each trains (or saves, or exports) through ortfx and
through eager with the same script, and records what differed in a :class:`Probe`.

A case is ``case(probe, steps)``; :data:`CASES` names them with their library. Every model is
tiny and built from a config (nothing is downloaded), with fixed seeds and dropout off.

The vision cases train, beside eager and ortfx, ``NOISE_COPIES`` more eager copies whose weights
are scaled by ``1 + 1e-7 * N(0, 1)``: their largest difference from eager ("noise") is what
float32 rounding alone does to that model over those steps. It is not always small. A ReLU
input within rounding of zero passes or stops its gradient depending on the last bit: in
torchvision's resnet18 (seed 0, SGD 1e-3) the second step has such an input (2.4e-7 against
values up to 7.6, after layer1.0's residual add), and half of the noisy copies take one side,
half the other, with conv1's gradient 2e-3 apart either way. A numeric check therefore passes
within ``atol + rtol * max|eager|`` or within ``NOISE_FACTOR`` times the noise.

Each vision model trains at the largest of SGD 1e-2, 1e-3, 1e-4 at which its noise stays near
float32's scale for the six steps; beyond it, rounding alone grows from step to step (timm's
EfficientNet-B0 from random init has gradients near 60: at 1e-3 its noisy copies' losses are
6 % apart by the sixth step, and so is ortfx's), and no comparison could tell a defect.
"""

from __future__ import annotations

import copy
import functools
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

NOISE = 1e-7  # relative weight noise of the noisy copies: float32's rounding, about
NOISE_COPIES = 4
NOISE_FACTOR = 2.0
VOCAB = 64  # tests.models.tiny_gpt2's


class Probe:
    """What one case measures: numeric and yes/no checks against eager, the wrappers whose
    counters say where the calls ran, step times, and ortfx's WARNING lines while it ran."""

    def __init__(self) -> None:
        self.numbers: dict[str, dict[str, Any]] = {}
        self.facts: list[dict[str, Any]] = []
        self.wrappers: list[Any] = []
        self.times: dict[str, list[float]] = {"eager": [], "ortfx": []}
        self.warnings: list[str] = []
        self.expect_fallback = False
        self.notes: list[str] = []

    def close(
        self, what: str, got: Any, expected: Any, *, atol: float, rtol: float = 0.0,
        noise: Sequence[Any] = (),
    ) -> None:  # fmt: skip
        """Compare tensors (or floats, dicts or sequences of them); ``noise``: the noisy copies'
        values. Called again with the same ``what`` (every step), the largest difference,
        magnitude and noise are kept."""
        entry = self.numbers.setdefault(
            what, {"diff": 0.0, "scale": 0.0, "atol": atol, "rtol": rtol, "noise": None}
        )
        entry["diff"] = max(entry["diff"], max_abs_diff(got, expected))
        entry["scale"] = max(entry["scale"], _max_abs(expected))
        for copy_values in noise:
            entry["noise"] = max(entry["noise"] or 0.0, max_abs_diff(copy_values, expected))

    def holds(self, what: str, ok: bool, detail: str) -> None:
        self.facts.append({"what": what, "ok": bool(ok), "detail": detail})

    def watch(self, wrapper: Any) -> Any:
        self.wrappers.append(wrapper)
        return wrapper

    def timed(self, side: str, step: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = step()
        self.times[side].append(time.perf_counter() - start)
        return result


def tolerance(entry: dict[str, Any]) -> tuple[float, bool]:
    """(the tolerance of a numeric check, whether the noise set it)."""
    fixed = float(entry["atol"] + entry["rtol"] * entry["scale"])
    noisy = NOISE_FACTOR * (entry["noise"] or 0.0)
    return max(fixed, noisy), noisy > fixed


def _leaves(x: Any) -> list[Any]:
    import torch

    if isinstance(x, dict):
        return [v for k in sorted(x) for v in _leaves(x[k])]
    if isinstance(x, list | tuple):
        return [v for item in x for v in _leaves(item)]
    return [torch.as_tensor(x).detach().double()]


def max_abs_diff(got: Any, expected: Any) -> float:
    pairs = list(zip(_leaves(got), _leaves(expected), strict=True))
    for a, b in pairs:
        if a.shape != b.shape:
            raise AssertionError(f"shapes differ: {tuple(a.shape)} against {tuple(b.shape)}")
    return max((float((a - b).abs().max()) for a, b in pairs if a.numel()), default=0.0)


def _max_abs(x: Any) -> float:
    return max((float(t.abs().max()) for t in _leaves(x) if t.numel()), default=0.0)


# ---- shared builders ----------------------------------------------------------------------------


def _gpt2() -> Any:
    """The tests' GPT-2: 2 layers, d 32, vocab ``VOCAB``, tied embeddings, no dropout."""
    import torch

    from tests.models import tiny_gpt2

    torch.manual_seed(0)
    return tiny_gpt2()


def _ids(batch: int, length: int, seed: int = 1) -> Any:
    import torch

    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _grads(model: Any) -> dict[str, Any]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _close_grads(probe: Probe, got: dict[str, Any], expected: dict[str, Any], **tol: Any) -> None:
    if got.keys() != expected.keys():
        raise AssertionError(f"gradients of {sorted(got)} against eager's {sorted(expected)}")
    probe.close("grads", got, expected, **tol)


# ---- PEFT ---------------------------------------------------------------------------------------


def _peft(probe: Probe, steps: int, order: str) -> None:
    """LoRA on a tiny GPT-2 (two adapters, non-zero), wrapped per ``order``: DPO-like steps
    (the policy's loss and gradients, a reference pass under ``disable_adapter()``), then
    ``set_adapter``, ``generate()`` and ``save_pretrained`` against the same PeftModel eager."""
    import peft
    import torch
    import transformers

    import ortfx

    with tempfile.TemporaryDirectory() as tmp:
        _gpt2().save_pretrained(f"{tmp}/base")  # a name_or_path, as a Hub model has

        def base() -> Any:
            return transformers.GPT2LMHeadModel.from_pretrained(f"{tmp}/base")

        lora = peft.LoraConfig(
            r=4, target_modules=["c_attn"], lora_dropout=0.0, init_lora_weights=False
        )
        torch.manual_seed(1)
        reference = peft.get_peft_model(base(), copy.deepcopy(lora))
        reference.add_adapter("second", copy.deepcopy(lora))
        if order == "ORTModule(peft_model)":
            peft_model = peft.get_peft_model(base(), copy.deepcopy(lora))
            model = wrapper = ortfx.ORTModule(peft_model)
        else:
            wrapper = ortfx.ORTModule(base())
            model = peft_model = peft.get_peft_model(wrapper, copy.deepcopy(lora))
        peft_model.add_adapter("second", copy.deepcopy(lora))
        peft_model.load_state_dict(reference.state_dict())
        probe.watch(wrapper)
        ids = _ids(4, 16)

        def dpo_step(call: Any, owner: Any, optimizer: Any) -> tuple[Any, Any, dict[str, Any]]:
            policy = call(input_ids=ids, labels=ids)
            with torch.no_grad(), owner.disable_adapter():
                frozen = call(input_ids=ids).logits
            policy.loss.backward()
            grads = _grads(owner)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return policy.loss.detach(), frozen, grads

        def adam(m: Any) -> Any:
            return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)

        optimizers = (adam(reference), adam(peft_model))
        for _ in range(steps):
            loss, frozen, grads = probe.timed(
                "eager", lambda: dpo_step(reference, reference, optimizers[0])
            )
            got_loss, got_frozen, got_grads = probe.timed(
                "ortfx", lambda: dpo_step(model, peft_model, optimizers[1])
            )
            probe.close("loss", got_loss, loss, atol=1e-5)
            probe.close("disable_adapter() logits", got_frozen, frozen, atol=1e-5)
            _close_grads(probe, got_grads, grads, atol=1e-5, rtol=1e-4)
        exports = ortfx.stats(wrapper).exports
        probe.holds("DPO-like loop exports", exports == 2, f"{exports} after {steps} steps")
        probe.holds(
            "gradients", all("lora_" in n for n in grads), f"{len(grads)} tensors, all LoRA's"
        )
        with torch.no_grad():
            for m in (reference, peft_model):
                m.set_adapter("second")
            probe.close(
                "set_adapter('second') logits",
                model(input_ids=ids).logits,
                reference(input_ids=ids).logits,
                atol=1e-5,
            )
            for m in (reference, peft_model):
                m.set_adapter("default")
        reference.eval()
        model.eval()
        prompt = {"input_ids": ids[:2, :5], "max_new_tokens": 6, "do_sample": False}
        expected = reference.generate(**prompt, pad_token_id=0)
        before = ortfx.stats(wrapper).calls
        generated = model.generate(**prompt, pad_token_id=0)
        same = torch.equal(generated, expected)
        probe.holds("generate() tokens", same, "equal" if same else f"{generated.tolist()}")
        in_ort = ortfx.stats(wrapper).calls - before
        probe.holds("generate() steps in ORT", in_ort == 6, f"{in_ort} calls")
        reference.save_pretrained(f"{tmp}/eager")
        peft_model.save_pretrained(f"{tmp}/ortfx")
        configs = [json.loads(Path(f"{tmp}/{s}/adapter_config.json").read_text())
                   for s in ("ortfx", "eager")]  # fmt: skip
        named = configs[0].get("base_model_name_or_path")
        kept = named == f"{tmp}/base"
        probe.holds(
            "adapter_config.json",
            configs[0] == configs[1] and kept,
            f"{'equal' if configs[0] == configs[1] else 'unequal'} to eager's, "
            f"base_model_name_or_path {'kept' if kept else repr(named)}",
        )
        _same_weights(
            probe, "saved adapter", *(Path(tmp, s, "adapter_model.safetensors")
                                      for s in ("ortfx", "eager"))
        )  # fmt: skip


# ---- transformers' Trainer, accelerate ----------------------------------------------------------


def _trainer_args(out: str, steps: int, **more: Any) -> Any:
    import transformers

    cls = more.pop("cls", transformers.TrainingArguments)
    return cls(
        out, per_device_train_batch_size=4, max_steps=steps, logging_steps=1, report_to=[],
        use_cpu=True, learning_rate=1e-3, seed=0, disable_tqdm=True, **more,
    )  # fmt: skip


def _lm_data(rows: int) -> list[dict[str, Any]]:
    import torch

    return [{"input_ids": r, "labels": r, "attention_mask": torch.ones_like(r)}
            for r in _ids(rows, 8)]  # fmt: skip


def _step_timer(probe: Probe, side: str) -> Any:
    """A TrainerCallback timing each optimizer step (forward, backward, optimizer)."""
    import transformers

    class StepTimer(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            probe.times[side].append(time.perf_counter() - self.start)

    return StepTimer()


def _logged_losses(trainer: Any) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def _same_weights(probe: Probe, what: str, got: Path, expected: Path) -> None:
    import safetensors.torch

    a, b = (safetensors.torch.load_file(p) for p in (got, expected))
    probe.holds(f"{what} file", a.keys() == b.keys(), f"{got.name}, {len(a)} tensors as eager's")
    probe.close(what, a, b, atol=1e-4)  # Adam turns 1e-7 into 1e-5 here and there


def _trainer_gpt2(probe: Probe, steps: int) -> None:
    """``transformers.Trainer`` -> ``ORTTrainer``, same script: logged losses, the checkpoint
    (safetensors, tied weights), and a resume from the middle checkpoint."""
    import transformers

    from ortfx.hf import ORTTrainer

    half = max(1, steps // 2)
    data = _lm_data(4 * steps)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for side, cls in (("eager", transformers.Trainer), ("ortfx", ORTTrainer)):
            args = _trainer_args(f"{tmp}/{side}", steps, save_steps=half)
            runs[side] = cls(model=_gpt2(), args=args, train_dataset=data,
                             callbacks=[_step_timer(probe, side)])  # fmt: skip
            runs[side].train()
        probe.watch(runs["ortfx"].ortfx_model)
        probe.close("logged losses", _logged_losses(runs["ortfx"]),
                    _logged_losses(runs["eager"]), atol=1e-4)  # fmt: skip
        last = f"checkpoint-{steps}/model.safetensors"
        _same_weights(
            probe, "checkpoint tensors", Path(tmp, "ortfx", last), Path(tmp, "eager", last)
        )
        fresh = _gpt2()
        fresh.lm_head.weight.data.zero_()  # the checkpoint must bring the weights back
        resumed = ORTTrainer(model=fresh, args=_trainer_args(f"{tmp}/ortfx", steps,
                             save_steps=half), train_dataset=data)  # fmt: skip
        resumed.train(resume_from_checkpoint=f"{tmp}/ortfx/checkpoint-{half}")
        probe.watch(resumed.ortfx_model)
        probe.close("resumed losses", _logged_losses(resumed), _logged_losses(runs["ortfx"]),
                    atol=1e-4)  # fmt: skip
        probe.close("resumed weights", list(fresh.parameters()),
                    list(runs["ortfx"].model.parameters()), atol=1e-4)  # fmt: skip


def _trainer_t5(probe: Probe, steps: int) -> None:
    """``Seq2SeqTrainer`` -> ``ORTSeq2SeqTrainer`` on a tiny T5: logged losses, eval loss."""
    import torch
    import transformers

    from bench.hf_sweep import ARCHITECTURES, NO_DROPOUT, SMALL
    from ortfx.hf import ORTSeq2SeqTrainer

    def t5() -> Any:  # the transformers sweep's: 2 layers, d 32, vocab 100, dropout off
        config_name, model_name, overrides, _ = ARCHITECTURES["t5"]
        torch.manual_seed(0)
        config = getattr(transformers, config_name)(**{**SMALL, **NO_DROPOUT, **overrides})
        return getattr(transformers, model_name)(config)

    data = [{"input_ids": r, "labels": r.flip(0)} for r in _ids(4 * steps, 6, seed=2)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side, cls in (("eager", transformers.Seq2SeqTrainer), ("ortfx", ORTSeq2SeqTrainer)):
            args = _trainer_args(f"{tmp}/{side}", steps, save_strategy="no",
                                 cls=transformers.Seq2SeqTrainingArguments)  # fmt: skip
            trainer = cls(model=t5(), args=args, train_dataset=data,
                          callbacks=[_step_timer(probe, side)])  # fmt: skip
            trainer.train()
            results[side] = (_logged_losses(trainer), trainer.evaluate(data[:8])["eval_loss"])
            if side == "ortfx":
                probe.watch(trainer.ortfx_model)
    probe.close("logged losses", results["ortfx"][0], results["eager"][0], atol=1e-4)
    probe.close("eval loss", results["ortfx"][1], results["eager"][1], atol=1e-4)


def _trainer_peft(probe: Probe, steps: int) -> None:
    """``transformers.Trainer(model=ORTModule(peft_model))`` against the Trainer given the
    PeftModel: losses, and checkpoints that hold the adapter alone."""
    import peft
    import torch
    import transformers

    import ortfx

    data = _lm_data(4 * steps)
    with tempfile.TemporaryDirectory() as tmp:
        _gpt2().save_pretrained(f"{tmp}/base")
        losses = {}
        for side in ("eager", "ortfx"):
            torch.manual_seed(1)
            model = peft.get_peft_model(
                transformers.GPT2LMHeadModel.from_pretrained(f"{tmp}/base"),
                peft.LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0),
            )
            if side == "ortfx":
                model = probe.watch(ortfx.ORTModule(model))
            trainer = transformers.Trainer(
                model=model, args=_trainer_args(f"{tmp}/{side}", steps, save_steps=steps),
                train_dataset=data, callbacks=[_step_timer(probe, side)],
            )  # fmt: skip
            trainer.train()
            losses[side] = _logged_losses(trainer)
        probe.close("logged losses", losses["ortfx"], losses["eager"], atol=1e-4)
        folders = [Path(tmp, side, f"checkpoint-{steps}") for side in ("ortfx", "eager")]
        names = [sorted(p.name for p in f.iterdir()) for f in folders]
        probe.holds(
            "adapter only",
            names[0] == names[1] and "model.safetensors" not in names[0],
            "same files as eager's, no model.safetensors",
        )
        _same_weights(probe, "adapter tensors", *(f / "adapter_model.safetensors" for f in folders))
        config = json.loads((folders[0] / "adapter_config.json").read_text())
        named = config.get("base_model_name_or_path") == f"{tmp}/base"
        probe.holds("base_model_name_or_path", named, "kept" if named else "lost")


def _accelerate(probe: Probe, steps: int) -> None:
    """``Accelerator().prepare(ORTModule(gpt2), optimizer)``: steps as eager (losses,
    gradients), ``accelerator.save_model`` as eager's (tied weights stored once)."""
    import accelerate
    import torch

    import ortfx

    ids = _ids(4, 8)
    sides = {"eager": _gpt2(), "ortfx": probe.watch(ortfx.ORTModule(_gpt2()))}
    prepared = {}
    for side, module in sides.items():
        accelerator = accelerate.Accelerator(cpu=True)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(module, optimizer)
        prepared[side] = (accelerator, model, optimizer)
    probe.holds("prepare keeps the wrapper", prepared["ortfx"][1] is sides["ortfx"], "")

    def step(side: str) -> tuple[Any, dict[str, Any]]:
        accelerator, model, optimizer = prepared[side]
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        grads = _grads(model)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach(), grads

    for _ in range(steps):
        (loss, grads), (got, got_grads) = (probe.timed(s, functools.partial(step, s))
                                           for s in ("eager", "ortfx"))  # fmt: skip
        probe.close("loss", got, loss, atol=1e-5)
        _close_grads(probe, got_grads, grads, atol=1e-5, rtol=1e-4)
    with tempfile.TemporaryDirectory() as tmp:
        for side, (accelerator, model, _) in prepared.items():
            accelerator.save_model(model, f"{tmp}/{side}")
        _same_weights(probe, "saved tensors", *(Path(tmp, s, "model.safetensors")
                                                for s in ("ortfx", "eager")))  # fmt: skip


# ---- timm, torchvision --------------------------------------------------------------------------


def _timm(name: str, **kwargs: Any) -> Callable[[], Any]:
    def build() -> Any:
        from tests import vision_libraries

        return vision_libraries.import_timm().create_model(
            name, pretrained=False, num_classes=3, **kwargs
        )

    return build


def _torchvision(name: str, **kwargs: Any) -> Callable[[], Any]:
    def build() -> Any:
        from tests import vision_libraries

        return getattr(vision_libraries.import_torchvision().models, name)(num_classes=3, **kwargs)

    return build


def _classifier_step(model: Any, optimizer: Any, x: Any, labels: Any) -> tuple[Any, Any]:
    """Cross-entropy, backward, SGD: (the loss, the gradients)."""
    import torch.nn.functional as F

    loss = F.cross_entropy(model(x), labels)
    loss.backward()
    grads = _grads(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _vision(probe: Probe, steps: int, build: Callable[[], Any], lr: float) -> None:
    """SGD steps on 4 images of 64x64, 3 classes: losses, gradients, buffers (BatchNorm's
    running statistics) after the steps, eval outputs after training; each also for the
    noisy eager copies (the "noise")."""
    import torch

    import ortfx

    torch.manual_seed(0)
    eager = build()
    models = {"eager": eager, "ortfx": probe.watch(ortfx.ORTModule(copy.deepcopy(eager)))}
    for k in range(NOISE_COPIES):
        models[f"noise{k}"] = noisy = copy.deepcopy(eager)
        with torch.no_grad():
            for p in noisy.parameters():
                p.mul_(1 + NOISE * torch.randn_like(p))
    noisy_sides = [k for k in models if k.startswith("noise")]
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=lr) for k, m in models.items()}
    generator = torch.Generator().manual_seed(1)
    labels = torch.tensor([0, 1, 2, 0])
    for _ in range(steps):
        x = torch.randn(4, 3, 64, 64, generator=generator)
        losses, grads = {}, {}
        for side, model in models.items():
            step = functools.partial(_classifier_step, model, optimizers[side], x, labels)
            losses[side], grads[side] = probe.timed(side, step) if side in probe.times else step()
        noise = [losses[k] for k in noisy_sides]
        probe.close("loss", losses["ortfx"], losses["eager"], atol=1e-5, rtol=1e-4, noise=noise)
        _close_grads(probe, grads["ortfx"], grads["eager"], atol=1e-6, rtol=1e-3,
                     noise=[grads[k] for k in noisy_sides])  # fmt: skip
    buffers = {k: dict(m.named_buffers()) for k, m in models.items()}
    counters = {k: [b for b in v.values() if not b.is_floating_point()] for k, v in buffers.items()}
    if counters["eager"]:  # BatchNorm's num_batches_tracked: exact
        probe.close("batch counters", counters["ortfx"], counters["eager"], atol=0.0)
    floats = {k: [b for b in v.values() if b.is_floating_point()] for k, v in buffers.items()}
    if floats["eager"]:
        probe.close("buffers", floats["ortfx"], floats["eager"], atol=1e-5, rtol=1e-4,
                    noise=[floats[k] for k in noisy_sides])  # fmt: skip
    x = torch.randn(4, 3, 64, 64, generator=generator)
    with torch.no_grad():
        out = {k: m.eval()(x) for k, m in models.items()}
    probe.close("eval outputs", out["ortfx"], out["eager"], atol=1e-4, rtol=1e-4,
                noise=[out[k] for k in noisy_sides])  # fmt: skip
    probe.notes.append(f"SGD lr {lr:g}")


# ---- Lightning ----------------------------------------------------------------------------------


def _lightning(probe: Probe, steps: int, precision: str) -> None:
    """The docs' LightningModule (its network wrapped in ``__init__``) against the same module
    unwrapped, ``Trainer(max_steps=steps, accelerator="cpu", precision=...)``: losses, and
    parameters and BatchNorm statistics after ``fit``."""
    import lightning as L
    import torch
    from torch import nn

    import ortfx

    class Regressor(L.LightningModule):  # type: ignore[misc]
        def __init__(self, wrap: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
            self.net = probe.watch(ortfx.ORTModule(net)) if wrap else net
            self.losses: list[Any] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).float(), y)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class StepTimer(L.Callback):  # type: ignore[misc]
        def __init__(self, side: str) -> None:
            self.side = side

        def on_train_batch_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            probe.times[self.side].append(time.perf_counter() - self.start)

    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(8 * steps, 8, generator=generator),
        torch.randn(8 * steps, 1, generator=generator),
    )
    fitted = {}
    for side in ("eager", "ortfx"):
        trainer = L.Trainer(
            max_steps=steps, accelerator="cpu", precision=precision, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[StepTimer(side)],
        )  # fmt: skip
        fitted[side] = Regressor(wrap=side == "ortfx")
        trainer.fit(fitted[side], torch.utils.data.DataLoader(data, batch_size=8))
    # Falling back runs eager's code on eager's values: the same bits are expected.
    tol = 0.0 if probe.expect_fallback else 1e-5
    probe.close("losses", fitted["ortfx"].losses, fitted["eager"].losses, atol=tol)
    states = [f.state_dict() for f in (fitted["ortfx"], fitted["eager"])]
    probe.holds("state_dict keys", states[0].keys() == states[1].keys(), f"{len(states[0])}")
    probe.close("parameters, statistics after fit", dict(states[0]), dict(states[1]), atol=tol)


def _lightning_bf16(probe: Probe, steps: int) -> None:
    probe.expect_fallback = True
    _lightning(probe, steps, "bf16-mixed")


# ---- train, then deploy -------------------------------------------------------------------------


def _check_file(
    probe: Probe, what: str, record: Any, call: tuple[tuple[Any, ...], dict[str, Any]],
    expected: Any,
) -> None:  # fmt: skip
    """The written file in a session of our own on another call, against ``expected``."""
    import onnxruntime

    session = onnxruntime.InferenceSession(record.path, providers=["CPUExecutionProvider"])
    outputs = session.run(None, record.feeds(*call[0], **call[1]))
    probe.close(what, outputs[0], expected, atol=1e-4, rtol=1e-4)


def _deploy_timm(probe: Probe, steps: int) -> None:
    """timm's mobilenetv3_small_050 trained by ortfx, then ``export_for_inference`` (checked
    there on two batch sizes) and the file run again on a third, against the module."""
    import torch

    import ortfx

    torch.manual_seed(0)
    wrapper = probe.watch(ortfx.ORTModule(_timm("mobilenetv3_small_050")()))
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 3, 64, 64, generator=generator)
        labels = torch.tensor([0, 1, 2, 0])
        probe.timed("ortfx", functools.partial(_classifier_step, wrapper, optimizer, x, labels))
    images = [torch.randn(n, 3, 64, 64, generator=generator) for n in (2, 3, 5)]
    with tempfile.TemporaryDirectory() as tmp:
        record = ortfx.export_for_inference(
            wrapper, (images[0],), f"{tmp}/model.onnx", check_inputs=[(images[1],)]
        )
        _report_export(probe, "export_for_inference", record, 2)
        with torch.no_grad():
            expected = wrapper.module.eval()(images[2])
        _check_file(probe, "file on batch 5", record, ((images[2],), {}), expected)


def _report_export(probe: Probe, what: str, record: Any, calls: int) -> None:
    """export_for_inference raises unless every output element is within its atol 1e-4 +
    rtol 1e-4 * |torch|: here it returned, so it passed; its numbers are reported."""
    probe.holds(
        what, True, f"max diff {record.max_difference:.1e} on {calls} calls, {record.seconds:.1f} s"
    )


def _deploy_lora(probe: Probe, steps: int) -> None:
    """LoRA GPT-2 trained by ``ORTModule(peft_model)``, then written twice: the PeftModel as
    it is, and merged (``merge_and_unload``); each file run again on a third call."""
    import peft
    import torch

    import ortfx

    torch.manual_seed(1)
    peft_model = peft.get_peft_model(
        _gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0)
    )
    wrapper = probe.watch(ortfx.ORTModule(peft_model))
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    ids = _ids(4, 16)
    for _ in range(steps):

        def step() -> None:
            wrapper(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        probe.timed("ortfx", step)
    calls = [
        {"input_ids": _ids(b, n, seed=b), "use_cache": False} for b, n in ((2, 7), (3, 11), (1, 13))
    ]
    with torch.no_grad():
        expected = peft_model.eval()(**calls[2]).logits
    merged = copy.deepcopy(peft_model).merge_and_unload()
    with tempfile.TemporaryDirectory() as tmp:
        for form, module in (("adapter", wrapper), ("merged", merged)):
            record = ortfx.export_for_inference(
                module, (), f"{tmp}/{form}.onnx", calls[0], check_inputs=[calls[1]]
            )
            _report_export(probe, f"{form}: export_for_inference", record, 2)
            _check_file(probe, f"{form}: file on 1x13", record, ((), calls[2]), expected)


# ---- the cases ----------------------------------------------------------------------------------

Case = Callable[[Probe, int], None]
CASES: dict[str, tuple[str, Case]] = {
    "peft-wrap-peft-model": ("peft", functools.partial(_peft, order="ORTModule(peft_model)")),
    "peft-wrap-base": ("peft", functools.partial(_peft, order="get_peft_model(ORTModule(base))")),
    "trainer-gpt2": ("transformers", _trainer_gpt2),
    "seq2seq-trainer-t5": ("transformers", _trainer_t5),
    "trainer-peft": ("transformers", _trainer_peft),
    "accelerate-gpt2": ("accelerate", _accelerate),
    "timm-resnet18": ("timm", functools.partial(_vision, build=_timm("resnet18"), lr=1e-2)),
    "timm-mobilenetv3_small_050": (
        "timm",
        functools.partial(_vision, build=_timm("mobilenetv3_small_050"), lr=1e-3),
    ),
    "timm-efficientnet_b0": (
        "timm",
        functools.partial(_vision, build=_timm("efficientnet_b0"), lr=1e-4),
    ),
    "timm-regnetx_002": ("timm", functools.partial(_vision, build=_timm("regnetx_002"), lr=1e-2)),
    "timm-vit_tiny_patch16_224": (
        "timm",
        functools.partial(_vision, build=_timm("vit_tiny_patch16_224", img_size=64), lr=1e-2),
    ),
    "torchvision-resnet18": (
        "torchvision",
        functools.partial(_vision, build=_torchvision("resnet18"), lr=1e-3),
    ),
    "torchvision-mobilenet_v3_small": (
        "torchvision",
        functools.partial(_vision, build=_torchvision("mobilenet_v3_small", dropout=0.0), lr=1e-2),
    ),
    "lightning-32-true": ("lightning", functools.partial(_lightning, precision="32-true")),
    "lightning-bf16-mixed": ("lightning", _lightning_bf16),
    "deploy-timm": ("onnxruntime", _deploy_timm),
    "deploy-lora-gpt2": ("onnxruntime", _deploy_lora),
}
