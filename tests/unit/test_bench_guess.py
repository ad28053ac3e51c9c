"""benchmarks/guess_baselines.py: the reference policies rank as their strategies say."""

from __future__ import annotations

import asyncio
import random

import pytest

from benchmarks.guess_baselines import always_five, binary_search, distinct_random, episode


def test_binary_search_beats_random_digits_beats_a_constant_guess() -> None:
    rng = random.Random(1)

    def mean(policy: object) -> float:
        return sum(asyncio.run(episode(policy, s, rng)) for s in range(10)) / 10  # type: ignore[arg-type]

    bs, rnd, five = mean(binary_search), mean(distinct_random), mean(always_five)
    assert bs > rnd > five
    # secret 5: found on turn 0 (1.0 + format 0.1); else format 0.1 + near credit of 5
    near = sum(0.3 * max(0, 1 - abs(5 - s) / 10) for s in range(10) if s != 5)
    assert five == pytest.approx((1.1 + 9 * 0.1 + near) / 10)
