"""Ops neither exporter can express run in torch inside the ORT graph (ORT's ATen node)."""

from __future__ import annotations

import copy

import onnx
import pytest
import torch

import ortfx
from ortfx.runtime import events

pytest.importorskip("ortfx._bridge")


class CountsExperts(torch.nn.Module):
    """A router-like use of histc: the count of each expert scales a linear output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        counts = torch.histc(expert_ids.float(), bins=4, min=0, max=3)
        out: torch.Tensor = self.linear(x) * counts
        return out


def test_histc_runs_in_torch_inside_the_ort_graph(caplog: pytest.LogCaptureFixture) -> None:
    """Outputs and gradients match eager for several id vectors (one graph), the exported
    graph holds an ATen node for histc, and the log says which op runs in torch."""
    torch.manual_seed(0)
    plain = CountsExperts()
    options = ortfx.Options(
        fallback_policy=ortfx.FallbackPolicy.DISABLE, log_level=ortfx.LogLevel.INFO
    )
    wrapped = ortfx.ORTModule(copy.deepcopy(plain), options=options)
    x = torch.randn(3, 4)
    with events.recording() as seen:
        for ids in ([0, 1, 1, 3, 3, 3], [2, 2, 0], [3]):
            expert_ids = torch.tensor(ids)
            expected = plain(x, expert_ids)
            got = wrapped(x, expert_ids)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
            expected.sum().backward()
            got.sum().backward()
            torch.testing.assert_close(
                wrapped.linear.weight.grad, plain.linear.weight.grad, rtol=0, atol=1e-5
            )
    exported = [e[1][0] for e in seen if e[0] == "export"]
    assert len(exported) == 1
    nodes = onnx.load_model_from_string(exported[0].model).graph.node
    aten = [n for n in nodes if n.op_type == "ATen"]
    assert [onnx.helper.get_attribute_value(a.attribute[0]) for a in aten] == [b"histc"]
    assert "aten::histc cannot be expressed in ONNX; ortfx exported it as ATen node" in caplog.text
    stats = ortfx.stats(wrapped)
    assert (stats.calls, stats.fallback_calls) == (3, 0)
