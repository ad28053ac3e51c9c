"""Eval metrics and run targets (pipeline.evaluation): hand-computed cases."""

from __future__ import annotations

import math

import pytest

from pipeline.evaluation import (
    Target,
    first_reaching,
    metric_names,
    parse_target,
    pass_at_k,
    summarize_scores,
)


def test_pass_at_k_matches_the_closed_form_and_edges() -> None:
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(5, 3, 3) == 1.0  # n - c < k: every draw of 3 holds a pass
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_summarize_scores_totals_passes_and_per_function_means() -> None:
    names, weights = ["acc", "fmt"], [1.0, 0.5]
    greedy = [[1.0, 1.0], [0.0, 1.0], [None, None]]  # totals 1.5, 0.5, 0 (nothing applied)
    row = summarize_scores(names, weights, greedy, pass_threshold=1.0)
    assert row["reward"] == pytest.approx((1.5 + 0.5 + 0.0) / 3)
    assert row["pass@1"] == pytest.approx(1 / 3)
    assert row["rewards/acc"] == pytest.approx(0.5)  # None left out of the mean
    assert row["rewards/fmt"] == pytest.approx(1.0)
    sampled = [[[1.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]]]
    row = summarize_scores(names, weights, greedy, 1.0, sampled, pass_at=[1, 2, 8])
    assert row["sampled_pass@1"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert row["sampled_pass@2"] == pytest.approx((1.0 + 0.0 + 1.0) / 3)
    assert "sampled_pass@8" not in row  # more than the samples taken


def test_targets_parse_and_meet() -> None:
    t = parse_target("pass@1>=0.9")
    assert t == Target("pass@1", ">=", 0.9) and str(t) == "pass@1>=0.9"
    assert parse_target("  rewards/exact_match >= 1e-1 ").value == pytest.approx(0.1)
    assert parse_target("") is None
    low = parse_target("loss<=0.5")
    assert low is not None and low.met({"loss": 0.4}) and not low.met({"loss": 0.6})
    for bad in ("pass@1 > 0.9", "pass@1>=", ">=0.9", "pass@1>=x"):
        with pytest.raises(ValueError, match="METRIC>=VALUE"):
            parse_target(bad)
    rows = [{"t": 1, "pass@1": 0.5}, {"t": 2, "pass@1": math.nan}, {"t": 3, "pass@1": 0.95},
            {"t": 4, "pass@1": 0.99}]
    assert first_reaching(rows, t) == rows[2]
    assert first_reaching(rows, None) is None
    assert first_reaching(rows[:2], t) is None


def test_metric_names_list_what_an_evaluation_reports() -> None:
    names = metric_names(["copy_reward"], num_samples=4, pass_at=[1, 4, 8])
    assert names == ["reward", "pass@1", "rewards/copy_reward", "sampled_pass@1",
                     "sampled_pass@4"]
