"""What a dead-letter record holds: a bounded summary of the entry, never the whole entry.

A stream entry is whatever its writer appended: one field ``m`` when honest, but a broken
or hostile writer can append 10,000 fields or a 100 MB one. Copying such an entry into
the dlq would double its cost in Redis, and handing every field to the DEAD_LETTER script
as ARGV failed outright past ~8,000 values (Lua's ``unpack`` limit: "too many results to
unpack"), an error no retry fixes, so the reader crashed on it, restarted, re-read it
and crashed again. `record` makes the fields of one dlq entry, whatever the entry:

- ``reason``, ``role``, ``src``, ``src_id``, ``t`` (as before);
- ``nfields`` and ``nbytes``: how many fields the entry had, and their keys' and
  values' total size in bytes;
- ``orig:<key>``: the entry's first `DLQ_MAX_FIELDS` fields (in Redis's order), each key
  cut to `DLQ_KEY_BYTES` and each value to what is left of `DLQ_MAX_BYTES` (an honest
  group of up to ~64 KiB is kept whole, so ``sluice tail dlq`` and an operator can still
  decode it);
- ``truncated``: ``1`` if the ``orig:*`` fields are not the whole entry, else ``0``.

So one record is at most `DLQ_MAX_BYTES` of copied fields plus its fixed fields (the
reason is cut to 2,000 bytes), and the script gets at most
``2 * (DLQ_MAX_FIELDS + 8)`` ARGV values.
"""

from __future__ import annotations

import time

DLQ_MAX_FIELDS = 8
"""Fields of the original entry copied into its dlq record (an honest entry has one)."""
DLQ_KEY_BYTES = 256
"""Longest field name copied (longer ones are cut)."""
DLQ_MAX_BYTES = 64 * 1024
"""Bytes of the original's keys and values copied into one dlq record, in all."""
REASON_BYTES = 2000


def record(fields: dict[bytes, bytes] | None, *, reason: str, role: str, src: str,
           src_id: str) -> list[bytes]:
    """The flat field/value list of the dlq record of an entry with ``fields`` (module
    docstring for what it holds and its bounds)."""
    fields = fields or {}
    nbytes = sum(len(k) + len(v) for k, v in fields.items())
    out = [b"reason", reason.encode()[:REASON_BYTES], b"role", role.encode(),
           b"src", src.encode(), b"src_id", src_id.encode(), b"t", str(time.time()).encode(),
           b"nfields", str(len(fields)).encode(), b"nbytes", str(nbytes).encode()]
    left = DLQ_MAX_BYTES
    whole = len(fields) <= DLQ_MAX_FIELDS
    for i, (k, v) in enumerate(fields.items()):
        if i >= DLQ_MAX_FIELDS or left <= 0:
            whole = False
            break
        key, value = k[:DLQ_KEY_BYTES], v[:max(0, left - min(len(k), DLQ_KEY_BYTES))]
        whole = whole and key == k and value == v
        left -= len(key) + len(value)
        out += [b"orig:" + key, value]
    return [*out, b"truncated", b"0" if whole else b"1"]
