"""Cross-entropy in the ORT graph by torch's kernels (``passes.cross_entropy_in_torch``).

Every variant the TorchScript exporter writes as ``SoftmaxCrossEntropyLoss`` is checked against
eager: losses and gradients within 1e-6 relative to their largest magnitude (1e-6 times
1 + max |eager's|), over several steps and batch sizes, under ``FALLBACK_DISABLE``. Which form ran is asserted from the exported
graph, so a silently skipped rewrite fails."""

from __future__ import annotations

import copy
import math
from typing import Any

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortfx
from ortfx.runtime import events
from tests.models import max_diff

STRICT = ortfx.Options(fallback_policy=ortfx.FallbackPolicy.DISABLE)


class Head(nn.Module):
    """A linear head into ``F.cross_entropy`` with the given keyword arguments."""

    def __init__(self, classes: int, unbatched: bool = False, **kwargs: Any) -> None:
        super().__init__()
        self.linear = nn.Linear(16, classes)
        self.unbatched = unbatched
        self.kwargs = kwargs

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.linear(x)
        if self.unbatched:
            return F.cross_entropy(logits[0], target[0], **self.kwargs)
        return F.cross_entropy(logits, target, **self.kwargs)


def _forms(seen: list[tuple[str, Any]]) -> set[str]:
    """The loss forms in the recorded export's graph: ATen operators and ONNX loss ops."""
    (info,) = [a[0] for name, a in seen if name == "export"]
    graph = onnx.load_from_string(info.model).graph
    found = {n.op_type for n in graph.node} & {"LogSoftmax", "SoftmaxCrossEntropyLoss"}
    for node in graph.node:
        for a in node.attribute:
            if node.op_type == "ATen" and a.name == "operator":
                found.add(a.s.decode())
    return found


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return max_diff(a, b) <= 1e-6 * (1.0 + float(b.detach().abs().max()))


def _check(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> set[str]:
    """Train a copy of ``model`` beside it on ``batches``; the loss forms of its export."""
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    with events.recording() as seen:
        for x, target in batches:
            for m in (model, wrapped):
                m.zero_grad()
            loss, expected = wrapped(x, target), model(x, target)
            assert loss.shape == expected.shape
            assert _close(loss, expected) or (loss.isnan().all() and expected.isnan().all())
            weights = torch.linspace(0.5, 1.5, max(1, expected.numel())).reshape(expected.shape)
            (loss * weights).sum().backward()
            (expected * weights).sum().backward()
            for (path, p), q in zip(model.named_parameters(), wrapped.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None, path
                assert _close(q.grad, p.grad), path
    return _forms(seen)


def _batches(classes: int, ignore: int | None, sizes: tuple[int, ...] = (6, 9, 6)) -> list[Any]:
    torch.manual_seed(0)
    out = []
    for n in sizes:
        target = torch.randint(0, classes, (n,))
        if ignore is not None:
            target[1::4] = ignore
        out.append((torch.randn(n, 16) * 3, target))
    return out


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", [None, -100, 0])
def test_variants_match_eager(reduction: str, ignore: int | None) -> None:
    """Each reduction, with no ignored target, the default ignore_index and a class index as
    ignore_index."""
    kwargs: dict[str, Any] = {"reduction": reduction}
    if ignore is not None:
        kwargs["ignore_index"] = ignore
    assert _check(Head(7, **kwargs), _batches(7, ignore)) == {"ortfx_cross_entropy"}


def test_many_chunks_and_large_scores() -> None:
    """Rows are processed in chunks of about 1 MB: a vocabulary of 3000 over 300 rows takes
    four, and scores of several hundred (no overflow: log-sum-exp subtracts each row's max)."""
    torch.manual_seed(0)
    model = Head(3000)
    with torch.no_grad():
        model.linear.weight.mul_(40)
    batches = [(torch.randn(300, 16), torch.randint(0, 3000, (300,))) for _ in range(2)]
    assert _check(model, batches) == {"ortfx_cross_entropy"}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_unbatched_scores(reduction: str) -> None:
    """Scores [C] with a scalar target (ONNX wants [N, C]; the split form failed to build)."""
    model = Head(7, unbatched=True, reduction=reduction)
    assert _check(model, _batches(7, None)) == {"ortfx_cross_entropy"}


def test_every_target_ignored() -> None:
    """All targets ignored: the mean is 0/0 = NaN as in PyTorch, the gradients are zero."""
    model = Head(5)
    x, target = torch.randn(4, 16), torch.full((4,), -100)
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    loss, expected = wrapped(x, target), model(x, target)
    assert math.isnan(loss.item()) and math.isnan(expected.item())
    loss.backward()
    expected.backward()
    assert wrapped.linear.weight.grad is not None and model.linear.weight.grad is not None
    assert torch.equal(wrapped.linear.weight.grad, model.linear.weight.grad)
    assert not wrapped.linear.weight.grad.any()


def test_scores_of_rank_three_use_the_split_form() -> None:
    """Scores [N, C, positions] keep the LogSoftmax form, with eager's values."""

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 5)

        def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.linear(x).transpose(1, 2), target)

    torch.manual_seed(0)
    batches = [(torch.randn(3, 4, 16), torch.randint(0, 5, (3, 4))) for _ in range(2)]
    assert _check(Positions(), batches) == {"LogSoftmax"}


