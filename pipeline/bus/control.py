"""The control stream: durable weight announcements and the end-of-run signal.

Invariants: `announce` writes the stream entry before moving ``state.version`` (which only
moves forward), so whoever sees a version in ``state`` can find its announcement.
Consumers apply only strictly newer versions (`Watcher` filters), so duplicate or
reordered announcements are harmless. The end of the run (`finish`, `clear_finished`) is
retried through outages like every other write, and fenced like `announce`: a trainer
that lost its lock neither ends nor reopens the new holder's run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from pipeline.bus import scripts as lua
from pipeline.bus.client import Bus
from pipeline.bus.codec import FIELD, DecodeError, decode_entry, encode
from pipeline.bus.fencing import call_fenced
from pipeline.bus.schema import RunFinished, WeightsPublished

log = logging.getLogger("sluice.control")

ControlMessage = WeightsPublished | RunFinished

FINISH = lua.fenced("""
-- KEYS: control; ARGV: field, payload, scan. Appends the end-of-run entry unless these
-- exact bytes are among the newest `scan` entries (an earlier attempt landed and its
-- reply was lost): retried, it is written once. Returns the entry id.
for _, row in ipairs(redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', ARGV[3])) do
  local f = row[2]
  for i = 1, #f, 2 do
    if f[i] == ARGV[1] and f[i + 1] == ARGV[2] then return row[1] end
  end
end
return redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
""")

DELETE_ENTRIES = lua.fenced("""
-- KEYS: stream; ARGV: ids. XDEL as a fenced script (the trainer clearing old
-- end-of-run entries). Deleting an id twice is a no-op.
return redis.call('XDEL', KEYS[1], unpack(ARGV))
""")


async def announce(bus: Bus, msg: WeightsPublished, *, maxlen: int = 1000) -> str:
    return await bus.announce(encode(msg), msg.version, maxlen=maxlen)  # one fenced script


async def finish(bus: Bus, reason: str, stop: asyncio.Event | None = None) -> str:
    """Announce the end of the run; returns its entry id.

    Retried through outages (`Bus.retrying`): every other role stops only on this entry,
    so a Redis blip here must not lose it. One message, encoded once: a retry first
    looks for those exact bytes among the newest entries (the earlier attempt may have
    landed with its reply lost) and writes them only if absent. Should two land anyway,
    it is harmless: every reader acts on the first RunFinished it sees and stops, and
    `clear_finished` removes them all. ``stop`` set while waiting: `asyncio.CancelledError`.
    Fenced like `announce` (`pipeline.bus.fencing`): a trainer that lost its lock gets
    `FencedOut` and ends nothing (the run is the new holder's).
    """
    payload = encode(RunFinished(reason=reason, t=time.time()))
    script = bus.r.register_script(FINISH)  # a local object: no round trip

    async def once() -> str:
        entry_id = await call_fenced(script, bus.keys.state, bus.fence, [bus.keys.control],
                                     [FIELD, payload, 50])
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    return await bus.retrying(once, "end of run", stop)


async def clear_finished(bus: Bus, stop: asyncio.Event | None = None) -> int:
    """Delete end-of-run markers, so a resumed run's roles do not stop on an old one.

    Called only by the trainer (the run's owner) when it resumes with steps left to
    train, before it heartbeats; `sluice up` starts the other roles after that.
    Retried through outages like `finish`; idempotent (each attempt reads the stream
    again, and deleting an id twice is a no-op), so the count is of the last attempt.
    The delete is fenced like `finish`.
    """
    script = bus.r.register_script(DELETE_ENTRIES)

    async def once() -> int:
        rows = await bus.r.xrange(bus.keys.control)
        stale = []
        for entry_id, fields in rows:
            try:
                if isinstance(decode_entry(fields), RunFinished):
                    stale.append(entry_id)
            except DecodeError:
                continue
        if not stale:
            return 0
        return int(await call_fenced(script, bus.keys.state, bus.fence, [bus.keys.control],
                                     stale))

    return await bus.retrying(once, "clear end of run", stop)


async def latest(bus: Bus, scan: int = 200) -> WeightsPublished | None:
    """The newest valid weight announcement (skipping corrupt entries), or None."""
    rows = await bus.r.xrevrange(bus.keys.control, count=scan)
    best: WeightsPublished | None = None
    for _id, fields in rows:
        try:
            m = decode_entry(fields)
        except DecodeError as e:
            log.warning("ignoring corrupt control entry %s: %s", _id, e)
            continue
        if isinstance(m, WeightsPublished) and (best is None or m.version > best.version):
            best = m
    return best


async def finished(bus: Bus, scan: int = 200) -> RunFinished | None:
    rows = await bus.r.xrevrange(bus.keys.control, count=scan)
    for _id, fields in rows:
        try:
            m = decode_entry(fields)
        except DecodeError:
            continue
        if isinstance(m, RunFinished):
            return m
    return None


async def watch(bus: Bus, *, from_id: str = "$", block_ms: int = 1000,
                stop: asyncio.Event | None = None) -> AsyncIterator[ControlMessage]:
    """Yield control messages appended after ``from_id`` ("0" = from the start).

    Corrupt entries are logged and skipped; connection errors are retried with backoff.
    """
    last = from_id
    if last == "$":
        rows = await bus.retrying(lambda: bus.r.xrevrange(bus.keys.control, count=1), "control")
        last = rows[0][0].decode() if rows else "0"
    while stop is None or not stop.is_set():
        resp = await bus.retrying(
            lambda last=last: bus.r.xread({bus.keys.control: last}, block=block_ms, count=100),
            "control watch", stop)
        for _stream, items in resp or []:
            for entry_id, fields in items:
                last = entry_id.decode()
                try:
                    m = decode_entry(fields)
                except DecodeError as e:
                    log.warning("ignoring corrupt control entry %s: %s", last, e)
                    continue
                if isinstance(m, WeightsPublished | RunFinished):
                    yield m
