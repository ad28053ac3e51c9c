"""The trainer's fencing token on the bus: how a write of a trainer that lost its lock is
refused inside the script that would do it.

Why a token and not a check of the lock: a trainer paused past its lock's TTL (GC, swap,
a stopped container) wakes up between any two lines of its loop, with a write already
decided. Only a check done atomically with the write itself closes that gap. Taking the
lock increments a generation (`pipeline.bus.scripts.TRAINER_LOCK`) that the holder keeps
as ``Bus.fence``; every trainer write (retire, dead-letter, ack, the announcement and the
version, `pipeline.bus.scripts.fenced`) carries it and is refused, acting on nothing,
when a ``state`` hash of its slot holds a newer generation. On Redis Cluster a lane
script cannot read the global ``state``, so the new holder copies its generation into
every lane's ``state`` (`raise_lane_fences`) before it reads or writes anything.

Invariant: once a trainer job B has returned from acquiring the lock, no script call of
an earlier holder A changes the bus. Roles other than the trainer pass no token
(``Bus.fence`` is None) and are never refused.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ResponseError


class FencedOut(RuntimeError):
    """A trainer write was refused: a newer trainer job holds the run's lock."""


def token_arg(fence: int | None) -> str:
    """The ARGV a `pipeline.bus.scripts.fenced` script takes: the generation, or ``""``
    (not a trainer: never refused)."""
    return "" if fence is None else str(int(fence))


async def call_fenced(script: Any, fence_state: str, fence: int | None,
                      keys: list[str], args: list[Any]) -> Any:
    """Run a `fenced` script with ``fence_state`` (a ``state`` hash in the slot of
    ``keys``) and the token; raise `FencedOut` if the script refused the token."""
    try:
        return await script(keys=[fence_state, *keys], args=[token_arg(fence), *args])
    except ResponseError as e:
        if str(e).startswith("FENCED"):
            raise FencedOut(
                f"a write of trainer generation {fence} was refused: the run's fence is at "
                f"generation {str(e).split()[-1]} (a newer trainer job took the lock)"
            ) from None
        raise