@pytest.mark.parametrize("logits_in_loss", [False, True])
def test_hugging_face_lm_loss_and_logits(
    logits_in_loss: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPT-2's loss (transformers' ForCausalLMLoss: shifted labels padded with -100) with its
    logits also an output: the loss runs in torch, and its gradient node also adds the logits'
    own gradient (``passes.cross_entropy_grads_summed``: nothing for an unused output, the fed
    gradient when the loss reads the logits too). Loss, logits and gradients within 1e-5 of
    eager's, for two steps."""
    from ortfx import aten
    from tests import models

    key = ("ortfx_cross_entropy_backward_plus", "")
    routed = aten.ROUTED[key]
    extras: list[int] = []

    def counted(*args: Any) -> Any:
        extras.append(args[-1].numel())
        return routed.function(*args)

    monkeypatch.setitem(aten.ROUTED, key, aten.Routed(counted, routed.arguments))
    torch.manual_seed(0)
    model = models.tiny_gpt2()
    wrapped = ortfx.ORTModule(copy.deepcopy(model), options=STRICT)
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 16))
        kwargs = {"input_ids": ids, "labels": ids, "use_cache": False}
        out, expected = wrapped(**kwargs), model(**kwargs)
        assert max_diff(out.loss, expected.loss) <= 1e-5
        assert max_diff(out.logits, expected.logits) <= 1e-5
        if logits_in_loss:
            (out.loss + (out.logits * out.logits.detach()).mean()).backward()
            (expected.loss + (expected.logits * expected.logits.detach()).mean()).backward()
        else:
            out.loss.backward()
            expected.loss.backward()
    for (path, p), q in zip(model.named_parameters(), wrapped.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, path
        assert max_diff(p.grad, q.grad) <= 1e-5, path
    # the fed gradient: the scalar zero of an unused output, or the logits' full gradient
    assert extras == [1, 1] if not logits_in_loss else extras == [2 * 16 * 64] * 2


def test_probability_targets_keep_orts_form() -> None:
    """Class probabilities as targets (float [N, C]) are no class indices: the pass leaves such
    a SoftmaxCrossEntropyLoss as it is (torch's kernel here reads class indices only)."""
    from ortfx import passes

    h, f32 = onnx.helper, onnx.TensorProto.FLOAT
    graph = h.make_graph(
        [h.make_node("SoftmaxCrossEntropyLoss", ["scores", "targets"], ["loss"])],
        "g",
        [h.make_tensor_value_info(n, f32, [4, 5]) for n in ("scores", "targets")],
        [h.make_tensor_value_info("loss", f32, [])],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    before = model.SerializeToString()
    assert passes.cross_entropy_in_torch.edit(model) is False  # type: ignore[attr-defined]
    assert model.SerializeToString() == before
    labels = h.make_tensor_value_info("targets", onnx.TensorProto.INT64, [4])
    model.graph.input[1].CopyFrom(labels)  # class indices: rewritten
    assert passes.cross_entropy_in_torch.edit(model) is True  # type: ignore[attr-defined]
