"""Per-process delivery ledger: one JSON line per event, for auditing a run afterwards.

Every role appends to its own file ``<output_dir>/ledger/<role>-<consumer>-<pid>.jsonl``
(one writer per file, so no locking, and a crashed process's file simply ends). A line is
written right after the Redis call that made the event happen returned, and handed to the
kernel at once (unbuffered), so a ``kill -9`` loses at most the event whose call had just
returned (a window of microseconds; `pipeline.audit` then reports a count mismatch, it
never hides one).

Events (``ev``), each with ``gid`` (group id), ``role``, ``consumer``, ``t`` (unix s):
- generator: ``admitted`` (``cursor``), ``takeover`` (``cursor``: an expired lease of a
  dead generator, now ours), ``emitted`` (``cursor``, ``id``), ``lost_lease``
  (``cursor``: another generator took it over; we drop our copy), ``dead`` (abandoned);
- scorer: ``scored`` (``n``: completions, ``adv_sum``), ``handed_off`` (``id``, ``to``),
  ``filtered``, ``dead``;
- trainer: ``trained`` (``step``, ``version``, ``min_version``, ``max_staleness``,
  ``n``), ``stale``, ``duplicate`` (acked, not retired: already trained), ``dead``.
Retiring events are ``filtered``, ``stale``, ``trained`` and ``dead`` (when ``retired``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

RETIRING = ("filtered", "stale", "trained", "dead")


class Ledger:
    """Append-only JSONL writer of one process; `Ledger.off()` writes nothing."""

    def __init__(self, path: Path | None, role: str, consumer: str):
        self.role, self.consumer = role, consumer
        self.path = path
        self._fd: int | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    @classmethod
    def for_role(cls, output_dir: Path | str, role: str, consumer: str,
                 enabled: bool = True) -> Ledger:
        if not enabled:
            return cls(None, role, consumer)
        safe = consumer.replace("/", "_")
        return cls(Path(output_dir) / "ledger" / f"{role}-{safe}-{os.getpid()}.jsonl",
                   role, consumer)

    def write(self, ev: str, gid: str | None, **fields: Any) -> None:
        if self._fd is None:
            return
        row = {"ev": ev, "gid": gid, "role": self.role, "consumer": self.consumer,
               "t": round(time.time(), 4), **fields}
        os.write(self._fd, (json.dumps(row, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_ledgers(run_dir: Path | str) -> list[dict[str, Any]]:
    """Every event of a run, in time order. A torn last line (a process killed mid-write,
    which `os.write` of one short line makes unlikely) is skipped and counted."""
    rows: list[dict[str, Any]] = []
    for f in sorted((Path(run_dir) / "ledger").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                rows.append({"ev": "torn", "gid": None, "file": f.name})
    rows.sort(key=lambda r: r.get("t", 0))
    return rows
