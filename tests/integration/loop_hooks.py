"""A reward and a prompt filter for tests/integration/test_rollout_loop.py, in a module
of their own that imports nothing heavy: the scorer's reward process and a `sluice
generate` child import it by path, and importing the test module (the generator, the
scorer, the supervisor) there cost a loaded 2-core machine over a minute."""

from __future__ import annotations

from typing import Any


def even(text: str) -> bool:
    return int(text[0]) % 2 == 0


def solved_if_even(*, prompts: list[Any], completions: list[Any], **kw: Any) -> list[float]:
    """1.0 (solved) for every completion of a prompt starting with an even digit; for the
    others 0 to 0.4 by the completion's characters (never solved, and some spread)."""
    return [1.0 if even(p) else 0.1 * (sum(map(ord, c)) % 5)
            for p, c in zip(prompts, completions, strict=True)]


def reject_all(prompt: dict[str, Any]) -> bool:
    return False
