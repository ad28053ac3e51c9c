"""benchmarks/quickstart_spread.py's reading of a run and its summary over runs."""

from __future__ import annotations

import pytest

from benchmarks.quickstart_spread import spread, time_to_target


def test_the_first_evaluation_at_the_target_counts_and_misses_are_kept_apart() -> None:
    evals = [{"ts": 100.0, "step": 0, "pass@1": 0.0},
             {"ts": 150.0, "step": 500, "pass@1": 0.91},
             {"ts": 160.0, "step": 520, "pass@1": 0.95}]
    assert time_to_target(evals, 0.9) == {"reached": True, "step": 500, "t_s": 50.0,
                                          "final_pass@1": 0.95}
    miss = time_to_target([*evals[:1], {"ts": 1000.0, "step": 9000, "pass@1": 0.5}], 0.9)
    assert miss["reached"] is False and miss["step"] == 9000
    assert time_to_target([], 0.9)["reached"] is False
    s = spread([{"reached": True, "step": 3000, "t_s": 300.0},
                {"reached": True, "step": 4000, "t_s": 500.0},
                {**miss}])
    assert (s["runs"], s["reached"]) == (3, 2)
    assert s["step"] == pytest.approx({"mean": 3500, "sd": 707.1068, "min": 3000,
                                       "max": 4000})
