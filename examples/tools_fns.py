"""Plain functions for `examples/tools.toml` (``environment.tools``): a user's own module,
named by import path as reward functions are. A tool is any typed function with a
Google-style docstring (transformers' ``get_json_schema`` reads both); sync functions run
in a worker thread, async ones on the generator's loop."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


async def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def final_answer_reward(*, completions: Sequence[Any], answer: Sequence[Any],
                        **kwargs: Any) -> list[float]:
    """1.0 iff the last integer of the episode's final answer equals ``answer``: the text
    after the last tool response (an episode's completion is its transcript)."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        text = c if isinstance(c, str) else str(c[-1].get("content", ""))
        final = text.rsplit("</tool_response>", 1)[-1]
        found = re.findall(r"-?\d+", final)
        out.append(float(bool(found) and found[-1] == str(a)))
    return out
