"""Archiver role: every scored group, kept in Parquet files (docs/archive.md).

A consumer in group ``archivers`` on ``scored`` (every lane), only when ``archive.enabled``.
The group exists from the run's first moment (the trainer and the scorers create it with
their own), and the janitor trims only what every group acknowledged, so no entry leaves
``scored`` before the archive has it; how far the archive may fall behind is capped by
the trainer (``archive.max_backlog``, `trainer.reader.Reader.hold_for_archive`).

Per entry: decoded, turned into an archive row (`pipeline.archive.format`: the prompt dict
from the task, each completion's text decoded with the run's tokenizer, without
transformers where that is exact: `pipeline.textdecode`) and buffered,
pending. A file is written (`pipeline.archive.store`: whole or not at all) when the
buffer reaches ``archive.file_mb``, ``archive.file_s`` or half of ``archive.max_backlog``;
then, in this order, an ``archived`` ledger line per group (with the file's name), and the
acks. An entry that cannot be decoded is acked and recorded ``archive_skipped`` (the
trainer dead-letters it too); a deleted one is acked.

Exactly once, whatever kills it (the consumer name is stable, ``archiver-0`` by default,
so a restarted archiver reads its own pending entries first): an entry is acked only
after its file exists and its ledger line is written; killed before the file, it is read
again; killed after the file, only the newest file of this archiver can hold entries it
had not acked, so at start it reads that file's entry ids, and an own pending entry found
there is acked without being written again (and its ledger line written if it was
missing: this archiver's ledger is read for it). Several archivers with distinct names
split the entries between them; a dead one's entries wait for it to restart by its name.

On the end of the run (``RunFinished``) it reads until ``scored`` has nothing new for it,
writes the last file and ``dispositions.parquet`` (`pipeline.archive.history`: what
became of every group, from the ledgers in ``run.output_dir``) and exits. On SIGTERM it
writes what it holds and exits (no dispositions: the run is not over).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.archive.format import Item, row_of, table_of
from pipeline.archive.store import ArchiveStore, archive_url, write_dispositions
from pipeline.bus import control
from pipeline.bus.client import Bus, worker_id
from pipeline.bus.codec import DecodeError, decode_entry, peek_group_id
from pipeline.bus.keys import ARCHIVERS_GROUP
from pipeline.bus.ledger import Ledger
from pipeline.bus.replies import Entry, as_str
from pipeline.bus.schema import RunFinished, ScoredGroup
from pipeline.config import Config, ConfigError
from pipeline.metrics import start as start_metrics
from pipeline.rundir import read_run
from pipeline.runtime import Heartbeat, connect, join, limits
from pipeline.textdecode import Decoder, full_decoder, light_decoder, light_reason
from workers.tasks.catalog import Task, task_from_config

log = logging.getLogger("sluice.archiver")
READ_COUNT = 64
DEFAULT_NAME = "archiver-0"


@dataclass
class Held:
    """One entry read and not yet acknowledged: its row waits for the next file."""

    entry: Entry
    gid: str
    row: Item
    nbytes: int


class Archiver:
    def __init__(self, cfg: Config, name: str | None = None):
        self.cfg = cfg
        self.consumer = name or DEFAULT_NAME
        self.wid = worker_id("archiver", self.consumer)
        self.metrics = start_metrics(cfg.metrics, "archiver", self.wid,
                                     groups=[("scored", ARCHIVERS_GROUP)], lengths=["scored"])
        self.decode, self.task, kind = decoder_and_task(cfg)
        log.info("archiver decoding completions with the %s tokenizer", kind)
        self.store = ArchiveStore(archive_url(cfg))
        self.limits = limits(cfg)
        self.ledger = Ledger.for_role(cfg.output_path, "archiver", self.consumer, cfg.run.ledger)
        self.held: list[Held] = []
        self.held_bytes = 0
        self.since = time.monotonic()  # when the buffer's first entry was read
        _, self.seq = self.store.newest(self.consumer)
        # (lane, entry id) -> (its file, its group) of the newest file
        self.recovered: dict[tuple[str, str], tuple[str, str]] = {}
        self.recorded: set[str] = set()  # entry ids this archiver's ledger has archived
        self.counts = {"archived": 0, "files": 0, "skipped": 0, "recovered": 0}
        self.last_file = ""

    def info(self) -> dict[str, Any]:
        return {**self.counts, "buffered": len(self.held), "last_file": self.last_file}

    # ------------------------------------------------------------ start-up

    def recover(self, bus: Bus) -> None:
        """The entries of this archiver's newest file (any of them may still be pending on
        it) and which of them its ledger already recorded (module docstring)."""
        self.store.clean()
        record = read_run(self.cfg.output_path)
        if record is not None:
            self.store.write_run(record)
        name, _ = self.store.newest(self.consumer)
        if name is None:
            return
        t = self.store.read(name, columns=["lane", "entry_id", "gid"]).to_pydict()
        streams = bus.lanes.streams("scored")
        for lane, entry_id, gid in zip(t["lane"], t["entry_id"], t["gid"], strict=True):
            self.recovered[(streams[lane], entry_id)] = (name, gid)
        safe = self.consumer.replace("/", "_")
        for f in (self.cfg.output_path / "ledger").glob(f"archiver-{safe}-*.jsonl"):
            for line in f.read_text().splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if r.get("ev") == "archived" and r.get("file") == name:
                    self.recorded.add(str(r["id"]))

    async def settle_pending(self, bus: Bus, stop: asyncio.Event) -> None:
        """Ack (with its ledger line if missing) every entry pending on this archiver that
        its newest file already holds, before reading anything: from here on no pending
        entry of it is in any file."""
        if not self.recovered:
            return
        for stream in bus.lanes.streams("scored"):
            rows = await bus.retrying(lambda s=stream: bus.r.xpending_range(
                s, ARCHIVERS_GROUP, min="-", max="+", count=1 << 20,
                consumername=self.consumer), "pending", stop)
            ids = [i for r in rows if (stream, i := as_str(r["message_id"])) in self.recovered]
            for i in ids:
                self.settle_recovered(i, *self.recovered[(stream, i)])
            if ids:
                await bus.retrying(lambda s=stream, i=ids: bus.ack(s, ARCHIVERS_GROUP, *i),
                                   "ack", stop)

    # ------------------------------------------------------------ the loop

    async def take(self, bus: Bus, entries: list[Entry]) -> None:
        """Buffer each entry's row (or settle it now: deleted, undecodable, already in the
        newest file)."""
        now = time.time()
        done: list[Entry] = []
        fresh: list[tuple[Entry, int, ScoredGroup]] = []
        for e in entries:
            lane = bus.lanes.streams("scored").index(e.stream)
            if e.fields is None:
                done.append(e)
                continue
            self.metrics.wait("scored", now - int(e.id.split("-")[0]) / 1000)
            if (e.stream, e.id) in self.recovered:  # (only if it was acked after all)
                self.settle_recovered(e.id, *self.recovered[(e.stream, e.id)])
                done.append(e)
                continue
            try:
                sg = decode_entry(e.fields, self.limits, expect=ScoredGroup)
            except DecodeError as err:
                self.counts["skipped"] += 1
                # no gid: the one it may name is not believed (`pipeline.bus.inbound`);
                # a forged one would excuse a real group missing from the archive
                self.ledger.write("archive_skipped", None, claimed=peek_group_id(e.fields),
                                  id=e.id, reason=str(err)[:200])
                log.warning("not archiving %s (undecodable): %s", e.id, err)
                done.append(e)
                continue
            assert isinstance(sg, ScoredGroup)
            if not self.held and not fresh:
                self.since = time.monotonic()
            fresh.append((e, lane, sg))
        texts = self.texts([sg for _, _, sg in fresh])
        for (e, lane, sg), text in zip(fresh, texts, strict=True):
            row = row_of(sg, texts=text, prompt=self.prompt(sg.group.group_id),
                         lane=lane, entry_id=e.id, archiver=self.consumer, t_archived=now)
            size = sum(len(v) for v in (e.fields or {}).values())
            self.held.append(Held(e, sg.group.group_id, row, size))
            self.held_bytes += size
        await self.ack(bus, done)

    def settle_recovered(self, entry_id: str, name: str, gid: str) -> None:
        """An own pending entry already in file ``name`` (killed after writing it): its
        ledger line if missing; the caller acks it."""
        self.counts["recovered"] += 1
        if entry_id not in self.recorded:
            self.ledger.write("archived", gid, id=entry_id, file=name, recovered=True)
            self.recorded.add(entry_id)

    def texts(self, groups: list[ScoredGroup]) -> list[list[str]]:
        """Each completion's text, decoded as the generator decoded it
        (``decode(ids, skip_special_tokens=True)``, `pipeline.textdecode`), every
        completion of a read in one call."""
        flat = iter(self.decode([r.completion_ids.tolist() for g in groups
                                 for r in g.group.rollouts]))
        return [[next(flat) for _ in g.group.rollouts] for g in groups]

    def prompt(self, gid: str) -> dict[str, Any] | None:
        """The task's prompt dict of group ``gid`` (``epoch:prompt_index``)."""
        try:
            return dict(self.task.prompt(int(gid.rsplit(":", 1)[1])))
        except (ValueError, IndexError, KeyError):
            return None

    def due(self) -> bool:
        a = self.cfg.archive
        return bool(self.held) and (
            self.held_bytes >= a.file_mb * 2**20 or len(self.held) >= a.max_backlog // 2
            or time.monotonic() - self.since >= a.file_s)

    async def flush(self, bus: Bus, stop: asyncio.Event | None = None) -> None:
        """Write the buffer as the next file, then its ledger lines, then ack it."""
        if not self.held:
            return
        held = self.held
        table = table_of([h.row for h in held])
        name, size = await asyncio.to_thread(self.store.write_groups, self.consumer,
                                             self.seq + 1, table)
        self.seq += 1
        for h in held:
            self.ledger.write("archived", h.gid, id=h.entry.id, file=name)
        await self.ack(bus, [h.entry for h in held], stop)
        self.held, self.held_bytes = [], 0
        self.counts["archived"] += len(held)
        self.counts["files"] += 1
        self.last_file = name
        log.info("archived %d groups in %s (%d bytes)", len(held), name, size)

    async def ack(self, bus: Bus, entries: list[Entry], stop: asyncio.Event | None = None
                  ) -> None:
        """Ack ``entries`` (one XACK per lane); raises `asyncio.CancelledError` when
        ``stop`` is set during an outage (they stay pending for a restart)."""
        by_lane: dict[str, list[str]] = {}
        for e in entries:
            by_lane.setdefault(e.stream, []).append(e.id)
        for stream, ids in by_lane.items():
            await bus.retrying(lambda s=stream, i=ids: bus.ack(s, ARCHIVERS_GROUP, *i), "ack",
                               stop)

    async def watch_control(self, bus: Bus, stop: asyncio.Event, finished: asyncio.Event
                            ) -> None:
        async for msg in control.watch(bus, from_id="0", stop=stop,
                                       block_ms=self.cfg.bus.block_ms):
            if isinstance(msg, RunFinished):
                finished.set()
                return

    async def run(self, stop: asyncio.Event) -> None:
        bus = connect(self.cfg)
        for k in bus.lanes.keys:
            await bus.retrying(lambda k=k: bus.ensure_group(k.scored, ARCHIVERS_GROUP), "group")
        await asyncio.to_thread(self.recover, bus)
        await self.settle_pending(bus, stop)
        hb = Heartbeat(bus, self.wid, self.cfg.bus.heartbeat_s, self.info, self.metrics)
        hb.start()
        finished = asyncio.Event()
        watcher = asyncio.create_task(self.watch_control(bus, stop, finished))
        log.info("archiver %s writing %s (%d files of its own already)", self.wid,
                 self.store.url, self.seq)
        idle = 0
        try:
            while not stop.is_set():
                entries = await bus.retrying(lambda: bus.read_lanes(
                    "scored", ARCHIVERS_GROUP, self.consumer, count=READ_COUNT,
                    block_ms=self.cfg.bus.block_ms), "read scored", stop)
                await self.take(bus, entries)
                if self.due():
                    await self.flush(bus)
                idle = 0 if entries else idle + 1
                if finished.is_set() and idle >= 2:  # the run is over and drained
                    await self.flush(bus)
                    await asyncio.to_thread(self.write_dispositions)
                    break
        except asyncio.CancelledError:
            pass
        finally:
            stop.set()
            try:  # what it holds goes to a file now (if Redis is gone, the acks wait for
                await self.flush(bus, stop)  # a restart: the file is recognised then)
            except (asyncio.CancelledError, Exception) as e:
                log.warning("could not finish the last file's acks: %r", e)
            await join(watcher, self.cfg.bus.block_ms / 1000 + 5)
            await hb.stop()
            await bus.close()
            self.ledger.close()
            log.info("archiver %s stopped: %s; %.1f CPU s", self.wid, self.counts,
                     time.process_time())

    def write_dispositions(self) -> None:
        """``dispositions.parquet`` from the ledgers in ``run.output_dir``."""
        if not self.cfg.run.ledger:
            return
        write_dispositions(self.cfg, self.store)


