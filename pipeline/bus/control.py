"""The control stream: durable weight announcements and the end-of-run signal.

Invariants: `announce` writes the stream entry before moving ``state.version`` (which only
moves forward), so whoever sees a version in ``state`` can find its announcement.
Consumers apply only strictly newer versions (`Watcher` filters), so duplicate or
reordered announcements are harmless.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from pipeline.bus.client import Bus
from pipeline.bus.codec import DecodeError, decode_entry, encode
from pipeline.bus.schema import RunFinished, WeightsPublished

log = logging.getLogger("sluice.control")

ControlMessage = WeightsPublished | RunFinished


async def announce(bus: Bus, msg: WeightsPublished, *, maxlen: int = 1000) -> str:
    entry_id = await bus.xadd(bus.keys.control, encode(msg), maxlen=maxlen)
    await bus.set_version(msg.version)
    return entry_id


async def finish(bus: Bus, reason: str) -> str:
    import time

    return await bus.xadd(bus.keys.control, encode(RunFinished(reason=reason, t=time.time())))


async def clear_finished(bus: Bus) -> int:
    """Delete end-of-run markers, so a resumed run's roles do not stop on an old one.

    Called only by the trainer (the run's owner) when it resumes with steps left to
    train, before it heartbeats; `sluice up` starts the other roles after that.
    """
    rows = await bus.r.xrange(bus.keys.control)
    stale = []
    for entry_id, fields in rows:
        try:
            if isinstance(decode_entry(fields), RunFinished):
                stale.append(entry_id)
        except DecodeError:
            continue
    return int(await bus.r.xdel(bus.keys.control, *stale)) if stale else 0


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
