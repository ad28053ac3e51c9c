"""The janitor (`Bus.trim_acked`) against a real redis-server.

Invariant (docs/design.md §4): it removes only entries that EVERY consumer group of the
stream has acknowledged, never a pending or undelivered one, and keeps the acknowledged
tail of the last ``keep_ms`` for `sluice tail`. It trims by id only: with 1 MB groups the
server's SLOWLOG shows nothing of it, where the old script (which read the newest 1,000
entries into Lua to find the tail's start) shows up at once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pipeline.bus import scripts as lua
from pipeline.bus.client import Bus
from pipeline.bus.keys import SCORERS_GROUP
from pipeline.ports import free_port
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import wait_for_async

pytestmark = pytest.mark.integration

HOUR_MS = 3_600_000


def test_trim_frees_only_what_every_group_acknowledged(redis_server: EmbeddedRedis,
                                                       run_name: str) -> None:
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        k = bus.keys
        r = k.rollouts
        assert await bus.trim_acked(r, keep_ms=0) == 0  # no stream yet
        ids = [await bus.xadd(r, b"%d" % i) for i in range(10)]
        assert await bus.trim_acked(r, keep_ms=0) == 0  # no group yet: nobody has read it
        await bus.ensure_group(r, SCORERS_GROUP)
        assert await bus.trim_acked(r, keep_ms=0) == 0  # none delivered
        got = await bus.read_group(r, SCORERS_GROUP, "c", count=6, block_ms=10)
        await bus.ack(r, SCORERS_GROUP, *[e.id for e in got[:2]], got[3].id)
        # ids 0,1 acked; 2 pending; 3 acked (behind a pending one); 4,5 pending; 6-9 new
        assert await bus.trim_acked(r, keep_ms=0) == 2
        assert [i.decode() for i, _ in await bus.r.xrange(r)] == ids[2:]
        await bus.ack(r, SCORERS_GROUP, got[2].id, got[4].id, got[5].id)
        # everything delivered is acked, but younger than the kept window: stays
        assert await bus.trim_acked(r, keep_ms=HOUR_MS) == 0
        # no window: up to (not including) the last delivered entry
        assert await bus.trim_acked(r, keep_ms=0) == 3
        assert [i.decode() for i, _ in await bus.r.xrange(r)] == ids[5:]
        # a second group (an operator's reader) that has read nothing holds everything
        await bus.r.xgroup_create(r, "audit", id="0")
        rest = await bus.read_group(r, SCORERS_GROUP, "c", count=10, block_ms=10)
        await bus.ack(r, SCORERS_GROUP, *[e.id for e in rest])  # scorers: all done
        assert await bus.trim_acked(r, keep_ms=0) == 0
        seen = await bus.read_group(r, "audit", "a", count=3, block_ms=10)
        assert [e.id for e in seen] == ids[5:8]
        await bus.ack(r, "audit", ids[5], ids[6])  # ids[7] stays pending on `audit`
        assert await bus.trim_acked(r, keep_ms=0) == 2
        assert [i.decode() for i, _ in await bus.r.xrange(r)] == ids[7:]
        await bus.close()

    arun(go())


def test_the_kept_tail_is_a_window_of_time(redis_server: EmbeddedRedis, run_name: str
                                           ) -> None:
    """Acknowledged entries older than keep_ms go, younger ones stay (ids carry the
    Redis clock's milliseconds, so the window needs no entry read)."""
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        r = bus.keys.rollouts
        await bus.ensure_group(r, SCORERS_GROUP)
        old = [await bus.xadd(r, b"old") for _ in range(3)]
        old_ms = int(old[-1].split("-")[0])

        async def three_s_later() -> bool:
            sec, usec = await bus.r.time()
            return sec * 1000 + usec // 1000 >= old_ms + 3000

        await wait_for_async(three_s_later, 30, "the Redis clock to pass the old entries by 3 s",
                             0.2)
        new = [await bus.xadd(r, b"new") for _ in range(3)]
        got = await bus.read_group(r, SCORERS_GROUP, "c", count=10, block_ms=10)
        await bus.ack(r, SCORERS_GROUP, *[e.id for e in got])
        assert await bus.trim_acked(r, keep_ms=1500) == 3  # the old ones, 3 s+ old
        assert [i.decode() for i, _ in await bus.r.xrange(r)] == new
        await bus.close()

    arun(go())


# The script this file replaces: it found the start of the kept tail with XREVRANGE, which
# copies up to `keep` whole entries into Lua on the server's only thread.
OLD_TRIM_ACKED = """
local last = nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local name, lid = nil, nil
  for i = 1, #g, 2 do
    if g[i] == 'name' then name = g[i + 1] end
    if g[i] == 'last-delivered-id' then lid = g[i + 1] end
  end
  if name == ARGV[1] then last = lid end
end
if not last or last == '0-0' then return 0 end
local minid = last
local p = redis.call('XPENDING', KEYS[1], ARGV[1])
if tonumber(p[1]) > 0 then minid = p[2] end
local keep = tonumber(ARGV[2])
if keep > 0 then
  local tail = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', keep)
  if #tail < keep then return 0 end
  local kth = tail[#tail][1]
  local a1, a2 = string.match(kth, '(%d+)-(%d+)')
  local b1, b2 = string.match(minid, '(%d+)-(%d+)')
  a1, a2, b1, b2 = tonumber(a1), tonumber(a2), tonumber(b1), tonumber(b2)
  if a1 < b1 or (a1 == b1 and a2 < b2) then minid = kth end
end
return redis.call('XTRIM', KEYS[1], 'MINID', minid)
"""

GROUPS = 40
GROUP_BYTES = 2**20
SLOW_US = 1000


def test_trimming_1mb_groups_reads_no_payload_and_keeps_what_is_unacked(
        tmp_path: Path) -> None:
    """40 groups of 1 MB: the janitor frees the 10 acknowledged ones below the pending
    one without a SLOWLOG entry (>= 1 ms); the old script, asked to keep its default
    1,000 entries of the same kind of stream, is logged (it copied 40 MB into Lua: 0.2 to
    0.6 s measured here). Its own server, so the slowlog holds only these commands.

    Freeing is the janitor's one cost that grows with payload bytes, and only with those
    it deletes (measured: 10 MB 0.05-0.08 ms, 20 MB ~0.55 ms, 40 MB 1.2-1.5 ms); it runs
    every claim_idle_ms / 2 (scorers) or 10 steps (trainer), so it frees what was
    acknowledged since, not the kept tail."""
    payload = bytes(range(256)) * (GROUP_BYTES // 256)
    pending_at = 10  # the 11th group stays pending: it and everything after it must stay

    async def fill(bus: Bus) -> list[str]:
        """GROUPS delivered groups, all acked but one, then one undelivered."""
        r = bus.keys.rollouts
        await bus.ensure_group(r, SCORERS_GROUP)
        ids = [await bus.xadd(r, payload) for _ in range(GROUPS)]
        got = await bus.read_group(r, SCORERS_GROUP, "c", count=GROUPS, block_ms=10)
        assert [e.id for e in got] == ids
        await bus.ack(r, SCORERS_GROUP, *[i for n, i in enumerate(ids) if n != pending_at])
        return [*ids, await bus.xadd(r, payload)]

    async def go(url: str) -> tuple[list[list[str]], list[list[str]], int, list[str],
                                    list[str]]:
        bus, old_bus = Bus.connect(url, "janitor_new"), Bus.connect(url, "janitor_old")
        try:
            ids = await fill(bus)
            await fill(old_bus)
            old = old_bus.r.register_script(OLD_TRIM_ACKED)
            for text in (OLD_TRIM_ACKED, lua.TRIM_ACKED):  # no run pays for a SCRIPT LOAD
                await bus.r.script_load(text)
            await bus.r.config_set("slowlog-log-slower-than", SLOW_US)
            await bus.r.slowlog_reset()
            assert await old(keys=[old_bus.keys.rollouts], args=[SCORERS_GROUP, 1000]) == 0
            old_log = [_cmd(e) for e in await bus.r.slowlog_get(128)]
            await bus.r.slowlog_reset()
            trimmed = await bus.trim_acked(bus.keys.rollouts, keep_ms=0)
            new_log = [_cmd(e) for e in await bus.r.slowlog_get(128)]
            left = [i.decode() for i, _ in await bus.r.xrange(bus.keys.rollouts)]
            return old_log, new_log, trimmed, left, ids
        finally:
            await bus.close()
            await old_bus.close()

    with EmbeddedRedis(tmp_path, port=free_port(), appendonly=False) as srv:
        old_log, new_log, trimmed, left, ids = asyncio.run(go(srv.url))
    assert any(c[0].upper() == "EVALSHA" for c in old_log if c), (
        f"the old script should take >= {SLOW_US} us over 40 MB; slowlog: {old_log}")
    assert new_log == [], f"the janitor took {SLOW_US} us or more: {new_log}"
    assert trimmed == pending_at
    assert left == ids[pending_at:]  # the pending group, those after it, the undelivered one


def _cmd(entry: dict[str, Any]) -> list[str]:
    """A SLOWLOG entry's command words, each cut to 40 characters (payloads)."""
    words = entry.get("command", b"")
    text = words.decode(errors="replace") if isinstance(words, bytes) else str(words)
    return [w[:40] for w in text.split()]
