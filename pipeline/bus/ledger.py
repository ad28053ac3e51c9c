"""Per-process delivery ledger: one JSON line per event, for auditing a run afterwards.

Every role appends to its own file ``<output_dir>/ledger/<role>-<consumer>-<pid>.jsonl``
(one writer per file, so no locking, and a crashed process's file simply ends). Lines are
handed to the kernel at once (unbuffered ``os.write``), so a ``kill -9`` loses nothing
already written.

Exact under ``kill -9`` at any instant: before a state-changing Redis call, the writer
records an ``intent`` line (the call's op id and the events it would cause); after it, the
events that happened, each carrying the op id. An intent with no events after it is
resolved by `pipeline.bus.audit` from the op's stored result in Redis (the idempotent scripts
keep it `pipeline.bus.scripts.OP_TTL_S` seconds, written atomically with the change): so a
process killed between the call and its ledger line is still counted exactly.

Events (``ev``), each with ``gid`` (group id), ``role``, ``consumer``, ``t`` (unix s):
- generator: ``admitted`` (``cursor``, ``gate_wait_s``: its batch's wait at the gate),
  ``takeover`` (``cursor``: an expired lease of a dead generator, now ours), ``emitted``
  (``cursor``, ``id``), ``lost_lease`` (``cursor``: another generator took it over; we
  drop our copy), ``dead`` (abandoned);
- scorer: ``scored`` (``n``: completions, ``adv_sum``: of the reward advantages; with a
  teacher also ``kl``, the group's mean per-token reverse KL to it, over ``kl_n``
  tokens), ``handed_off`` (``id``, ``to``), ``filtered``, ``dead``;
- trainer: ``trained`` (``step``, ``version``, ``min_version``, ``max_staleness``,
  ``n``), ``stale``, ``duplicate`` (acked, not retired: already trained), ``dead``,
  ``resumed`` (no group; ``step``, ``version``: the checkpoint it started from: the steps
  it had taken after that one were lost with the process);
- archiver: ``archived`` (``id``, ``file``: the archive file that holds the group;
  ``recovered`` when written after a restart for a file its killed predecessor wrote),
  ``archive_skipped`` (``id``, ``reason``: undecodable, acked and not archived).
Retiring events are ``filtered``, ``stale``, ``trained`` and ``dead`` (when ``retired``).
A ``dead`` event of an entry that did not decode (`dead_event`) has no ``gid``:
``undecodable`` is true and ``claimed`` holds the group id it named, if any, which is not
believed (the audit counts these against ``state.undecodable``, never as retirements);
the archiver's ``archive_skipped`` likewise.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

RETIRING = ("filtered", "stale", "trained", "dead")


def dead_event(gid: str | None, entry_id: str, reason: str, claimed: str | None = None
               ) -> dict[str, Any]:
    """The planned ``dead`` event of a dead-lettered stream entry: ``gid`` is the group it
    decoded to (retired ``dead``), or None when it did not decode (``undecodable``, with
    ``claimed``: the group id it named, if any, not believed)."""
    if gid is not None:
        return {"ev": "dead", "gid": gid, "retired": True, "id": entry_id,
                "reason": reason[:200]}
    return {"ev": "dead", "gid": None, "retired": False, "undecodable": True,
            "claimed": claimed, "id": entry_id, "reason": reason[:200]}


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

    def intent(self, op: str, planned: list[dict[str, Any]]) -> None:
        """Record the events a call with op id ``op`` will cause if it acts (each a dict
        with ``ev``, ``gid`` and fields; an ``id`` field names the stream entry)."""
        self.write("intent", None, op=op, planned=planned)

    def outcome(self, op: str, planned: list[dict[str, Any]], result: Any) -> list[str]:
        """Write the planned events ``result`` says happened; returns their group ids."""
        done = acted(planned, result)
        for p in done:
            self.write(p["ev"], p["gid"], op=op,
                       **{k: v for k, v in p.items() if k not in ("ev", "gid")})
        return [p["gid"] for p in done]

    async def settle(self, op: str, planned: list[dict[str, Any]],
                     call: Callable[[], Awaitable[T]]) -> T:
        """``intent``, run the call, ``outcome``: the one way roles record a state change."""
        self.intent(op, planned)
        result = await call()
        self.outcome(op, planned, result)
        return result

    async def settle_many(self, items: list[tuple[str, list[dict[str, Any]]]],
                          call: Callable[[], Awaitable[list[T]]]) -> list[T]:
        """`settle` of several ops ``(op, planned)`` done by one ``call`` (a pipelined
        batch) that returns one result per op, in order: every intent is written before
        the call, every outcome after it, so a kill in between is resolved as for one."""
        for op, planned in items:
            self.intent(op, planned)
        results = await call()
        for (op, planned), result in zip(items, results, strict=True):
            self.outcome(op, planned, result)
        return results

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def acted(planned: list[dict[str, Any]], result: Any) -> list[dict[str, Any]]:
    """Which planned events a script's result says happened: a list result names the
    entry ids it acted on (`Bus.retire`); any other truthy result means all of them."""
    if isinstance(result, list | tuple | set):
        ids = {str(x) for x in result}
        return [p for p in planned if str(p.get("id")) in ids]
    return list(planned) if result else []


def read_ledgers(run_dir: Path | str) -> list[dict[str, Any]]:
    """Every event of a run, in time order. A torn last line (a process killed mid-write,
    which `os.write` of one short line makes unlikely) is kept as a ``torn`` event."""
    rows: list[dict[str, Any]] = []
    for f in sorted((Path(run_dir) / "ledger").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                rows.append({"ev": "torn", "gid": None, "file": f.name})
            rows[-1]["_file"], rows[-1]["_n"] = f.name, len(rows)
    rows.sort(key=lambda r: r.get("t", 0))
    return rows
