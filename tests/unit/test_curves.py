"""benchmarks/curves.py: areas under learning curves and their bootstrap intervals, on
hand-computed cases."""

from __future__ import annotations

import math

import pytest

from benchmarks.curves import area, curve, first_reaching, mean_ci, paired_ci, value_at


def test_value_at_interpolates_and_holds_the_ends() -> None:
    pts = [(10.0, 0.2), (20.0, 0.6)]
    assert value_at(pts, 0.0) == 0.2 and value_at(pts, 15.0) == pytest.approx(0.4)
    assert value_at(pts, 99.0) == 0.6 and math.isnan(value_at([], 1.0))


def test_area_is_the_mean_of_the_piecewise_linear_curve() -> None:
    # 0 -> 1 linearly over [0, 10], then held at 1 until 20: mean = (5 + 10) / 20
    assert area([(0.0, 0.0), (10.0, 1.0)], 20.0) == pytest.approx(0.75)
    # a run that stopped early keeps its last value; one evaluated past x_max is cut there
    assert area([(0.0, 0.0), (40.0, 1.0)], 20.0) == pytest.approx(0.25)
    assert math.isnan(area([], 10.0))


def test_curve_and_first_reaching() -> None:
    evals = [{"t": 20, "r": 0.7}, {"t": 0, "r": 0.1}, {"t": 10, "r": 0.5}]
    pts = curve(evals, "t", "r")
    assert pts == [(0.0, 0.1), (10.0, 0.5), (20.0, 0.7)]
    assert first_reaching(pts, 0.5) == 10.0 and first_reaching(pts, 0.9) == math.inf


def test_bootstrap_intervals_contain_the_mean_and_pair_by_seed() -> None:
    m, lo, hi = mean_ci([0.5, 0.6, 0.7, 0.8, 0.9])
    assert m == pytest.approx(0.7) and lo < m < hi and 0.5 <= lo and hi <= 0.9
    # every seed 0.1 better: the paired interval is exactly 0.1 despite the spread
    d, dlo, dhi = paired_ci([0.6, 0.2, 0.9], [0.5, 0.1, 0.8])
    assert d == pytest.approx(0.1) and dlo == pytest.approx(0.1) and dhi == pytest.approx(0.1)
    with pytest.raises(ValueError):
        paired_ci([1.0], [1.0, 2.0])
