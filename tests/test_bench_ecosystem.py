"""``bench/ecosystem_sweep.py``: its cheapest cases run through the sweep's own ``run_case``
and say PASS with real numbers, and a case that goes wrong (an exception, a fallback nobody
expected) says FAIL and why. The full sweep stays out of ``make test``."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import ortfx
from bench import ecosystem_cases, ecosystem_sweep


def _check(row: dict[str, Any], what: str) -> dict[str, Any]:
    return next(c for c in row["checks"] if c["what"] == what)


@pytest.mark.parametrize(
    ("case", "checks"),
    [
        ("lightning-32-true", ("losses", "parameters, statistics after fit")),
        ("accelerate-gpt2", ("loss", "grads", "saved tensors")),
    ],
)
def test_a_case_passes_with_its_numbers(case: str, checks: tuple[str, ...]) -> None:
    """The row says PASS: every call in ORT, an export, each check a measured difference
    within a stated, positive tolerance, step times for both sides; the table shows it."""
    row = ecosystem_sweep.run_case(case, steps=3)
    assert row["result"] == "PASS", (row.get("error"), row["checks"], row["facts"])
    assert row["ran_in"] == "ORT (3 calls)" and row["exports"] == 1
    assert {f["what"]: f["ok"] for f in row["facts"]}["calls in ORT"]
    for what in checks:
        check = _check(row, what)
        assert math.isfinite(check["diff"]) and 0 <= check["diff"] <= check["tol"], check
        assert check["tol"] > 0 and check["scale"] > 0, check
    assert row["eager_ms"] > 0 and row["ortfx_ms"] > 0 and row["ortfx_steps_timed"] == 1
    line = ecosystem_sweep.render([{**row, "wall_s": 1.0}]).splitlines()[-1]
    assert line.startswith(f"| {row['library']} {row['version']} | {case} | ORT (3 calls) | 1 |")
    assert line.endswith("| PASS |")


def _unexportable(probe: ecosystem_cases.Probe, steps: int) -> None:
    """A module with an op the TorchScript exporter lacks (``cummax``): ortfx falls back."""

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cummax(x, 1)[0]

    wrapper = probe.watch(ortfx.ORTModule(Net()))
    x = torch.randn(2, 3)
    for _ in range(steps):
        probe.close("outputs", wrapper(x), Net()(x), atol=1e-6)


def _raises(probe: ecosystem_cases.Probe, steps: int) -> None:
    probe.close("loss", 1.0, 1.0, atol=1e-6)
    raise RuntimeError("the library changed under us")


def test_a_case_that_goes_wrong_fails_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected fallback fails the row (its numbers are still eager's), with the reason
    from ortfx's WARNING in "ran in"; an exception fails it with its text; a difference
    beyond the tolerance fails it and is marked in the table."""
    monkeypatch.setitem(ecosystem_cases.CASES, "fallback", ("torch", _unexportable))
    monkeypatch.setitem(ecosystem_cases.CASES, "raises", ("torch", _raises))
    fell = ecosystem_sweep.run_case("fallback", steps=2)
    assert fell["result"] == "FAIL" and _check(fell, "outputs")["diff"] == 0.0
    assert fell["ran_in"].startswith("PyTorch for 2/2 calls: ") and "cummax" in fell["ran_in"]
    facts = {f["what"]: f for f in fell["facts"]}
    assert not facts["calls in ORT"]["ok"] and facts["fallback logged"]["ok"]
    raised = ecosystem_sweep.run_case("raises", steps=1)
    assert raised["result"] == "FAIL"
    assert raised["error"] == "RuntimeError: the library changed under us"
    assert "**RuntimeError: the library changed under us**" in ecosystem_sweep.render(
        [{**raised, "wall_s": 0.0}]
    )
    beyond = {**raised, "checks": [{**_check(raised, "loss"), "diff": 1.0, "tol": 1e-6}]}
    assert "**loss 1.0e+00 > 1.0e-06**" in ecosystem_sweep.render([{**beyond, "wall_s": 0.0}])
