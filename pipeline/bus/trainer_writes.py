"""The trainer's own writes on the bus (`TrainerWrites`, a part of
`pipeline.bus.client.Bus`): its lock, the lanes' fences, the weight announcement and the
version.

Only the trainer calls these. The announcement and the version are fenced
(`pipeline.bus.fencing`): a trainer that lost its lock moves nothing, because the check
of its generation runs inside the script that writes. The lock script hands out that
generation, and the new holder raises every lane's fence before it reads or writes.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from pipeline.bus import scripts as lua
from pipeline.bus.codec import FIELD
from pipeline.bus.fencing import call_fenced, token_arg
from pipeline.bus.keys import Keys
from pipeline.bus.lanes import Lanes
from pipeline.bus.replies import as_str


class TrainerWrites:
    """The trainer lock, fences, announcement and version; mixed into `Bus`, which sets
    ``r``, ``keys``, ``lanes`` and ``fence`` (the lock's generation, None for every other
    role) and calls `_init_trainer_writes` once in its constructor."""

    r: aioredis.Redis
    keys: Keys
    lanes: Lanes
    fence: int | None

    def _init_trainer_writes(self, client: aioredis.Redis) -> None:
        """Register the trainer's scripts on ``client`` (the fenced ones wrapped by
        `pipeline.bus.scripts.fenced`)."""
        self._trainer_lock: Any = client.register_script(lua.TRAINER_LOCK)
        self._raise_fence: Any = client.register_script(lua.RAISE_FENCE)
        self._release: Any = client.register_script(lua.RELEASE_LOCK)
        self._announce: Any = client.register_script(lua.fenced(lua.ANNOUNCE))
        self._set_version: Any = client.register_script(lua.fenced(lua.SET_VERSION))

    async def trainer_lock(self, holder: str, ttl_ms: int, token: int | None = None
                           ) -> tuple[str, int, bool]:
        """Acquire (``token`` None: a new generation) or refresh (``token``: the
        generation ``holder`` holds) the run's trainer lock (`pipeline.bus.scripts.
        TRAINER_LOCK`); returns (the holder after the call: ``holder`` itself, the job
        that holds it, or ``""``; the generation: the fencing token,
        `pipeline.bus.fencing`; whether this call set the lock: taken, or taken back
        after it expired)."""
        got, gen, taken = await self._trainer_lock(
            keys=[self.keys.trainer_lock, self.keys.state],
            args=[holder, ttl_ms, token_arg(token)])
        return as_str(got), int(gen), bool(taken)

    async def raise_lane_fences(self, generation: int) -> None:
        """Copy the lock's generation into every lane's ``state`` (only forward), where
        the lanes' fenced scripts read it: the new holder does this before anything else."""
        for key in self.lanes.state_keys():
            await self._raise_fence(keys=[key], args=[generation])

    async def release_trainer_lock(self, holder: str) -> None:
        """Drop the lock if ``holder`` has it, in one compare-and-delete script (a clean
        stop frees the run at once; never deletes another job's lock)."""
        await self._release(keys=[self.keys.trainer_lock], args=[holder])

    async def announce(self, payload: bytes, version: int, *, maxlen: int) -> str:
        """Append a weight announcement to ``control`` and move the global
        ``state.version`` in one fenced script, then the lanes' mirrors
        (`set_version`); returns the entry id."""
        entry = await call_fenced(self._announce, self.keys.state, self.fence,
                                  [self.keys.control, self.keys.state],
                                  [maxlen, version, FIELD, payload])
        await self.set_version(version)
        return as_str(entry)

    async def set_version(self, version: int) -> bool:
        """Move ``state.version`` forward, in the global state and its mirror in every
        lane (where the admission script reads it); True if the global one moved.
        Fenced: a trainer that lost its lock moves nothing."""
        moved = [bool(await call_fenced(self._set_version, key, self.fence, [key], [version]))
                 for key in self.lanes.state_keys()]
        return moved[0]

