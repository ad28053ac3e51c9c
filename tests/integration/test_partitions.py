"""The bus in lanes (`bus.partitions`) on a real redis-server: admission shares the window
over the lanes, every group stays in its lane from admission to retirement, the version
reaches every lane, and a run resumed with another partition count is refused."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.bus.client import Bus
from pipeline.bus.keys import SCORERS_GROUP, TRAINERS_GROUP
from pipeline.config import ConfigError, load_config
from pipeline.runtime import connect
from sluice.embedded import EmbeddedRedis
from sluice.monitor import snapshot
from tests.conftest import arun


def test_a_group_lives_in_one_lane_and_the_lanes_add_up(redis_server: EmbeddedRedis,
                                                        run_name: str) -> None:
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name, partitions=3)
        try:
            for k in bus.lanes.keys:
                await bus.ensure_group(k.rollouts, SCORERS_GROUP)
                await bus.ensure_group(k.scored, TRAINERS_GROUP)
            await bus.set_version(4)
            got = await bus.admit_many(7, "gen/a", 60_000, 10)
            assert got.version == 4  # the admission script reads its lane's mirror
            assert sorted(got.cursors) == sorted(set(got.cursors)) and len(got.cursors) == 7
            assert sorted(c % 3 for c in got.cursors) == [0, 0, 0, 1, 1, 2, 2]  # 3 + 2 + 2
            assert (await bus.admit_many(7, "gen/a", 60_000, 1)).cursors == []  # window full
            ids = await bus.emit_many([(c, b"g%d" % c, f"emit:{c}") for c in got.cursors],
                                      "gen/a")
            assert all(ids)
            for k, n in zip(bus.lanes.keys, (3, 2, 2), strict=True):
                assert await bus.r.xlen(k.rollouts) == n
            snap = await snapshot(bus)
            assert snap["conservation"]["balanced"] and snap["lengths"]["rollouts"] == 7
            # scorers: each read is one lane's; hand-offs stay in the lane
            handed = 0
            while handed < 7:
                es = await bus.read_lanes("rollouts", SCORERS_GROUP, "s", count=10,
                                          block_ms=100)
                assert len({e.stream for e in es}) <= 1
                for e in es:
                    dst = bus.lanes.of_stream(e.stream).scored
                    assert await bus.handoff(e.stream, SCORERS_GROUP, e.id, dst, e.fields[b"m"],
                                             op=f"h:{e.id}")
                handed += len(es)
            # the trainer: entries of several lanes in one step, retired lane by lane
            step = []
            while len(step) < 7:
                step += await bus.read_lanes("scored", TRAINERS_GROUP, "t", count=10,
                                             block_ms=100)
            assert {e.stream for e in step} == {k.scored for k in bus.lanes.keys}
            for stream in {e.stream for e in step}:
                ids = [e.id for e in step if e.stream == stream]
                assert await bus.retire(stream, TRAINERS_GROUP, ids, "trained",
                                        op="trained:1") == ids
            st = await bus.state()
            assert st["cursor"] == 7 and st["retired"] == 7 and st["retired:trained"] == 7
            assert st["version"] == 4
            snap = await snapshot(bus)
            assert snap["conservation"]["balanced"] and snap["conservation"]["in_flight"] == 0
            assert len((await bus.admit_many(7, "gen/a", 60_000, 7)).cursors) == 7  # open
        finally:
            await bus.close()

    arun(go())


def test_expired_leases_are_taken_over_in_every_lane(redis_server: EmbeddedRedis,
                                                     run_name: str) -> None:
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name, partitions=3)
        try:
            dead = (await bus.admit_many(6, "gen/dead", 1, 6)).cursors
            assert {c % 3 for c in dead} == {0, 1, 2}
            await asyncio.sleep(0.05)
            taken = await bus.takeover("gen/b", 60_000, 10)
            assert sorted(taken) == sorted(dead)  # global cursors, every lane
            assert await bus.renew("gen/b", taken, 60_000) == []
            assert sorted(await bus.renew("gen/dead", dead, 60_000)) == sorted(dead)  # lost
        finally:
            await bus.close()

    arun(go())


def test_a_run_resumed_with_another_partition_count_is_refused(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    base = [f"run.name={run_name}", f"bus.redis_url={redis_server.url}"]
    arun(connect(load_config(None, [*base, "bus.partitions=3"]), "trainer").close())
    with pytest.raises(ConfigError, match=r"bus\.partitions = 1, but this run was created "
                                          r"with 3"):
        connect(load_config(None, base), "generator")
    arun(connect(load_config(None, [*base, "bus.partitions=3"]), "scorer").close())  # same: ok


def test_partitions_cannot_exceed_the_admission_window() -> None:
    with pytest.raises(ConfigError, match=r"bus\.partitions"):
        load_config(None, ["bus.partitions=9", "trainer.admission_window=8"])
