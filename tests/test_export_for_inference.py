"""``ortfx.export_for_inference``: each file, run in a fresh ONNX Runtime session, against the
module's own eager eval outputs; the model and the process as they were before the call."""

from __future__ import annotations

import copy
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import transformers

import ortfx
from ortfx.runtime.ort import ort  # imported by ortfx, without upstream's front end
from tests.models import shape_inference_recorded, tiny_mixtral


def _session(path: str) -> Any:
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"])


def _run(record: ortfx.InferenceExport, *args: Any, **kwargs: Any) -> Any:
    """The record's file run on a call, rebuilt into the module's output structure."""
    outputs = _session(record.path).run(list(record.outputs), record.feeds(*args, **kwargs))
    return record.unflatten(outputs)


def _eager(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            return model(*args, **kwargs)
    finally:
        for m, training in modes:
            m.training = training


def _domains(path: str) -> set[str]:
    return {n.domain for n in onnx.load(path).graph.node}


def _metadata(path: str) -> Any:
    props = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
    return json.loads(props["ortfx"])


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def test_mlp_matches_eager_and_names_its_inputs_and_outputs(tmp_path: Path) -> None:
    """The file's outputs equal eager eval outputs (dropout off) for the example and for inputs
    of other batch sizes; the record and metadata name the graph's inputs and outputs."""
    torch.manual_seed(0)
    model = MLP()
    x, other = torch.randn(4, 6), torch.randn(9, 6)
    record = ortfx.export_for_inference(model, (x,), tmp_path / "mlp.onnx", check_inputs=[(other,)])
    assert record.path == str(tmp_path / "mlp.onnx")
    assert record.inputs == ("input_0",) and record.outputs == ("output",)
    assert record.optimized_path is None and record.seconds > 0
    assert record.max_difference < 1e-5
    for data in (x, other, torch.randn(1, 6)):
        torch.testing.assert_close(_run(record, data), _eager(model, data), atol=1e-5, rtol=1e-5)
    graph = onnx.load(record.path).graph
    assert [i.name for i in graph.input] == ["input_0"]
    assert len(graph.initializer) == 4  # the weights are in the file
    assert _domains(record.path) <= {"", "ai.onnx"}
    assert _metadata(record.path)["inputs"] == [
        {"name": "input_0", "path": "args[0]", "dtype": "float32", "rank": 2}
    ]
    assert os.listdir(tmp_path) == ["mlp.onnx"]  # no staging left behind


def test_a_model_trained_with_ortfx_exports_through_its_wrapper(tmp_path: Path) -> None:
    """A wrapper trained a few steps: the file computes the trained weights' outputs at the
    wrapper's opset, and the wrapper keeps training in ORT afterwards without exporting again."""
    torch.manual_seed(0)
    wrapped = ortfx.ORTModule(MLP(), options=ortfx.Options(opset_version=14))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for _ in range(3):
        wrapped(torch.randn(8, 6)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    x = torch.randn(5, 6)
    record = ortfx.export_for_inference(wrapped, (x,), tmp_path / "trained.onnx")
    torch.testing.assert_close(_run(record, x), _eager(wrapped.module, x), atol=1e-5, rtol=1e-5)
    assert [o.version for o in onnx.load(record.path).opset_import if o.domain == ""] == [14]
    assert wrapped.training
    exports = ortfx.stats(wrapped).exports
    wrapped(torch.randn(8, 6)).pow(2).mean().backward()
    assert ortfx.stats(wrapped).exports == exports
    assert ortfx.stats(wrapped).fallback_calls == 0


class CNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.drop = torch.nn.Dropout(0.3)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(torch.relu(self.bn(self.conv(x))))
        out: torch.Tensor = self.head(y.mean(dim=(2, 3)))
        return out


def _trained_cnn() -> CNN:
    torch.manual_seed(0)
    model = CNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # running statistics away from their initial values
        model(torch.randn(4, 3, 8, 8) * 2 + 1).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def test_batchnorm_and_dropout_take_eval_semantics(tmp_path: Path) -> None:
    """A model in train mode exports with eval semantics: running statistics, no dropout, for
    other image sizes too; its modes stay mixed as they were, its statistics unchanged."""
    model = _trained_cnn()
    model.bn.eval()  # mixed modes, as a user freezing BatchNorm has them
    stats = (model.bn.running_mean.clone(), model.bn.running_var.clone())
    batches = int(model.bn.num_batches_tracked)
    x, other = torch.randn(2, 3, 8, 8), torch.randn(3, 3, 12, 10)
    record = ortfx.export_for_inference(model, (x,), tmp_path / "cnn.onnx", check_inputs=[other])
    for data in (x, other):
        torch.testing.assert_close(_run(record, data), _eager(model, data), atol=1e-5, rtol=1e-5)
    ops = {n.op_type for n in onnx.load(record.path).graph.node}
    assert "Dropout" not in ops
    assert model.training and model.conv.training and model.drop.training
    assert not model.bn.training
    assert torch.equal(model.bn.running_mean, stats[0])
    assert torch.equal(model.bn.running_var, stats[1])
    assert int(model.bn.num_batches_tracked) == batches


def test_model_and_process_unchanged(tmp_path: Path) -> None:
    """Modes, parameters, gradients, requires_grad flags, buffers, the caller's tensors and every
    random stream are as before the call (a train-mode dropout model draws nothing)."""
    model = _trained_cnn()
    model.conv.weight.requires_grad_(False)
    model(torch.randn(2, 3, 8, 8)).sum().backward()  # gradients present
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    x = torch.randn(2, 3, 8, 8)
    x_before = x.clone()
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    streams = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    ortfx.export_for_inference(model, (x,), tmp_path / "cnn.onnx", optimize=True)
    assert torch.equal(torch.get_rng_state(), streams[0])
    assert random.getstate() == streams[1]
    assert np.array_equal(np.random.get_state()[1], streams[2][1])
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters() if n in grads)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(x, x_before)
    assert torch.is_grad_enabled()


def test_a_call_under_inference_mode(tmp_path: Path) -> None:
    """Inputs made under torch.inference_mode() (which the tracer cannot record) export from
    normal copies; the mode is on again afterwards."""
    model = MLP()
    with torch.inference_mode():
        x = torch.randn(2, 6)
        record = ortfx.export_for_inference(model, (x,), tmp_path / "m.onnx")
        assert torch.is_inference_mode_enabled()
    torch.testing.assert_close(_run(record, x), _eager(model, x), atol=1e-5, rtol=1e-5)


# ---- custom autograd Functions ------------------------------------------------------------------


class ClampWithSymbolic(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad

    @staticmethod
    def symbolic(g: Any, x: Any) -> Any:
        return g.op("Relu", x)


class TwiceWithoutSymbolic(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 3  # a straight-through style gradient: irrelevant for inference


class CountsWithoutSymbolic(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x + torch.histc(x, bins=4).sum()  # histc has no ONNX form

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _written_as(op: str, **attributes: Any) -> Any:
    """A Function (``x + 1``) whose symbolic writes one ``op`` node."""

    class WrittenAs(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x + 1

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad

        @staticmethod
        def symbolic(g: Any, x: Any) -> Any:
            return g.op(op, x, **attributes).setType(x.type())

    return WrittenAs


class WithFunction(torch.nn.Module):
    def __init__(self, function: Any) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.function.apply(self.linear(x))
        return out


def test_function_with_symbolic_is_written_by_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = WithFunction(ClampWithSymbolic)
    x = torch.randn(3, 4)
    record = ortfx.export_for_inference(model, (x,), tmp_path / "f.onnx")
    assert "Relu" in {n.op_type for n in onnx.load(record.path).graph.node}
    torch.testing.assert_close(_run(record, x), _eager(model, x))


def test_function_without_symbolic_trained_in_ort_has_its_forward_traced(tmp_path: Path) -> None:
    """A Function without a symbolic that ortfx trained as a PythonOp: the file holds its
    forward, traced into standard operators, and matches eager."""
    torch.manual_seed(0)
    wrapped = ortfx.ORTModule(WithFunction(TwiceWithoutSymbolic))
    wrapped(torch.randn(3, 4)).sum().backward()
    assert ortfx.stats(wrapped).fallback_calls == 0
    x = torch.randn(5, 4)
    record = ortfx.export_for_inference(wrapped, (x,), tmp_path / "f.onnx")
    assert _domains(record.path) <= {"", "ai.onnx"}
    torch.testing.assert_close(_run(record, x), _eager(wrapped.module, x))


def test_function_that_cannot_be_expressed_is_named(tmp_path: Path) -> None:
    with pytest.raises(ortfx.OrtfxUnsupportedOpError, match=r"Function CountsWithoutSymbolic .*"
                       r"aten::histc.*Give the custom autograd.Function CountsWithoutSymbolic a "
                       r"`symbolic` staticmethod") as caught:  # fmt: skip
        ortfx.export_for_inference(
            WithFunction(CountsWithoutSymbolic), (torch.randn(3, 4),), tmp_path / "f.onnx"
        )
    assert caught.value.op == "PythonOp"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("function", "phrase"),
    [
        # a domain no standard runtime knows
        (_written_as("mylib::AddOne"), r"mylib::AddOne.*Write these in standard ONNX operators"),
        # ORT's training-only node, as ortfx's training export writes a Function
        (
            _written_as("com.microsoft::PythonOp", func_name_s="tests.Mine"),
            r"com.microsoft::PythonOp \(tests.Mine\).*Function tests.Mine a `symbolic`",
        ),
    ],
)
def test_nodes_outside_the_standard_domains_are_refused(
    tmp_path: Path, function: Any, phrase: str
) -> None:
    with pytest.raises(ortfx.OrtfxUnsupportedOpError, match=phrase):
        ortfx.export_for_inference(
            WithFunction(function), (torch.randn(3, 4),), tmp_path / "f.onnx"
        )
    assert os.listdir(tmp_path) == []


# ---- verification ------------------------------------------------------------------------------


class Branchy(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a branch on values: the trace keeps the example's
            return x * 2
        return -x


def test_a_wrong_file_is_refused_with_its_numbers(tmp_path: Path) -> None:
    """The trace kept the example's branch: the other check input differs, the error gives the
    numbers, and nothing is written."""
    target = tmp_path / "b.onnx"
    with pytest.raises(ortfx.OrtfxVerificationError, match=r"check_inputs\[0\]: output: max "
                       r"\|difference\| 3(\.0*)? .*Nothing was written"):  # fmt: skip
        ortfx.export_for_inference(
            Branchy(), (torch.ones(2),), target, check_inputs=[(-torch.ones(2),)]
        )
    assert not target.exists() and os.listdir(tmp_path) == []


def test_check_inputs_of_another_structure_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ortfx.OrtfxIOError, match=r"check_inputs\[0\] does not have the "
                       r"example's structure: given \{args\[0\]: int64\[\?\]\}"):  # fmt: skip
        ortfx.export_for_inference(
            MLP(), (torch.randn(2, 6),), tmp_path / "m.onnx", check_inputs=[(torch.ones(2).long(),)]
        )


def test_not_a_module_is_refused(tmp_path: Path) -> None:
    phrase = r"expects a torch.nn.Module or an ortfx.ORTModule, got builtin_function_or_method"
    with pytest.raises(ortfx.OrtfxTorchModelError, match=phrase):
        ortfx.export_for_inference(torch.relu, (torch.ones(2),), tmp_path / "f.onnx")  # type: ignore[arg-type]


def test_static_shapes_with_dynamic_axes_false(tmp_path: Path) -> None:
    record = ortfx.export_for_inference(
        MLP(), (torch.randn(2, 6),), tmp_path / "m.onnx", dynamic_axes=False
    )
    dims = onnx.load(record.path).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [2, 6]
    with pytest.raises(ortfx.OrtfxIOError, match="dynamic_axes=False fixes every size"):
        ortfx.export_for_inference(
            MLP(), (torch.randn(2, 6),), tmp_path / "n.onnx", dynamic_axes=False,
            check_inputs=[(torch.randn(3, 6),)],
        )  # fmt: skip


# ---- files -------------------------------------------------------------------------------------


def test_optimized_file_is_written_and_checked(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _trained_cnn()
    x = torch.randn(2, 3, 8, 8)
    record = ortfx.export_for_inference(model, (x,), tmp_path / "cnn.onnx", optimize=True)
    assert record.optimized_path == str(tmp_path / "cnn.optimized.onnx")
    assert [name for name, _ in record.optimized_max_differences] == ["output"]
    assert max(d for _, d in record.optimized_max_differences) < 1e-4
    assert _domains(record.optimized_path) <= {"", "ai.onnx", "com.microsoft"}
    outputs = _session(record.optimized_path).run(None, record.feeds(x))
    torch.testing.assert_close(torch.from_numpy(outputs[0]), _eager(model, x), atol=1e-5, rtol=1e-5)
    # the optimizer folded the eval BatchNorm into the convolution
    assert "BatchNormalization" not in {
        n.op_type for n in onnx.load(record.optimized_path).graph.node
    }


def test_weights_go_to_a_side_file_above_the_threshold(tmp_path: Path) -> None:
    """The external-data path, forced by a threshold of 0 bytes: the weights live in
    ``<file>.data`` (also for the optimized file), and both files check against eager."""
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(3, 6)
    record = ortfx.export_for_inference(
        model, (x,), tmp_path / "m.onnx", external_data_threshold=0, optimize=True
    )
    assert sorted(os.listdir(tmp_path)) == [
        "m.onnx", "m.onnx.data", "m.optimized.onnx", "m.optimized.onnx.data",
    ]  # fmt: skip
    for path in (record.path, record.optimized_path):
        assert path is not None
        bare = onnx.load(path, load_external_data=False)
        assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in bare.graph.initializer)
    assert record.max_difference < 1e-5
    torch.testing.assert_close(_run(record, x), _eager(model, x), atol=1e-5, rtol=1e-5)
    # without a threshold the same model is one file
    ortfx.export_for_inference(model, (x,), tmp_path / "one.onnx")
    assert not (tmp_path / "one.onnx.data").exists()


def test_a_model_over_two_gib(tmp_path: Path) -> None:
    """A real 2.15 GB model (over 2 GiB): protobuf cannot hold it, so its weights go to the side
    file. About 35 s and 6.6 GB of peak memory (it was 103 s and 8.7 GB, opt-in, before the
    export stopped copying every weight twice into torch's shape inference)."""
    model = torch.nn.Linear(23_200, 23_200, bias=False)
    x = torch.randn(1, 23_200)
    record = ortfx.export_for_inference(model, (x,), tmp_path / "big.onnx", atol=1e-3)
    assert (tmp_path / "big.onnx.data").stat().st_size > 2**31
    assert (tmp_path / "big.onnx").stat().st_size < 2**20
    assert record.max_difference < 1e-3


# ---- Hugging Face -------------------------------------------------------------------------------

VOCAB = 100


def _gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB)
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_without_a_cache(tmp_path: Path) -> None:
    model = _gpt2()
    ids, longer = torch.randint(0, VOCAB, (2, 5)), torch.randint(0, VOCAB, (3, 9))
    record = ortfx.export_for_inference(
        model, (), tmp_path / "gpt2.onnx", {"input_ids": ids, "use_cache": False},
        check_inputs=[{"input_ids": longer, "use_cache": False}],
    )  # fmt: skip
    assert record.inputs == ("input_ids",) and record.outputs == ("logits",)
    for data in (ids, longer):
        got = _run(record, input_ids=data, use_cache=False)
        assert isinstance(got, transformers.modeling_outputs.CausalLMOutputWithCrossAttentions)
        want = _eager(model, input_ids=data, use_cache=False)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    assert _metadata(record.path)["static_inputs"] == [
        {"path": "kwargs['use_cache']", "value": False}
    ]


def test_gpt2_decode_step_with_a_kv_cache(tmp_path: Path) -> None:
    """The decode graph: the past cache's tensors are inputs, the new cache's outputs (named
    apart from the inputs); the caller's cache is not changed by the export; the session's
    outputs rebuild into a DynamicCache equal to eager's."""
    model = _gpt2()
    with torch.no_grad():
        past = model(input_ids=torch.randint(0, VOCAB, (2, 4)), use_cache=True).past_key_values
        other = model(input_ids=torch.randint(0, VOCAB, (2, 6)), use_cache=True).past_key_values
    keys = past.layers[0].keys.clone()
    step = torch.randint(0, VOCAB, (2, 1))
    record = ortfx.export_for_inference(
        model, (), tmp_path / "decode.onnx",
        {"input_ids": step, "past_key_values": past, "use_cache": True},
        check_inputs=[{"input_ids": torch.randint(0, VOCAB, (2, 3)), "past_key_values": other,
                       "use_cache": True}],
    )  # fmt: skip
    assert past.get_seq_length() == 4 and torch.equal(past.layers[0].keys, keys)
    assert "past_key_values.layers.0.keys" in record.inputs
    assert record.outputs[0] == "logits" and len(record.outputs) == 5
    assert not set(record.inputs) & set(record.outputs)
    got = _run(record, input_ids=step, past_key_values=past, use_cache=True)
    want = _eager(model, input_ids=step, past_key_values=copy.deepcopy(past), use_cache=True)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    assert isinstance(got.past_key_values, transformers.DynamicCache)
    assert got.past_key_values.get_seq_length() == 5
    for mine, theirs in zip(got.past_key_values.layers, want.past_key_values.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)


def test_an_output_named_like_an_input_is_present(tmp_path: Path) -> None:
    """transformers 5.24's ``cache=`` keyword: the returned cache (field ``cache``) would take
    the inputs' names, so its outputs are ``present.*``."""
    model = _gpt2()
    with torch.no_grad():
        past = model(input_ids=torch.randint(0, VOCAB, (2, 4)), use_cache=True).past_key_values
    step = {"input_ids": torch.randint(0, VOCAB, (2, 1)), "cache": past, "use_cache": True}
    record = ortfx.export_for_inference(model, (), tmp_path / "c.onnx", step)
    assert "cache.layers.1.values" in record.inputs
    assert "present.cache.layers.1.values" in record.outputs
    want = _eager(model, **{**step, "cache": copy.deepcopy(past)})
    torch.testing.assert_close(_run(record, **step).logits, want.logits, atol=1e-5, rtol=1e-5)


def test_gpt2_prefill_returns_its_cache(tmp_path: Path) -> None:
    model = _gpt2()
    ids, mask = torch.randint(0, VOCAB, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    record = ortfx.export_for_inference(
        model, (), tmp_path / "prefill.onnx",
        {"input_ids": ids, "attention_mask": mask, "use_cache": True}, optimize=True,
    )  # fmt: skip
    assert set(record.inputs) == {"input_ids", "attention_mask"}
    assert len(record.outputs) == 5 and record.max_difference < 1e-4
    got = _run(record, input_ids=ids, attention_mask=mask, use_cache=True)
    want = _eager(model, input_ids=ids, attention_mask=mask, use_cache=True)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        got.past_key_values.layers[1].values, want.past_key_values.layers[1].values
    )


def test_tiny_bert(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=VOCAB, num_labels=3,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    call = {
        "input_ids": torch.randint(0, VOCAB, (2, 7)),
        "attention_mask": torch.tensor([[1] * 7, [1] * 4 + [0] * 3]),
    }
    other = {"input_ids": torch.randint(0, VOCAB, (3, 11)), "attention_mask": torch.ones(3, 11)}
    other["attention_mask"] = other["attention_mask"].long()
    record = ortfx.export_for_inference(
        model, (), tmp_path / "bert.onnx", call, check_inputs=[other], optimize=True
    )
    assert record.outputs == ("logits",)
    assert model.training  # transformers builds models in train mode; put back
    for data in (call, other):
        torch.testing.assert_close(
            _run(record, **data).logits, _eager(model, **data).logits, atol=1e-5, rtol=1e-5
        )


# ---- structure and the process -------------------------------------------------------------------


class Nested(torch.nn.Module):
    def forward(self, x: torch.Tensor, extra: dict[str, torch.Tensor]) -> Any:
        return x * 2, {"sum": x + extra["y"], "n": 3}


def test_nested_inputs_and_outputs_are_named_by_their_paths(tmp_path: Path) -> None:
    """Inputs and outputs in containers: named by path, rebuilt by ``unflatten`` with the
    Python values the graph holds; the metadata says the same."""
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    other = ((torch.randn(5, 3), {"y": torch.randn(5, 3)}), {})  # an (args, kwargs) pair
    record = ortfx.export_for_inference(
        Nested(), (x, {"y": y}), tmp_path / "n.onnx", check_inputs=[other]
    )
    assert record.inputs == ("input_0", "input_1.y")
    assert record.outputs == ("output_0", "output_1.sum")
    doubled, rest = _run(record, x, {"y": y})
    torch.testing.assert_close(doubled, x * 2)
    torch.testing.assert_close(rest["sum"], x + y)
    assert rest["n"] == 3
    assert _metadata(record.path)["static_outputs"] == [{"path": "output[1]['n']", "value": 3}]


class Counter(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)  # changes its input in place
        return x * 2


def test_an_input_changed_in_place_is_an_output(tmp_path: Path) -> None:
    x = torch.zeros(2)
    record = ortfx.export_for_inference(Counter(), (x,), tmp_path / "c.onnx")
    assert torch.equal(x, torch.zeros(2))  # the caller's tensor is not touched by the export
    assert record.outputs == ("output", "updated.input_0")
    doubled, updated = _session(record.path).run(None, record.feeds(x))
    assert doubled.tolist() == [2.0, 2.0] and updated.tolist() == [1.0, 1.0]


def test_a_wrapper_inside_the_model_is_traced_into_the_file(tmp_path: Path) -> None:
    torch.manual_seed(0)
    inner = ortfx.ORTModule(torch.nn.Linear(4, 4))
    model = torch.nn.Sequential(inner, torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()  # the inner part trains in ORT
    x = torch.randn(5, 4)
    want = _eager(model, x)  # an eval call: the wrapper's second graph
    before = ortfx.stats(inner)
    record = ortfx.export_for_inference(model, (x,), tmp_path / "s.onnx")
    torch.testing.assert_close(_run(record, x), want, atol=1e-5, rtol=1e-5)
    assert ortfx.stats(inner).calls == before.calls  # the export ran it as plain code
    model(torch.randn(3, 4)).sum().backward()
    assert ortfx.stats(inner).exports == before.exports
    assert ortfx.stats(inner).fallback_calls == 0


class FloorDivide(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x // 2


def _user_export(path: Path) -> bytes:
    torch.onnx.export(FloorDivide(), (torch.randn(3),), str(path), dynamo=False)
    return path.read_bytes()


def test_the_users_own_exports_are_unchanged(tmp_path: Path) -> None:
    """ortfx's symbolics are registered for its export only: a user's torch.onnx.export gives
    the same file before and after (the stock exporter truncates, ortfx's file floors)."""
    before = _user_export(tmp_path / "before.onnx")
    record = ortfx.export_for_inference(
        FloorDivide(), (torch.tensor([-7.0, 7.0]),), tmp_path / "ours.onnx"
    )
    assert _session(record.path).run(None, record.feeds(torch.tensor([-7.0])))[0].tolist() == [-4]
    assert _user_export(tmp_path / "after.onnx") == before


def test_an_existing_file_is_replaced_only_by_a_checked_one(tmp_path: Path) -> None:
    target = tmp_path / "model.onnx"
    target.write_bytes(b"the previous release")
    with pytest.raises(ortfx.OrtfxVerificationError):
        ortfx.export_for_inference(
            Branchy(), (torch.ones(2),), target, check_inputs=[(-torch.ones(2),)]
        )
    assert target.read_bytes() == b"the previous release"
    record = ortfx.export_for_inference(Branchy(), (torch.ones(2),), target)
    assert onnx.load(record.path).graph.node and sorted(os.listdir(tmp_path)) == ["model.onnx"]


def test_mixture_of_experts_names_the_way_to_standard_onnx(tmp_path: Path) -> None:
    """transformers' default experts (histc, torch._grouped_mm) cannot be written in ONNX: the
    error names the switch; with batched_mm experts the decode step matches eager."""
    torch.manual_seed(0)
    model = tiny_mixtral()
    call = {"input_ids": torch.randint(0, VOCAB, (2, 5)), "use_cache": False}
    with pytest.raises(ortfx.OrtfxExportError, match=r"aten::histc.*"
                       r"set_experts_implementation\('batched_mm'\)"):  # fmt: skip
        ortfx.export_for_inference(model, (), tmp_path / "moe.onnx", call)
    model.set_experts_implementation("batched_mm")
    with torch.no_grad():
        past = model(input_ids=torch.randint(0, VOCAB, (2, 4)), use_cache=True).past_key_values
    step = {
        "input_ids": torch.randint(0, VOCAB, (2, 1)),
        "past_key_values": past,
        "use_cache": True,
    }
    record = ortfx.export_for_inference(model, (), tmp_path / "moe.onnx", step)
    got = _run(record, **step)
    want = _eager(model, **{**step, "past_key_values": copy.deepcopy(past)})
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)


def test_the_export_gives_torchs_shape_inference_no_large_weight_values(tmp_path: Path) -> None:
    """The written file is exported with its weights (export_params), but torch's whole-graph
    shape inference gets those over 65,536 elements by type only: given their values it
    serialised each weight twice (19 of the 49 s, and 2 GB of peak, for the 2.15 GB model).
    The pass is torch's own again afterwards, and the file holds the weight."""
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Tanh(), torch.nn.Linear(300, 2))
    with shape_inference_recorded() as received:
        record = ortfx.export_for_inference(model, (torch.randn(2, 300),), tmp_path / "m.onnx")
    assert received and all((300, 300) not in r.values() for r in received), received
    assert any((300,) in r.values() for r in received)  # small ones keep their values
    weights = {t.name: tuple(t.dims) for t in onnx.load(str(record.path)).graph.initializer}
    assert (300, 300) in weights.values()
