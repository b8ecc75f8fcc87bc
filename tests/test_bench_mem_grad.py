"""Smoke test of ``bench/mem_grad.py --quick``: every configuration runs and records what it
should (the benchmark itself stays out of ``make test``)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import mem_grad


def test_quick_run_records_every_configuration(tmp_path: Path) -> None:
    """One record per configuration, all ok; losses equal eager's; torch never holds more than
    one parameter's gradient with the optimizer in backward, all of them without it; no
    gradient is left after a step."""
    jsonl = mem_grad.main(["--quick", "--out-dir", str(tmp_path), "--tag", "smoke"])
    assert jsonl is not None
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    records = {r["config"]: r for r in lines if "config" in r}
    assert set(records) == set(mem_grad.CONFIGS)
    assert all(r["ok"] for r in records.values()), [r.get("error") for r in records.values()]
    model, _, _, _, _ = mem_grad.build("quick", 0)
    sizes = [p.nbytes for p in model.parameters()]
    eager = records["eager"]["losses"]
    for name, r in records.items():
        assert max(abs(a - b) for a, b in zip(r["losses"], eager, strict=True)) <= 1e-5, name
        assert r["grads_left"] == 0, name
        assert r["grad_arrivals"] == len(sizes), name
        expected = max(sizes) if r["optimizer_in_backward"] else sum(sizes)
        assert r["peak_grad_mb"] * 2**20 == expected, name
    summary = next(line["summary"] for line in lines if "summary" in line)
    assert {row["config"] for row in summary} == set(mem_grad.CONFIGS)
    assert (tmp_path / "mem_grad-smoke.md").read_text().count("| ortfx+mem+oib |") == 1
