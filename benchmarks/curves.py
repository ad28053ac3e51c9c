"""Learning curves of benchmark runs, summarised with honest uncertainty (pure functions).

A run's curve is its held-out evaluations: points ``(x, y)`` with ``x`` seconds since the
step-0 evaluation or samples generated so far, ``y`` the held-out reward (or exact match).
`area` is the normalised area under the curve over ``[0, x_max]``: the mean of ``y`` over
that span, the curve linear between evaluations and held at its last value after the
run's last evaluation (a run that stopped at its target keeps it). Two arms are compared
on the same seeds, so `paired_ci` bootstraps the mean of the per-seed differences; `mean_ci`
bootstraps one arm's mean. With 5 seeds a 95% interval is wide: that is the point of
printing it.
"""

from __future__ import annotations

import itertools
import math
import random
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


def mean_ci(values: Sequence[float], level: float = 0.95, n: int = 20_000,
            seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): a percentile bootstrap interval of the mean over ``values``."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan, math.nan
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(vals) for _ in vals) / len(vals) for _ in range(n))
    lo = means[int((1 - level) / 2 * n)]
    hi = means[min(n - 1, int((1 + level) / 2 * n))]
    return sum(vals) / len(vals), lo, hi


def paired_ci(a: Sequence[float], b: Sequence[float], level: float = 0.95,
              n: int = 20_000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high) of ``a[i] - b[i]`` over the pairs (the same seeds)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples of different sizes: {len(a)} and {len(b)}")
    return mean_ci([x - y for x, y in zip(a, b, strict=True)], level, n, seed)
