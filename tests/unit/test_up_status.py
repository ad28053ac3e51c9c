"""`sluice up`'s progress line: reward errors and dead letters are shown, not hidden."""

from __future__ import annotations

from typing import Any

from pipeline.config import load_config
from sluice.samples import ScorerSamples
from sluice.supervisor import Supervisor
from sluice.up import status_line


def _snap(scorers: dict[str, dict[str, Any]], dlq: int) -> dict[str, Any]:
    return {"workers": {**scorers, "trainer/trainer-0": {"step": 3}},
            "lengths": {"rollouts": 4, "scored": 0, "control": 2, "dlq": dlq},
            "state": {"version": 3},
            "conservation": {"cursor": 10, "retired": 6, "generating": 0, "balanced": True}}


def test_status_line_sums_reward_errors_over_scorers_and_counts_the_dlq() -> None:
    sup = Supervisor(load_config(None), "run.toml", [])
    s = status_line(sup, _snap({"scorer/scorer-0": {"reward_errors": 2, "dead": 1},
                                "scorer/scorer-1": {"reward_errors": 3}}, dlq=4))
    assert s["reward_errors"] == 5 and s["dlq"] == 4 and s["step"] == 3
    quiet = status_line(sup, _snap({"scorer/scorer-0": {}}, dlq=0))
    assert quiet["reward_errors"] == 0 and quiet["dlq"] == 0


def test_scorer_samples_window_and_a_scorer_leaving() -> None:
    """The summary's sampled reward is the mean over the last completions, from cumulative
    counters; a scorer that leaves (its counts vanish from the snapshot) is not a drop."""
    samples = ScorerSamples(t0=0.0)
    for n, reward in ((0, 0.0), (100, 10.0), (300, 110.0), (600, 410.0)):
        samples.record({"workers": {"scorer/a": {"reward_n": n, "reward_sum": reward}}})
    assert samples.recent(256) == (1.0, 0.0)  # from n=300, the last 256+ before n=600
    assert samples.first_reward(64) == 0.1
    samples.record({"workers": {}})  # the scorer left
    assert samples.last is not None and samples.last.n == 600
    assert [round(r, 3) for _, r, _ in samples.curve(128)] == [0.1, 0.5, 1.0]
