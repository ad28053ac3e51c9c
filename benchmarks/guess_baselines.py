"""Reference policies on the guess-the-number environment, for reading a learning curve.

    .venv/bin/python -m benchmarks.guess_baselines

The expected episode reward (`workers.environments.builtin.GuessNumber`, 5 turns, the
defaults of examples/guess.toml) of three scripted policies, over 20,000 games each with a
uniform hidden number: always guessing 5 (ignores the feedback), distinct random digits
(the format, no use of the feedback) and binary search on the ``+``/``-`` answers (the
best a policy can do in the worst case). A trained model that scores above "distinct
random digits" uses the feedback. Seeded; no model, no Redis.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from workers.environments.base import Action
from workers.environments.builtin import GuessNumber

History = list[tuple[int, str]]


def distinct_random(hist: History, rng: random.Random) -> int:
    used = {g for g, _ in hist}
    return rng.choice([d for d in range(10) if d not in used])


def binary_search(hist: History, rng: random.Random) -> int:
    lo, hi = 0, 9
    for g, hint in hist:
        lo, hi = (max(lo, g + 1), hi) if hint == "+" else (lo, min(hi, g - 1))
    return (lo + hi) // 2


def always_five(hist: History, rng: random.Random) -> int:
    return 5


async def episode(policy: Callable[[History, random.Random], int], secret: int,
                  rng: random.Random, turns: int = 5) -> float:
    env = GuessNumber()
    await env.reset({"answer": str(secret)})
    total, hist = 0.0, []
    for t in range(turns):
        guess = policy(hist, rng)
        res = await env.step(Action(str(guess), [], t))
        total += sum(res.reward.values())  # type: ignore[union-attr]
        if res.done:
            break
        hist.append((guess, str(res.observation)))
    return total


async def main(games: int = 20_000) -> None:
    rng = random.Random(0)
    for name, policy in [("always 5", always_five), ("distinct random digits", distinct_random),
                         ("binary search", binary_search)]:
        rewards = [await episode(policy, rng.randrange(10), rng) for _ in range(games)]
        print(f"{name:24s} mean episode reward {sum(rewards) / games:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
