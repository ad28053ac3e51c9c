"""Reward functions that misbehave on purpose, keyed on the ``answer`` column of a
group's prompt (`tests/integration/test_scorer_rewards.py`). Lean imports: the scorer's
reward process imports this module at every (re)start. Any other answer gets a varied,
valid reward, so the start-up probe (digits of the copy task) and good groups pass."""

from __future__ import annotations

import math
import os
import time
from typing import Any

HANG_S = 10**6


def _ok(completions: list[Any]) -> list[float]:
    return [float(len(c)) if isinstance(c, str) else 0.0 for c in completions]


def misbehaving(*, completions: list[Any], answer: list[Any], **kwargs: Any) -> Any:
    """Per answer: ``huge`` returns 10**400 (not a float), ``nan``/``inf`` non-finite,
    ``str`` a string, ``none`` None instead of a list, ``short`` one value too few,
    ``raise`` raises ValueError, ``exit`` raises SystemExit, ``hang`` sleeps ~forever,
    ``die`` ends its process at once (``os._exit``)."""
    kinds = set(answer)
    if "raise" in kinds:
        raise ValueError("misbehaving reward")
    if "exit" in kinds:
        raise SystemExit(3)
    if "hang" in kinds:
        time.sleep(HANG_S)
    if "die" in kinds:
        os._exit(7)
    if "none" in kinds:
        return None
    if "short" in kinds:
        return _ok(completions)[1:]
    special = {"huge": 10**400, "nan": math.nan, "inf": math.inf, "str": "1.0"}
    return [special.get(a, v) for a, v in zip(answer, _ok(completions), strict=True)]


async def blocking(*, completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float]:
    """An async reward that blocks its event loop (``time.sleep`` inside ``async def``)
    on answer ``block``: `asyncio.wait_for` cannot interrupt it."""
    if "block" in answer:
        time.sleep(HANG_S)
    return _ok(completions)
