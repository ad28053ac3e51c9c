"""Weight announcements on the control stream."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.bus import control
from pipeline.bus.client import Bus
from pipeline.bus.schema import RunFinished, WeightsPublished
from pipeline.ops.embedded import EmbeddedRedis
from tests.conftest import arun

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
    """`pipeline.ops.up.finished_announced`: False on announcements alone (and on a
    malformed entry), True once the trainer's RunFinished follows them."""
    from pipeline.ops.up import finished_announced

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
