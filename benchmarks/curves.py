"""Learning curves of benchmark runs, summarised with honest uncertainty (pure functions).

A run's curve is its held-out evaluations: points ``(x, y)`` with ``x`` seconds on the
run's clock (when the evaluated weights existed) or samples generated so far, ``y`` the
held-out reward (or exact match).
`area` is the normalised area under the curve over ``[0, x_max]``: the mean of ``y`` over
that span, the curve linear between evaluations and held at its last value after the
run's last evaluation (a run that stopped at its target keeps it). Two arms are compared
on the same seeds, so `paired_ci` is the interval of the mean of the per-seed differences;
`mean_ci` that of one arm's mean. Both are Student-t intervals (mean +- t * s / sqrt(n),
n - 1 degrees of freedom): with 3-5 seeds a percentile bootstrap is too narrow (it can
never reach beyond the observed values, and with 3 seeds it has only 10 distinct
resampled means), while the t interval accounts for estimating the spread from so few
seeds. With 3 seeds a 95% interval is wide (t = 4.30): that is the point of printing it.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

Point = tuple[float, float]


def curve(evals: Sequence[dict[str, float]], x: str, y: str) -> list[Point]:
    """``(x, y)`` points of a run's evaluations, sorted by ``x``."""
    return sorted((float(e[x]), float(e[y])) for e in evals)


def value_at(points: Sequence[Point], x: float) -> float:
    """The curve at ``x``: linear between points, the first value before the first point,
    the last value after the last. NaN for an empty curve."""
    if not points:
        return math.nan
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def area(points: Sequence[Point], x_max: float) -> float:
    """Mean of the curve over ``[0, x_max]`` (exact for the piecewise-linear curve)."""
    if not points or x_max <= 0:
        return math.nan
    xs = sorted({0.0, x_max, *(p[0] for p in points if 0 < p[0] < x_max)})
    total = 0.0
    for a, b in itertools.pairwise(xs):
        total += (value_at(points, a) + value_at(points, b)) / 2 * (b - a)
    return total / x_max


def first_reaching(points: Sequence[Point], threshold: float) -> float:
    """The first ``x`` whose ``y`` reaches ``threshold`` (inf when never)."""
    return next((x for x, y in points if y >= threshold), math.inf)


def t_quantile(level: float, df: int) -> float:
    """The ``t`` with P(|T| <= t) = ``level`` for Student's T with ``df`` degrees of
    freedom: bisection on the closed-form CDF of integer ``df`` (Abramowitz & Stegun
    26.7.3-4), so no scipy; t_quantile(0.95, 2) = 4.303, (0.95, 4) = 2.776."""
    if df < 1 or not 0 < level < 1:
        raise ValueError(f"t quantile of level {level} with {df} degrees of freedom")

    def inside(t: float) -> float:  # P(|T| <= t)
        theta = math.atan(t / math.sqrt(df))
        c2 = math.cos(theta) ** 2
        if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 c2 + 2*4/(3*5) c2^2 + ...))
            term, total = 1.0, 1.0 if df > 1 else 0.0
            for k in range(1, (df - 1) // 2):
                term *= 2 * k / (2 * k + 1) * c2
                total += term
            return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
        term, total = 1.0, 1.0  # even: sin (1 + 1/2 c2 + 1*3/(2*4) c2^2 + ...)
        for k in range(1, df // 2):
            term *= (2 * k - 1) / (2 * k) * c2
            total += term
        return math.sin(theta) * total

    lo, hi = 0.0, 1.0
    while inside(hi) < level:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if inside(mid) < level else (lo, mid)
    return (lo + hi) / 2


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the Student-t interval of the mean over ``values`` (NaNs left
    out); low = high = NaN with fewer than 2 values (no spread to estimate)."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan, math.nan
    m = statistics.fmean(vals)
    if len(vals) < 2:
        return m, math.nan, math.nan
    half = t_quantile(level, len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals))
    return m, m - half, m + half


def paired_ci(a: Sequence[float], b: Sequence[float],
              level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of ``a[i] - b[i]`` over the pairs (the same seeds): the t
    interval of the per-seed differences."""
    if len(a) != len(b):
        raise ValueError(f"paired samples of different sizes: {len(a)} and {len(b)}")
    return mean_ci([x - y for x, y in zip(a, b, strict=True)], level)


def sign_flip_p(diffs: Sequence[float]) -> float:
    """Exact two-sided p-value of the paired sign-flip (permutation) test: under "no
    difference" each per-seed difference is as likely negated, so the p-value is the
    share of the 2^n sign patterns whose |mean| is at least the observed |mean|. It
    assumes nothing about the differences' distribution; its smallest possible value is
    2 / 2^n (0.25 with 3 seeds, 0.0625 with 5), which says how many seeds a claim needs."""
    d = [float(x) for x in diffs]
    if not d:
        return math.nan
    observed = abs(sum(d)) - 1e-12 * max(1.0, *map(abs, d))
    patterns = list(itertools.product((1.0, -1.0), repeat=len(d)))
    hits = sum(abs(sum(s * x for s, x in zip(signs, d, strict=True))) >= observed
               for signs in patterns)
    return hits / len(patterns)
