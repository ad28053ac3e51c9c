"""Admission gate and retire counters against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.bus.client import Bus
from pipeline.bus.keys import SCORERS_GROUP
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun

pytestmark = pytest.mark.integration


def test_gate_never_exceeds_window_under_concurrent_generators(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    window = 12

    async def generator(i: int, admitted: list[int]) -> None:
        bus = Bus.connect(redis_server.url, run_name)
        try:
            for _ in range(50):
                c = await bus.admit(window)
                if c is not None:
                    admitted.append(c)
                await asyncio.sleep(0)
        finally:
            await bus.close()

    async def go() -> tuple[list[int], dict[str, int]]:
        admitted: list[int] = []
        await asyncio.gather(*(generator(i, admitted) for i in range(8)))
        bus = Bus.connect(redis_server.url, run_name)
        st = await bus.state()
        await bus.close()
        return admitted, st

    admitted, st = arun(go())
    assert sorted(admitted) == list(range(window)), "each cursor once, and no more than window"
    assert st["cursor"] == window and st["generating"] == window


def test_retire_reopens_gate_and_counts_each_entry_once(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        k = bus.keys
        await bus.ensure_group(k.rollouts, SCORERS_GROUP)
        cursors = [await bus.admit(3, "g") for _ in range(3)]
        assert cursors == [0, 1, 2]
        assert await bus.admit(3, "g") is None  # closed: 3 in flight
        ids = [await bus.emit(b"x", cursor=c, owner="g") for c in cursors]
        entries = await bus.read_group(k.rollouts, SCORERS_GROUP, "c1", count=10, block_ms=10)
        assert [e.id for e in entries] == ids
        assert await bus.retire(k.rollouts, SCORERS_GROUP, ids[:2], "filtered", op="r1") == ids[:2]
        # the same call retried after a lost reply: the first answer, nothing counted again
        assert await bus.retire(k.rollouts, SCORERS_GROUP, ids[:2], "filtered", op="r1") == ids[:2]
        # the same entries again (a redelivery or a racing consumer): no double count
        assert await bus.retire(k.rollouts, SCORERS_GROUP, ids[:2], "filtered", op="r2") == []
        st = await bus.state()
        assert st["retired"] == 2 and st["retired:filtered"] == 2 and st["generating"] == 0
        assert await bus.admit(3) == 3
        assert await bus.admit(3) == 4
        assert await bus.admit(3) is None
        await bus.close()

    arun(go())


def test_retire_rejects_unknown_reason(redis_server: EmbeddedRedis, run_name: str) -> None:
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        with pytest.raises(ValueError, match="reason"):
            await bus.retire(bus.keys.rollouts, SCORERS_GROUP, ["1-0"], "lost", op="x")
        await bus.close()

    arun(go())


def test_batched_admission_fills_the_window_once_with_the_version(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    """One ADMIT call takes up to N cursors, no more than the window allows, each leased
    to its caller; the reply carries ``state.version``; a retry with the same op (after a
    lost reply) returns the same cursors without admitting more."""
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        try:
            first = await bus.admit_many(5, "gen/a", 60_000, 3, op="adm1")
            assert first.cursors == [0, 1, 2] and first.version == 0
            assert await bus.admit_many(5, "gen/a", 60_000, 3, op="adm1") == first  # retried
            await bus.set_version(4)
            second = await bus.admit_many(5, "gen/b", 60_000, 3)  # only 2 fit the window
            assert second.cursors == [3, 4] and second.version == 4
            closed = await bus.admit_many(5, "gen/b", 60_000, 3)
            assert closed.cursors == [] and closed.version == 4
            assert (await bus.admit_many(5, "gen/b", 60_000, 0)).cursors == []  # version only
            leases = {int(k): v.decode().split("|")[0]
                      for k, v in (await bus.r.hgetall(bus.keys.leases)).items()}
            assert leases == {0: "gen/a", 1: "gen/a", 2: "gen/a", 3: "gen/b", 4: "gen/b"}
            st = await bus.state()
            assert st["cursor"] == 5 and st["generating"] == 5
        finally:
            await bus.close()

    arun(go())


def test_batched_admission_never_exceeds_the_window_under_concurrent_generators(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    window = 13

    async def generator(admitted: list[int]) -> None:
        bus = Bus.connect(redis_server.url, run_name)
        try:
            for _ in range(20):
                admitted += (await bus.admit_many(window, "g", 60_000, 4)).cursors
                await asyncio.sleep(0)
        finally:
            await bus.close()

    async def go() -> list[int]:
        admitted: list[int] = []
        await asyncio.gather(*(generator(admitted) for _ in range(6)))
        return admitted

    assert sorted(arun(go())) == list(range(window))
