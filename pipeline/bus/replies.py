"""Redis replies as sluice's types: what `pipeline.bus.client.Bus` reads, and the pure
functions that turn raw redis-py replies into them.

Pure (no I/O): `sluice status`, the roles' metrics and the bus itself read consumer
groups through `group_view` / `merge_views`, so they agree on lag and pending.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Entry:
    """One stream entry as read by a consumer; ``fields`` is None if it was deleted."""

    id: str
    fields: dict[bytes, bytes] | None
    deliveries: int = 1
    stream: str = ""
    """The stream key it was read from: with partitions, the lane that owns it."""


@dataclass
class GroupView:
    """One consumer group of a stream at one instant (XINFO GROUPS): ``lag`` = entries
    never delivered to the group (None when Redis cannot tell: entries were deleted),
    ``pending`` = delivered and not acknowledged; ``exists`` is False for a missing stream
    or group (then both read 0)."""

    exists: bool
    lag: int | None
    pending: int
    info: dict[str, Any]


def as_str(v: Any) -> str:
    """A reply value as str: bytes decoded (UTF-8), anything else through ``str``."""
    return v.decode() if isinstance(v, bytes) else str(v)


def decode_reply(v: Any) -> Any:
    """A Redis reply with every bytes key and value (nested) decoded to str."""
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, dict):
        return {decode_reply(k): decode_reply(x) for k, x in v.items()}
    if isinstance(v, list):
        return [decode_reply(x) for x in v]
    return v


def group_view(infos: Any, group: str) -> GroupView:
    """``group``'s row of an XINFO GROUPS reply; ``infos`` may be the error a pipeline
    returned for a missing stream. Pure: `sluice status` and the roles' metrics read
    lag and pending through it, so they agree."""
    info: dict[str, Any] = {}
    if not isinstance(infos, Exception):
        info = next((decode_reply(g) for g in infos or []
                     if decode_reply(g.get("name")) == group), {})
    lag = info.get("lag") if info else 0
    return GroupView(exists=bool(info), lag=None if lag is None else int(lag),
                     pending=int(info.get("pending", 0) or 0), info=info)


def merge_views(views: list[GroupView]) -> GroupView:
    """One consumer group over every lane of a stream: lags and pending summed (the lag
    unknown if any lane's is)."""
    if len(views) == 1:
        return views[0]
    lags = [v.lag for v in views]
    return GroupView(exists=any(v.exists for v in views),
                     lag=None if any(x is None for x in lags) else sum(x or 0 for x in lags),
                     pending=sum(v.pending for v in views),
                     info=next((v.info for v in views if v.exists), {}))


def entry_id_order(entry_id: str) -> tuple[int, int]:
    """The sort key of a stream entry id ``ms-seq`` (a string sort would put ``10-0``
    before ``9-0``)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def read_entries(resp: Any, stream: str) -> list[Entry]:
    """The entries of an XREADGROUP reply on the one stream ``stream`` (an entry whose
    fields are gone, deleted while pending, has ``fields`` None)."""
    out: list[Entry] = []
    for _stream, items in resp or []:
        for entry_id, fields in items:
            out.append(Entry(as_str(entry_id), fields or None, stream=stream))
    return out
