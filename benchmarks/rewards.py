"""Reward functions of the bus benchmarks, named by import path in the scorers' config.

The scorers are the real `sluice score` role, which loads reward functions by import
path (``benchmarks.rewards:trivial_reward``), so these live in a module of their own
that imports nothing heavy: a scorer process pays only for what it would load anyway.

- `trivial_reward`: nearly free, and never all-equal within a group (so every group
  carries a gradient and the scorer hands it on at a nonzero advantage).
- `busy_reward`: burns ``SLUICE_BENCH_REWARD_MS`` (default 5) milliseconds of CPU per
  completion in a busy loop, measured on the calling thread's CPU clock, so a scorer
  that shares its core with others still spends the same CPU per completion (its wall
  time grows instead). An environment variable because a reward function is named by
  its import path alone; the scaling benchmark sets it for the scorers it starts.
"""

from __future__ import annotations

import os
import time
from typing import Any

REWARD_MS_ENV = "SLUICE_BENCH_REWARD_MS"


def trivial_reward(*, completions: list[Any], **_: Any) -> list[float]:
    """Completion ``i`` of the call gets ``i mod 7``: free, and varied within a group."""
    return [float(i % 7) for i in range(len(completions))]


def busy_reward(*, completions: list[Any], **_: Any) -> list[float]:
    """`trivial_reward`'s values after burning the configured CPU per completion."""
    per_completion_s = float(os.environ.get(REWARD_MS_ENV, "5")) / 1000
    end = time.thread_time() + per_completion_s * len(completions)
    spins = 0
    while time.thread_time() < end:
        spins += 1
    return trivial_reward(completions=completions)
