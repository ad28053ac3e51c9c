"""The archiver in-process against a real redis-server: killed right after writing a file
(before its ledger lines and acks) it resumes under its name without a gap or a
duplicate; the janitor keeps what the archive has not taken; and the trainer's reader
pauses at ``archive.max_backlog`` until the archive catches up."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.archive import backlog
from pipeline.archive.format import table_of
from pipeline.bus.client import Bus
from pipeline.bus.codec import encode
from pipeline.bus.keys import ARCHIVERS_GROUP, TRAINERS_GROUP
from pipeline.bus.ledger import Ledger, read_ledgers
from pipeline.bus.schema import Limits
from pipeline.config import Config, load_config
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import wait_for_async
from tests.unit.test_archive import scored
from trainer.reader import Reader
from workers.archiver import Archiver

pytestmark = pytest.mark.integration


def config(redis: EmbeddedRedis, run: str, tmp: Path, model: Path, *extra: str) -> Config:
    return load_config(None, [f"run.name={run}", f"run.output_dir={tmp}",
                              f"bus.redis_url={redis.url}", "bus.block_ms=50",
                              "bus.heartbeat_s=0.2", f"model.path={model}",
                              "archive.enabled=true", "archive.file_s=3600", *extra])


async def fill(bus: Bus, n: int) -> list[str]:
    """``n`` scored groups appended to `scored` (the groups created as a scorer would)."""
    for g in (TRAINERS_GROUP, ARCHIVERS_GROUP):
        await bus.ensure_group(bus.keys.scored, g)
    return [await bus.xadd(bus.keys.scored, encode(scored(f"0:{i}", i))) for i in range(n)]


async def drain(arch: Archiver, bus: Bus) -> None:
    """Run the archiver until the archive has every entry, then stop it (it writes what
    it holds on the way out)."""
    stop = asyncio.Event()
    task = asyncio.create_task(arch.run(stop))

    async def read_all() -> bool:
        lag = (await bus.stream_stats([], [("scored", ARCHIVERS_GROUP)]))[1]
        return lag[("scored", ARCHIVERS_GROUP)].lag == 0

    await wait_for_async(read_all, 60, "the archiver to read every entry")
    stop.set()
    await asyncio.wait_for(task, 60)


def test_killed_after_writing_a_file_it_resumes_without_gaps_or_duplicates(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    cfg = config(redis_server, run_name, tmp_path, tiny_model_dir)

    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        ids = await fill(bus, 12)
        # the trainer has taken and acked everything: only the archive holds the entries
        got = await bus.read_group(bus.keys.scored, TRAINERS_GROUP, "t", count=100,
                                   block_ms=10)
        await bus.ack(bus.keys.scored, TRAINERS_GROUP, *[e.id for e in got])
        assert await bus.trim_acked(bus.keys.scored, keep_ms=0) == 0

        first = Archiver(cfg, "archiver-0")
        entries = await bus.read_lanes("scored", ARCHIVERS_GROUP, "archiver-0", count=8,
                                       block_ms=10)
        await first.take(bus, entries)
        # killed right after the file appeared: no ledger line, no ack
        first.store.write_groups("archiver-0", 1, table_of([h.row for h in first.held]))
        first.ledger.close()
        assert await backlog(bus) == 12  # 8 pending on it, 4 never delivered

        await drain(Archiver(cfg, "archiver-0"), bus)  # the same name: its pending first
        assert await backlog(bus) == 0
        # every entry acked by every group: the janitor frees them all
        assert await bus.trim_acked(bus.keys.scored, keep_ms=0) == len(ids) - 1
        await bus.close()

    arun(go())
    files = sorted((tmp_path / "archive" / "groups").glob("*.parquet"))
    assert [f.name for f in files] == ["part-archiver-0-00000001.parquet",
                                       "part-archiver-0-00000002.parquet"]
    gids = Counter(g for f in files for g in pq.read_table(f)["gid"].to_pylist())
    assert gids == Counter({f"0:{i}": 1 for i in range(12)})
    archived = [r for r in read_ledgers(tmp_path) if r["ev"] == "archived"]
    assert Counter(r["gid"] for r in archived) == gids  # one ledger line each
    assert sum(1 for r in archived if r.get("recovered")) == 8


def test_the_trainer_pauses_at_the_cap_until_the_archive_catches_up(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    cfg = config(redis_server, run_name, tmp_path, tiny_model_dir, "archive.max_backlog=6")

    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        await fill(bus, 10)
        reader = Reader(cfg, "trainer-0", "trainer/trainer-0", Limits(),
                        Ledger(None, "trainer", "trainer-0"))
        stop = asyncio.Event()
        held = asyncio.create_task(reader.hold_for_archive(bus, stop))
        await wait_for_async(lambda: _true(reader.counts["archive_paused"] == 1), 30,
                             "the reader to pause for the archive")
        assert not held.done()
        await drain(Archiver(cfg, "archiver-0"), bus)
        await asyncio.wait_for(held, 30)
        assert reader.counts["archive_paused"] == 0
        await bus.close()

    arun(go())


async def _true(v: bool) -> bool:
    return v
