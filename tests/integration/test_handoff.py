"""Scorer hand-off: reclaimed after a crash, emitted exactly once."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import redis

from pipeline.bus.client import Bus
from pipeline.bus.codec import decode_entry, encode
from pipeline.bus.keys import SCORERS_GROUP, TRAINERS_GROUP, Keys
from pipeline.bus.schema import ScoredGroup
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import make_group, run_header, spawn_role, wait_for, write_config

pytestmark = pytest.mark.integration


def test_conditional_handoff_emits_once_when_two_consumers_race(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        k = bus.keys
        await bus.ensure_group(k.rollouts, SCORERS_GROUP)
        eid = await bus.xadd(k.rollouts, encode(make_group()))
        await bus.read_group(k.rollouts, SCORERS_GROUP, "a", count=1, block_ms=10)
        # consumer b reclaims a's entry (a is presumed dead), then both hand off
        claimed = await bus.reclaim(k.rollouts, SCORERS_GROUP, "b", min_idle_ms=0, count=10)
        assert [e.id for e in claimed] == [eid] and claimed[0].deliveries == 2
        first = await bus.handoff(k.rollouts, SCORERS_GROUP, eid, k.scored, b"payload", op="a1")
        second = await bus.handoff(k.rollouts, SCORERS_GROUP, eid, k.scored, b"payload", op="b1")
        assert first is not None and second is None
        # the first call retried with its op key (its reply was lost): same answer, no act
        again = await bus.handoff(k.rollouts, SCORERS_GROUP, eid, k.scored, b"payload", op="a1")
        assert again == first
        assert await bus.r.xlen(k.scored) == 1
        await bus.close()

    arun(go())


def test_pipelined_handoffs_emit_once_each_and_skip_entries_no_longer_pending(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    """`handoff_many` (a scorer's hand-offs of one read in one pipeline): each entry is
    handed on only if its ack removed a pending entry, once, even when the batch is
    retried or a racing consumer already handed one on."""
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        k = bus.keys
        try:
            await bus.ensure_group(k.rollouts, SCORERS_GROUP)
            eids = [await bus.xadd(k.rollouts, b"g%d" % i) for i in range(3)]
            await bus.read_group(k.rollouts, SCORERS_GROUP, "a", count=3, block_ms=10)
            # another consumer already handed on the second entry (a reclaim race)
            assert await bus.handoff(k.rollouts, SCORERS_GROUP, eids[1], k.scored, b"s1",
                                     op="b:1")
            batch = [(e, b"s%d" % i, f"a:{i}") for i, e in enumerate(eids)]
            got = await bus.handoff_many(k.rollouts, SCORERS_GROUP, k.scored, batch)
            assert got[0] and got[1] is None and got[2]
            assert await bus.handoff_many(k.rollouts, SCORERS_GROUP, k.scored, batch) == got
            rows = [f[b"m"] for _i, f in await bus.r.xrange(k.scored)]
            assert sorted(rows) == [b"s0", b"s1", b"s2"]
            assert (await bus.r.xpending(k.rollouts, SCORERS_GROUP))["pending"] == 0
        finally:
            await bus.close()

    arun(go())


def test_scorer_killed_between_read_and_ack_group_is_reclaimed_and_emitted_once(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "run.toml", run_header(
        run_name, tmp_path / "out", redis_server.url, claim_idle_ms=500, block_ms=100))
    keys = Keys(run_name)
    r = redis.Redis.from_url(redis_server.url)
    r.xgroup_create(keys.rollouts, SCORERS_GROUP, id="0", mkstream=True)
    r.xadd(keys.rollouts, {b"m": encode(make_group("0:7"))})

    hung = spawn_role("score", cfg, "scoring.rewards=[{fn='tests.helpers:hang_reward'}]",
                      name="doomed", log=tmp_path / "doomed.log")
    try:
        wait_for(lambda: r.xpending(keys.rollouts, SCORERS_GROUP)["pending"] == 1, 60,
                 "the doomed scorer to read the group")
        os.kill(hung.pid, signal.SIGKILL)  # between read and ack
        hung.wait(10)
    finally:
        if hung.poll() is None:
            hung.kill()
    assert r.xlen(keys.scored) == 0

    good = spawn_role("score", cfg, name="rescuer", log=tmp_path / "rescuer.log")
    try:
        wait_for(lambda: r.xlen(keys.scored) >= 1, 60, "the rescuer to hand the group on")
        wait_for(lambda: r.xpending(keys.rollouts, SCORERS_GROUP)["pending"] == 0, 10,
                 "the rollouts pending list to empty")
    finally:
        good.send_signal(signal.SIGTERM)
        assert good.wait(30) == 0, (tmp_path / "rescuer.log").read_text()[-2000:]
    entries = r.xrange(keys.scored)
    assert len(entries) == 1, "emitted exactly once"
    sg = decode_entry(entries[0][1])
    assert isinstance(sg, ScoredGroup) and sg.group.group_id == "0:7"
    assert sg.scorer.endswith("rescuer")
    # the new scorer's group was created for the trainer too
    assert any(g["name"] == TRAINERS_GROUP.encode() for g in r.xinfo_groups(keys.scored))
    r.close()
