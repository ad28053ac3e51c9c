"""The archive of scored groups (docs/archive.md): its row format (`format`), its files
(`store`), what the ledgers say about each group (`history`), and the backlog the trainer
caps (`backlog`)."""

from __future__ import annotations

from pipeline.bus.client import Bus
from pipeline.bus.keys import ARCHIVERS_GROUP


async def backlog(bus: Bus) -> int | None:
    """Entries of ``scored`` (every lane) the archive does not have yet: the ``archivers``
    group's lag (never delivered) plus its pending (read, not yet in a written file);
    None when that group does not exist. When Redis cannot tell the lag (entries were
    deleted), the stream's length, an upper bound."""
    lengths, views = await bus.stream_stats(["scored"], [("scored", ARCHIVERS_GROUP)])
    v = views[("scored", ARCHIVERS_GROUP)]
    if not v.exists:
        return None
    if v.lag is None:
        return int(lengths.get("scored") or 0)
    return v.lag + v.pending
