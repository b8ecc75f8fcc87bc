"""``bench/roofline.py`` and ``bench.compare --roofline``: the products a step runs, the limit
they give, and each round's steps against its own roofline (the benchmarks themselves stay out
of ``make test``)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from bench import common, compare, roofline


def test_the_roofline_counts_every_product_of_the_step() -> None:
    """Linear(16, 16) on 4 rows, no input gradient: the forward's addmm (4x16x16) and the
    weight gradient's mm (16x4x16), 2 * 4 * 16 * 16 FLOPs each, as FlopCounterMode counts;
    the roofline is the sum of the faster library's time per product."""
    r = roofline.measure("tiny-linear", 1, rounds=1, calls=1)
    shapes = sorted((tuple(p["shape"]), p["count"]) for p in r["products"])
    assert shapes == [((1, 4, 16, 16), 1), ((1, 16, 4, 16), 1)]
    assert r["flops"] == r["product_flops"] == 2 * (2 * 4 * 16 * 16)
    assert r["roofline_s"] == pytest.approx(
        sum(p["count"] * min(p["ort_s"], p["torch_s"]) for p in r["products"])
    )
    assert 0 < r["roofline_s"] <= min(r["ort_products_s"], r["torch_products_s"])
    assert r["optimizer_s"] > 0 and r["fused_optimizer_s"] > 0
    assert "GFLOP per step" in roofline.summary(r)


def _record(backend: str, rnd: int, step_s: float) -> dict[str, Any]:
    steps = [9.0, 9.0, step_s, step_s, step_s * 1.5]  # two warm-up steps, then the measured
    return {
        "model": "m", "backend": backend, "round": rnd, "ok": True, "paired": True,
        "step_times_s": steps, "step_cpu_s": steps, "first_step_s": 9.0, "losses": [1.0],
        "peak_rss_mb": 1.0, "peak_rss_children_mb": 0.0,
    }  # fmt: skip


def test_each_round_is_divided_by_the_roofline_measured_before_it() -> None:
    """Round 0 ran on a fast phase of the host (roofline 1 s), round 1 on a slow one (2 s):
    ortfx at 1.5 s and 3 s is 1.5x the limit in both, not 1.5x and 3x of a single one."""
    records = [
        _record("eager", 0, 2.0), _record("ortfx", 0, 1.5),
        _record("eager", 1, 4.0), _record("ortfx", 1, 3.0),
    ]  # fmt: skip
    measured = {"ok": True, "flops": 2e9, "product_flops": 2e9, "ort_products_s": 2.5,
                "torch_products_s": 2.5, "threads": 1}  # fmt: skip
    limits = {"m": [{**measured, "round": 0, "roofline_s": 1.0},
                    {**measured, "round": 1, "roofline_s": 2.0}]}  # fmt: skip
    rows = {r["backend"]: r for r in compare.summarise(records, 2, limits)}
    assert rows["ortfx"]["x_roofline"] == pytest.approx(1.5)
    assert rows["eager"]["x_roofline"] == pytest.approx(2.0)
    assert rows["ortfx"]["roofline_ms"] == pytest.approx(1500.0)
    ns = argparse.Namespace(
        argv=[], rounds=2, steps=5, optimizer="adamw", threads=1, ortfx_option=[], pin=None,
        paired=True, warmup=2, compile_cache="fresh",
    )  # fmt: skip
    table = compare.markdown(list(rows.values()), ns, common.machine(), limits)
    assert "1000, 2000 ms by round" in table
    assert "| 1.50 (1.50) |" in table
