"""Admission gate and retire counters against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.bus.client import Bus
from pipeline.bus.keys import SCORERS_GROUP
from pipeline.ops.embedded import EmbeddedRedis
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
