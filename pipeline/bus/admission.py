"""The generator's writes on the bus: admission and its leases (`AdmissionWrites`, a part
of `pipeline.bus.client.Bus`).

Each admitted cursor is leased to its generator (``leases`` hash, ``owner|deadline_ms``);
appending (`emit`), abandoning or skipping the group requires the lease and releases it in
the same script, and expired leases (a dead generator) are taken over (`takeover`). So
an admitted group is appended at most once and never stranded. The scripts run in the
generator's op namespace (`pipeline.bus.keys.Keys.op`), idempotent per op id: a call
retried after a lost reply returns the first call's result. With lanes
(`pipeline.bus.lanes`) a global cursor is ``local * partitions + lane``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from pipeline.bus import scripts as lua
from pipeline.bus.codec import FIELD
from pipeline.bus.keys import Keys
from pipeline.bus.lanes import Lanes
from pipeline.bus.replies import as_str


@dataclass
class Admission:
    """What one admission call got: its cursors (possibly none: the gate is closed) and
    ``state.version`` when they were admitted."""

    version: int
    cursors: list[int]


class AdmissionWrites:
    """Admission, leases and appends of admitted groups; mixed into `Bus`, which sets
    ``r``, ``keys`` and ``lanes`` and calls `_init_admission` once in its constructor."""

    r: aioredis.Redis
    keys: Keys
    lanes: Lanes

    def _init_admission(self, client: aioredis.Redis) -> None:
        """Register the admission scripts on ``client`` and start admitting at lane 0."""
        self._next_lane = 0  # where the next admission starts (round-robin over lanes)
        self._admit: Any = client.register_script(lua.ADMIT)
        self._renew: Any = client.register_script(lua.RENEW)
        self._takeover: Any = client.register_script(lua.TAKEOVER)
        self._emit: Any = client.register_script(lua.EMIT)
        self._abandon: Any = client.register_script(lua.ABANDON)
        self._skip: Any = client.register_script(lua.SKIP)

    async def admit_many(self, window: int, owner: str, lease_ms: int, count: int,
                         op: str | None = None) -> Admission:
        """Claim up to ``count`` admission cursors (fewer as the window allows: in flight
        stays below ``window``), each leased to ``owner`` for ``lease_ms`` (renew with
        `renew`), in one script call; with the run's ``state.version`` at that moment.
        Idempotent per ``op`` (default: a fresh one per call), so a call retried after a
        lost reply gets the same cursors instead of leaking leases to expiry."""
        op = op or f"admit:{owner}:{uuid.uuid4().hex}"
        lanes = self.lanes
        if lanes.partitions == 1:
            got = await self._admit(keys=[self.keys.state, self.keys.leases,
                                          self.keys.op("generator", op)],
                                    args=[window, owner, lease_ms, max(count, 0)])
            return Admission(version=int(got[0]), cursors=[int(c) for c in got[1:]])
        # with lanes: each lane admits within its share of the window, starting where the
        # last call left off so the lanes fill evenly; one op per lane keeps it idempotent
        cursors: list[int] = []
        version = 0
        for i in range(lanes.partitions):
            lane = (self._next_lane + i) % lanes.partitions
            k = lanes.keys[lane]
            got = await self._admit(keys=[k.state, k.leases, k.op("generator", f"{op}:{lane}")],
                                    args=[lanes.window(window, lane), owner, lease_ms,
                                          max(count - len(cursors), 0)])
            version = max(version, int(got[0]))
            cursors += [lanes.join(lane, int(c)) for c in got[1:]]
            if len(cursors) >= count:
                break
        self._next_lane = (self._next_lane + 1) % lanes.partitions
        return Admission(version=version, cursors=cursors)

    async def admit(self, window: int, owner: str = "anon", lease_ms: int = 60_000
                    ) -> int | None:
        """Claim the next admission cursor if fewer than ``window`` groups are in flight
        (`admit_many` of one)."""
        cursors = (await self.admit_many(window, owner, lease_ms, 1)).cursors
        return cursors[0] if cursors else None

    async def renew(self, owner: str, cursors: list[int], lease_ms: int) -> list[int]:
        """Extend ``owner``'s leases; returns the cursors it no longer holds."""
        if not cursors:
            return []
        lost: list[int] = []
        for lane, locals_ in self._by_lane(cursors).items():
            k = self.lanes.keys[lane]
            got = await self._renew(keys=[k.leases], args=[owner, lease_ms, *locals_])
            lost += [self.lanes.join(lane, int(c)) for c in got or []]
        return lost

    def _by_lane(self, cursors: list[int]) -> dict[int, list[int]]:
        """Global cursors grouped by lane, as local cursors."""
        out: dict[int, list[int]] = {}
        for c in cursors:
            out.setdefault(c % self.lanes.partitions, []).append(c // self.lanes.partitions)
        return out

    async def takeover(self, owner: str, lease_ms: int, max_count: int) -> list[int]:
        """Take over up to ``max_count`` expired leases (admitted groups whose generator
        died before appending them); the caller must generate and emit them."""
        taken: list[int] = []
        for lane, k in enumerate(self.lanes.keys):
            if len(taken) >= max_count:
                break
            got = await self._takeover(keys=[k.leases],
                                       args=[owner, lease_ms, max_count - len(taken)])
            taken += [self.lanes.join(lane, int(c)) for c in got or []]
        return taken

    async def emit(self, payload: bytes, *, cursor: int, owner: str,
                   op: str | None = None) -> str | None:
        """Append the admitted group ``cursor`` to ``rollouts`` if ``owner`` still holds its
        lease (and count it out of ``generating``); None if it does not (the lease was
        taken over: the new owner appends it). Idempotent per op (default: per cursor and
        owner)."""
        return (await self.emit_many([(cursor, payload, op or f"emit:{cursor}:{owner}")],
                                     owner))[0]

    async def emit_many(self, groups: list[tuple[int, bytes, str]], owner: str
                        ) -> list[str | None]:
        """`emit` of several ``(cursor, payload, op)`` in one round trip
        (`pipeline.bus.scripts.pipelined`); the new ids (None where ``owner`` had lost the
        lease), in order."""
        calls = []
        for cursor, payload, op in groups:
            k, local = self.lanes.split(cursor)
            calls.append(([k.rollouts, k.state, k.leases, k.op("generator", op)],
                          [local, owner, FIELD, payload]))
        got = await lua.pipelined(self.r, self._emit, calls)
        return [as_str(i) if i else None for i in got]

    async def abandon(self, group_id: str, *, cursor: int, owner: str, reason: str,
                      role: str, op: str | None = None) -> bool:
        """Retire an admitted group that will never be appended (its generation failed
        for good) as ``dead``, with a dlq record naming it and the reason; only while
        ``owner`` holds its lease. Idempotent per (cursor, owner)."""
        k, local = self.lanes.split(cursor)
        done = await self._abandon(
            keys=[k.state, k.dlq, k.leases,
                  k.op("generator", op or f"abandon:{cursor}:{owner}")],
            args=[local, owner, b"reason", reason.encode()[:2000], b"role", role.encode(),
                  b"group_id", group_id.encode(), b"t", str(time.time()).encode()])
        return bool(done)

    async def skip(self, cursor: int, *, owner: str, op: str, epoch: int = 0) -> bool:
        """Retire an admitted group ``filtered`` without generating it (its prompt was
        skipped by the prompt filter) and count it in its lane's ``skipped[epoch]``; only
        while ``owner`` holds its lease. Idempotent per op."""
        k, local = self.lanes.split(cursor)
        return bool(await self._skip(keys=[k.state, k.leases, k.skipped,
                                           k.op("generator", op)],
                                     args=[local, owner, int(epoch)]))

    async def skipped_in_epoch(self, epoch: int) -> int:
        """How many cursors of ``epoch`` the prompt filter skipped, every lane summed
        (`skip`): the run's dataset size means the filter rejected the whole epoch."""
        got = [await self.r.hget(k.skipped, str(int(epoch))) for k in self.lanes.keys]
        return sum(int(v or 0) for v in got)

