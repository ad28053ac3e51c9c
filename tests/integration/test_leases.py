"""Leases and idempotent scripts against a real redis-server (the janitor: test_janitor.py).

The invariants: an admitted group is appended at most once, only by its lease holder; a
dead holder's lease is taken over, by a scan that runs on a timer rather than on every
poll of the gate; a call retried after a lost reply acts once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pipeline.bus.client import Bus
from pipeline.bus.keys import SCORERS_GROUP
from pipeline.config import load_config
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import wait_for_async
from workers.generator import Generator

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
        # a renewal racing its own emit finds the lease released: not reported as lost
        assert await bus.renew("gen/a", [c], 60_000) == []
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


def test_the_takeover_scan_runs_on_a_timer_not_on_every_poll(
        redis_server: EmbeddedRedis, run_name: str, tiny_model_dir: Path,
        tmp_path: Path) -> None:
    """A generator at a gate closed by a dead generator's leases polls the gate often, but
    scans the leases only every lease_s/4; it still takes them over once they expire."""
    cfg = load_config(None, [f"run.name={run_name}", f"run.output_dir={tmp_path}",
                             f"bus.redis_url={redis_server.url}",
                             f"model.path={tiny_model_dir}", "model.init=''",
                             "generation.lease_s=2", "generation.batch_groups=2",
                             "trainer.admission_window=2"])
    gen = Generator(cfg, "g0")
    assert gen.takeover_every_s == 0.5

    async def go() -> tuple[list[int], list[int], Counter[str], float]:
        bus = Bus.connect(cfg.redis_url, run_name)
        calls: Counter[str] = Counter()
        real_takeover, real_admit, real_many = bus.takeover, bus.admit, bus.admit_many

        async def takeover(*a: Any, **kw: Any) -> list[int]:
            calls["takeover"] += 1
            return await real_takeover(*a, **kw)

        async def admit_many(*a: Any, **kw: Any) -> Any:  # one call polls the gate once
            calls["admit"] += 1
            return await real_many(*a, **kw)

        bus.takeover, bus.admit_many = takeover, admit_many  # type: ignore[method-assign]
        try:  # a dead generator fills the window: the gate stays closed for 2 s
            dead = [await real_admit(2, "generator/dead", 2000) for _ in range(2)]
            t0 = time.monotonic()
            got, _version = await asyncio.wait_for(gen.admit_batch(bus, asyncio.Event()), 30)
            return dead, got, calls, time.monotonic() - t0
        finally:
            await bus.close()

    dead, got, calls, elapsed_s = arun(go())
    assert sorted(got) == dead  # taken over once expired
    assert gen.taken_over == 2 and gen.leases == set(dead)
    # at most one scan per 0.5 s (plus the first), fewer than the polls of the gate (a
    # scan on every poll made as many scans as polls, one more counting the last)
    assert calls["takeover"] <= elapsed_s / gen.takeover_every_s + 2, (calls, elapsed_s)
    assert calls["admit"] > calls["takeover"], (calls, elapsed_s)


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
