"""benchmarks/vs_trl_report.py on made-up runs: every section renders, the areas pair the
seeds, and the mechanism summary reads each run's first and last quarter."""

from __future__ import annotations

import math

from benchmarks.vs_trl_report import mechanism, report


def _run(rate: float) -> dict:
    evals = [{"t": t, "samples": t * 1000, "step": t * 10, "exact": min(1.0, rate * t / 2),
              "reward": min(1.0, rate * t)} for t in range(0, 101, 10)]
    rows = [{"step": s, "entropy": 1.0 - s / 1000, "grad_norm": 2.0} for s in range(1000)]
    return {"evals": evals, "steps": 1000, "profile": {"trainer": 1.0}, "mech": mechanism(rows)}


def test_the_report_renders_every_section_and_pairs_seeds() -> None:
    res = {"trl": {"0": _run(0.005), "1": _run(0.006)},
           "s1": {"0": _run(0.008), "1": _run(0.009)}}
    text = "\n".join(report(res, target=0.9, budget_s=100, samples=100_000))
    assert "area under the held-out reward curve" in text
    assert "vs trl: +" in text  # s1 learns faster on both seeds: a positive paired gain
    assert "mechanism:" in text and "held-out reward against s" in text


def test_mechanism_means_early_and_late_quarters() -> None:
    m = mechanism([{"step": s, "entropy": float(s), "clip_ratio/region_mean": math.nan}
                   for s in range(8)])
    assert m["early"]["entropy"] == 0.5 and m["late"]["entropy"] == 6.5
    assert "clip_ratio/region_mean" not in m["late"]  # NaN only: omitted
    assert mechanism([]) == {}
