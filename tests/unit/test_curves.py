"""benchmarks/curves.py: areas under learning curves and their t intervals, on
hand-computed cases."""

from __future__ import annotations

import math

import pytest

from benchmarks.curves import (
    area,
    curve,
    first_reaching,
    mean_ci,
    paired_ci,
    t_quantile,
    value_at,
)


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


def test_t_quantiles_match_the_tables() -> None:
    # two-sided 95% and 90% critical values from any t table
    for df, t95 in ((1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (30, 2.042)):
        assert t_quantile(0.95, df) == pytest.approx(t95, abs=1e-3)
    assert t_quantile(0.90, 4) == pytest.approx(2.132, abs=1e-3)
    with pytest.raises(ValueError):
        t_quantile(0.95, 0)


def test_t_intervals_contain_the_mean_and_pair_by_seed() -> None:
    # mean 0.7, sd 0.1581, n 5: half-width 2.776 * 0.1581 / sqrt(5) = 0.1963
    m, lo, hi = mean_ci([0.5, 0.6, 0.7, 0.8, 0.9])
    assert m == pytest.approx(0.7) and lo == pytest.approx(0.5037, abs=1e-4)
    assert hi == pytest.approx(0.8963, abs=1e-4)
    # wider than the observed range with 3 seeds (t = 4.30), where a bootstrap never is
    _, lo3, hi3 = mean_ci([0.5, 0.6, 0.7])
    assert lo3 < 0.5 and hi3 > 0.7
    # every seed 0.1 better: the paired interval is exactly 0.1 despite the spread
    d, dlo, dhi = paired_ci([0.6, 0.2, 0.9], [0.5, 0.1, 0.8])
    assert d == pytest.approx(0.1) and dlo == pytest.approx(0.1) and dhi == pytest.approx(0.1)
    one = mean_ci([0.4])
    assert one[0] == 0.4 and math.isnan(one[1]) and math.isnan(one[2])
    with pytest.raises(ValueError):
        paired_ci([1.0], [1.0, 2.0])


def test_sign_flip_p_is_exact_on_small_cases() -> None:
    from benchmarks.curves import sign_flip_p

    # 3 seeds all one way: only the all-plus and all-minus patterns are as extreme
    assert sign_flip_p([0.1, 0.2, 0.3]) == 2 / 8
    assert sign_flip_p([0.1, 0.2, 0.3, 0.4, 0.5]) == 2 / 32
    # a tie with 0 everywhere: every pattern is as extreme
    assert sign_flip_p([0.0, 0.0]) == 1.0
    # mixed signs: |0.3 - 0.1| = 0.2; patterns with |sum| >= 0.2: (+,-),(-,+),(+,+),(-,-)
    assert sign_flip_p([0.3, -0.1]) == 1.0
    # |1 + 1 - 0.5| = 1.5: (+,+,-) (-,-,+) (+,+,+)=2.5 (-,-,-) -> 4 of 8
    assert sign_flip_p([1.0, 1.0, -0.5]) == 4 / 8
