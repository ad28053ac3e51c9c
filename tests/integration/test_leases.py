"""Leases, idempotent scripts and the janitor against a real redis-server.

The invariants: an admitted group is appended at most once, only by its lease holder; a
dead holder's lease is taken over; a call retried after a lost reply acts once; trimming
frees only acknowledged entries; a consumer leaves its group only with nothing pending.
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline.bus.client import Bus
from pipeline.bus.keys import SCORERS_GROUP
from pipeline.ops.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import wait_for_async

pytestmark = pytest.mark.integration

LEASE_MS = 1000


def test_only_the_lease_holder_appends_and_only_once(redis_server: EmbeddedRedis,
                                                     run_name: str) -> None:
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        c = await bus.admit(4, "gen/a", lease_ms=60_000)
        assert await bus.emit(b"x", cursor=c, owner="gen/b") is None  # not b's
        first = await bus.emit(b"x", cursor=c, owner="gen/a")
        assert first is not None
        # the same call retried after a lost reply: the first answer, no second entry
        assert await bus.emit(b"x", cursor=c, owner="gen/a") == first
        assert await bus.r.xlen(bus.keys.rollouts) == 1
        st = await bus.state()
        assert st["generating"] == 0 and await bus.r.hlen(bus.keys.leases) == 0
        await bus.close()

    arun(go())


def test_expired_lease_is_taken_over_and_the_old_holder_is_refused(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        # leases long enough that the calls below all fall inside them on a slow machine
        c0 = await bus.admit(4, "gen/dead", lease_ms=LEASE_MS)
        c1 = await bus.admit(4, "gen/alive", lease_ms=LEASE_MS)
        assert await bus.takeover("gen/new", 60_000, max_count=10) == []  # none expired yet
        assert await bus.renew("gen/alive", [c1], 60_000) == []  # alive: keeps its lease
        # the first takeover after the dead holder's deadline gets its lease, only that one
        got = await wait_for_async(lambda: bus.takeover("gen/new", 60_000, max_count=10),
                                   30, "gen/dead's lease to expire and be taken over")
        assert got == [c0]
        assert await bus.renew("gen/dead", [c0], 60_000) == [c0]  # it lost it
        assert await bus.emit(b"late", cursor=c0, owner="gen/dead") is None
        assert await bus.abandon("0:0", cursor=c0, owner="gen/dead", reason="x",
                                 role="r") is False
        assert await bus.emit(b"x", cursor=c0, owner="gen/new") is not None
        assert await bus.r.xlen(bus.keys.rollouts) == 1
        st = await bus.state()
        assert st["cursor"] == 2 and st["generating"] == 1  # c1 still being generated
        await bus.close()

    arun(go())


def test_abandon_retires_dead_once_even_when_retried(redis_server: EmbeddedRedis,
                                                     run_name: str) -> None:
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        c = await bus.admit(4, "g")
        for _ in range(2):
            assert await bus.abandon("0:5", cursor=c, owner="g", reason="engine gone",
                                     role="generator/g") is True
        st = await bus.state()
        assert (st["retired"], st["retired:dead"], st["generating"]) == (1, 1, 0)
        assert await bus.r.xlen(bus.keys.dlq) == 1
        await bus.close()

    arun(go())


def test_trim_frees_only_acknowledged_entries(redis_server: EmbeddedRedis,
                                              run_name: str) -> None:
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        k = bus.keys
        await bus.ensure_group(k.rollouts, SCORERS_GROUP)
        ids = [await bus.xadd(k.rollouts, b"%d" % i) for i in range(10)]
        assert await bus.trim_acked(k.rollouts, SCORERS_GROUP, keep=0) == 0  # none delivered
        got = await bus.read_group(k.rollouts, SCORERS_GROUP, "c", count=6, block_ms=10)
        await bus.ack(k.rollouts, SCORERS_GROUP, *[e.id for e in got[:2]], got[3].id)
        # ids 0,1 acked; 2 pending; 3 acked (behind a pending one); 4,5 pending; 6-9 new
        assert await bus.trim_acked(k.rollouts, SCORERS_GROUP, keep=0) == 2
        left = [i.decode() for i, _ in await bus.r.xrange(k.rollouts)]
        assert left == ids[2:]
        await bus.ack(k.rollouts, SCORERS_GROUP, got[2].id, got[4].id, got[5].id)
        # all delivered entries acked: trims up to (not including) the last delivered one,
        # or fewer to keep a tail of `keep` entries
        assert await bus.trim_acked(k.rollouts, SCORERS_GROUP, keep=6) == 2
        assert [i.decode() for i, _ in await bus.r.xrange(k.rollouts)] == ids[4:]
        assert await bus.trim_acked(k.rollouts, SCORERS_GROUP, keep=0) == 1
        assert [i.decode() for i, _ in await bus.r.xrange(k.rollouts)] == ids[5:]
        await bus.close()

    arun(go())


def test_consumer_leaves_the_group_only_with_nothing_pending(redis_server: EmbeddedRedis,
                                                            run_name: str) -> None:
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        k = bus.keys
        await bus.ensure_group(k.rollouts, SCORERS_GROUP)
        await bus.xadd(k.rollouts, b"x")
        (e,) = await bus.read_group(k.rollouts, SCORERS_GROUP, "busy", count=1, block_ms=10)
        await bus.read_group(k.rollouts, SCORERS_GROUP, "idle", count=1, block_ms=10)
        assert await bus.retire_consumer(k.rollouts, SCORERS_GROUP, "busy") is False
        assert await bus.retire_consumer(k.rollouts, SCORERS_GROUP, "idle") is True
        names = {c["name"] for c in await bus.r.xinfo_consumers(k.rollouts, SCORERS_GROUP)}
        assert names == {b"busy"}
        await asyncio.sleep(0.05)
        assert await bus.prune_consumers(k.rollouts, SCORERS_GROUP, idle_ms=10) == 0  # pending
        await bus.ack(k.rollouts, SCORERS_GROUP, e.id)
        assert await bus.prune_consumers(k.rollouts, SCORERS_GROUP, idle_ms=10) == 1
        await bus.close()

    arun(go())


def test_pipelined_emits_act_once_each_and_only_for_the_lease_holder(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    """`emit_many` sends a batch of EMIT scripts in one pipeline: each appends only with
    its lease, a retried batch appends nothing twice, and a Redis that lost its script
    cache (SCRIPT FLUSH, as after a restart) gets the script loaded again."""
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        try:
            cursors = (await bus.admit_many(8, "gen/a", 60_000, 3)).cursors
            other = await bus.admit(8, "gen/b")
            batch = [(c, b"g%d" % c, f"emit:{c}:gen/a") for c in [*cursors, other]]
            await bus.r.script_flush()
            ids = await bus.emit_many(batch, "gen/a")
            assert all(ids[:3]) and ids[3] is None  # gen/b's cursor: not ours
            assert await bus.emit_many(batch, "gen/a") == ids  # retried: same answers
            rows = await bus.r.xrange(bus.keys.rollouts)
            assert [f[b"m"] for _i, f in rows] == [b"g0", b"g1", b"g2"]
            st = await bus.state()
            assert st["generating"] == 1 and await bus.r.hlen(bus.keys.leases) == 1
            assert await bus.emit_many([], "gen/a") == []
        finally:
            await bus.close()

    arun(go())
