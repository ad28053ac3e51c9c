"""Weight announcements on the control stream."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path

import pytest

from pipeline.bus import control
from pipeline.bus.client import Bus
from pipeline.bus.codec import decode_entry
from pipeline.bus.schema import RunFinished, WeightsPublished
from pipeline.ports import free_port
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import wait_for_async

pytestmark = pytest.mark.integration


def _w(version: int) -> WeightsPublished:
    return WeightsPublished(version=version, step=version, uri=f"file:///tmp/v{version}",
                            format="safetensors", sha256="ab" * 32, nbytes=10, t=1.0)


def test_announce_latest_and_version_only_moves_forward(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        assert await control.latest(bus) is None
        await control.announce(bus, _w(3))
        await control.announce(bus, _w(2))  # reordered / late: state keeps 3
        await bus.r.xadd(bus.keys.control, {b"m": b"\xc1garbage"})  # corrupt entry
        latest = await control.latest(bus)
        assert latest is not None and latest.version == 3
        assert (await bus.state())["version"] == 3
        await bus.close()

    arun(go())


def test_watch_yields_announcements_in_order_and_skips_corrupt(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    async def go() -> list[object]:
        bus = Bus.connect(redis_server.url, run_name)
        seen: list[object] = []
        stop = asyncio.Event()

        async def watcher() -> None:
            async for m in control.watch(bus, from_id="0", block_ms=50, stop=stop):
                seen.append(m)
                if isinstance(m, RunFinished):
                    return

        task = asyncio.create_task(watcher())
        await asyncio.sleep(0.1)
        await control.announce(bus, _w(1))
        await bus.r.xadd(bus.keys.control, {b"m": b"not msgpack \xc1"})
        await control.announce(bus, _w(2))
        await control.finish(bus, "max_steps")
        await asyncio.wait_for(task, 5)
        await bus.close()
        return seen

    seen = arun(go())
    assert [type(m).__name__ for m in seen] == ["WeightsPublished", "WeightsPublished",
                                               "RunFinished"]
    assert [m.version for m in seen[:2]] == [1, 2]  # type: ignore[attr-defined]


def test_sluice_up_sees_the_end_of_the_run_among_the_newest_control_entries(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    """`sluice.up.finished_announced`: False on announcements alone (and on a
    malformed entry), True once the trainer's RunFinished follows them."""
    from sluice.up import finished_announced

    async def go() -> list[bool]:
        bus = Bus.connect(redis_server.url, run_name)
        try:
            seen = [await finished_announced(bus)]
            for v in range(30):  # more announcements than the poll scans
                await control.announce(bus, _w(v))
            await bus.r.xadd(bus.keys.control, {b"m": b"not msgpack \xc1"})
            seen.append(await finished_announced(bus))
            await control.finish(bus, "max_steps")
            seen.append(await finished_announced(bus))
        finally:
            await bus.close()
        return seen

    assert arun(go()) == [False, False, True]


def test_the_end_of_the_run_is_announced_and_cleared_across_a_redis_restart(
        tmp_path: Path, run_name: str) -> None:
    """`control.finish` and `control.clear_finished` wait out an outage like every other
    write (`Bus.retrying`): called while Redis is down, each lands once it is back, and a
    retried announcement is written once. Without it, a blip at the end of the run left
    every other role waiting forever for a RunFinished that was never written."""
    srv = EmbeddedRedis(tmp_path / "redis", port=free_port())  # AOF: the stream survives
    srv.start()

    async def during_outage(bus: Bus, call: Awaitable[object]) -> object:
        """Stop Redis, start ``call``, wait until it has met the outage, start Redis."""
        srv.stop()
        task = asyncio.ensure_future(call)
        await wait_for_async(lambda: _now(task.done() or not bus.healthy), 30,
                             "the call to meet the outage")
        if task.done():
            task.result()  # it gave up instead of waiting: raise its error
        await asyncio.to_thread(srv.start)
        return await asyncio.wait_for(task, 60)

    async def go() -> None:
        bus = Bus.connect(srv.url, run_name, reconnect_max_s=0.5)
        try:
            await control.announce(bus, _w(1))
            await during_outage(bus, control.finish(bus, "max_steps"))
            assert bus.healthy
            rows = await bus.r.xrange(bus.keys.control)
            ends = [m for _id, f in rows if isinstance(m := decode_entry(f), RunFinished)]
            assert [m.reason for m in ends] == ["max_steps"], ends
            assert await control.finished(bus) is not None
            await during_outage(bus, control.clear_finished(bus))
            assert await control.finished(bus) is None
            latest = await control.latest(bus)
            assert latest is not None and latest.version == 1  # announcements are kept
        finally:
            await bus.close()

    try:
        arun(go())
    finally:
        srv.stop()


async def _now(value: bool) -> bool:
    return value