def decoder_and_task(cfg: Config) -> tuple[Decoder, Task, str]:
    """How completions are decoded (`pipeline.textdecode`), the run's task, and which
    decoder (``"light"`` or ``"full: <why>"``). The task needs the tokenizer only where
    ``task.max_prompt_tokens`` drops prompts by their rendered length (the indices the
    generators use depend on it); otherwise transformers is loaded only if the light
    decoder would not be exact."""
    from pipeline.hub import resolve_model

    folder = resolve_model(cfg.model.path, cfg.model.revision).local_dir
    why = "task.max_prompt_tokens" if cfg.task.max_prompt_tokens else light_reason(folder)
    if why is None:
        return light_decoder(folder), task_from_config(cfg), "light"
    from pipeline.model import load_tokenizer

    tokenizer = load_tokenizer(folder)
    return full_decoder(tokenizer), task_from_config(cfg, tokenizer), f"full: {why}"


def preflight(cfg: Config) -> None:
    """What the archiver needs, checked before any role starts (`sluice archive`, `sluice
    up` with ``archive.enabled``): ``archive.path`` opens (its fsspec filesystem is
    installed) and can be written: a local folder's nearest existing parent is writable
    (nothing is created here: `sluice up --fresh` has yet to clear the run directory), a
    remote store takes a probe object. A ``ConfigError`` naming the key otherwise."""
    store = ArchiveStore(archive_url(cfg))
    if store.local:
        parent = Path(store.root)
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not (parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)):
            raise ConfigError(f"archive.path: {store.root} cannot be created ({parent} is "
                              "not a writable folder)")
        return
    probe = store.path(f".probe-{os.getpid()}")
    try:
        store.put(probe, b"")
        store.fs.rm(probe)
    except OSError as e:
        raise ConfigError(f"archive.path: cannot write to {store.url!r}: {e}") from None


async def main(cfg: Config, stop: asyncio.Event, name: str | None = None) -> None:
    await Archiver(cfg, name).run(stop)
