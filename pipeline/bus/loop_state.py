"""The rollout loop's shared per-prompt state on the bus (`LoopStateIO`, a part of
`pipeline.bus.client.Bus`).

A rollout loop (`workers.rollout_loop`) runs its ``filter_prompt`` in the generators and its
``compute_advantages`` in the scorers: separate processes, any number of each. What one
must tell the other crosses through one hash of the run, ``Keys.loop``: field = the
prompt's dataset row index, value = a JSON document. Why this shape:

- **bounded**: at most one field per dataset row, each value at most
  `LOOP_VALUE_MAX_BYTES` of JSON (a value that is larger, or not JSON, is refused where
  it is written, naming the row);
- **nothing pickled**: JSON in, JSON out; what one process writes any other reads;
- **crash-safe**: each write replaces a row's whole value (HSET), so writing it again
  (a redelivered group scored twice, a retried call) gives the same state; there is no
  read-modify-write across processes to tear. A process that dies loses only writes it
  had not flushed yet, and the group that made them is redelivered and scored again;
- **cheap**: readers ask only for the rows they are about to use (one HMGET of a batch's
  or a read's rows), writers flush a call's writes in one HSET.
"""

from __future__ import annotations

import json
import math
from typing import Any

import redis.asyncio as aioredis

from pipeline.bus.keys import Keys

LOOP_VALUE_MAX_BYTES = 1024
"""The largest JSON value one dataset row's state may hold. A per-prompt statistic (a pass
rate, a count, a few numbers) takes tens of bytes; the cap keeps the hash within
``rows x 1 KiB`` whatever a user's code writes."""


def encode_value(row: int, value: Any) -> str:
    """``value`` as the compact JSON stored for ``row``; ``ValueError`` naming the row
    when it is not JSON (NaN and infinities included: JSON has none) or is over
    `LOOP_VALUE_MAX_BYTES`."""
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"rollout loop state of row {row}: {type(value).__name__} value "
                         f"is not JSON ({e})") from None
    if len(text.encode()) > LOOP_VALUE_MAX_BYTES:
        raise ValueError(f"rollout loop state of row {row}: {len(text.encode())} bytes of "
                         f"JSON, more than {LOOP_VALUE_MAX_BYTES}")
    return text


def decode_value(raw: bytes | str | None) -> Any:
    """A stored value back (None when the row has none). A value that is not JSON (not
    written by sluice) reads as None rather than stopping a role."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return None if isinstance(value, float) and not math.isfinite(value) else value


class LoopStateIO:
    """Reads and writes of ``Keys.loop``; mixed into `Bus`, which sets ``r`` and ``keys``."""

    r: aioredis.Redis
    keys: Keys

    async def loop_read(self, rows: list[int]) -> dict[int, Any]:
        """The stored value of each of ``rows`` (None where there is none), one HMGET."""
        rows = sorted(set(rows))
        if not rows:
            return {}
        got = await self.r.hmget(self.keys.loop, [str(r) for r in rows])
        return {r: decode_value(v) for r, v in zip(rows, got, strict=True)}

    async def loop_write(self, values: dict[int, str]) -> None:
        """Store already encoded (`encode_value`) values, one HSET; each replaces its
        row's value whole."""
        if values:
            await self.r.hset(self.keys.loop, mapping={str(r): v for r, v in values.items()})
