"""Rank 0's side of the ``scored`` stream: read, settle what is not trained, retire what is.

Every entry read ends in exactly one place, each through one idempotent script with an
intent line in the ledger first (`pipeline.bus.ledger`):
- undecodable → ``dlq``, counted ``undecodable`` (never retired: the group id it may
  name is not believed, `pipeline.bus.inbound`);
- delivered more than ``bus.max_deliveries`` times → ``dlq``: the trainer kept failing
  before it could ack it (a step that raised, then a restart or a re-read), so it must
  not crash-loop the trainer;
- a ``group_id`` already trained (or twice in one buffer) → acked, not retired again;
- older than ``max_staleness`` → retired ``stale``;
- trained → retired ``trained`` after the optimizer step and the announcement;
- with ``archive.enabled`` nothing is read while the archive is ``archive.max_backlog``
  entries behind (`Reader.hold_for_archive`);
- in a step whose loss or gradient norm was not finite → ``dlq`` with that reason;
- in a step that raised: a group that raises on its own → ``dlq`` with the error; if none
  does, all are re-read (and reach ``dlq`` past ``max_deliveries`` if it keeps failing);
  a step that ran out of GPU memory or hit a sticky CUDA error charges none of them: the
  trainer stops (`trainer.gpu_errors`) and they stay pending.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

from pipeline.archive import backlog as archive_backlog
from pipeline.bus.client import Bus
from pipeline.bus.codec import peek_group_id
from pipeline.bus.inbound import triage
from pipeline.bus.keys import TRAINERS_GROUP
from pipeline.bus.ledger import Ledger, dead_event
from pipeline.bus.replies import Entry
from pipeline.bus.schema import Limits, ScoredGroup
from pipeline.config import Config
from pipeline.metrics import RoleMetrics
from trainer.gpu_errors import device_fatal

log = logging.getLogger("sluice.trainer")

Buffered = tuple[Entry, ScoredGroup]
TRIM_EVERY_STEPS = 10
TRAINED_IDS_KEPT = 100_000  # ids of trained groups remembered to refuse duplicates
ARCHIVE_CHECK_S = 0.5  # how often the archive's backlog is looked at (archive.enabled)


def is_stale(version: int, min_version: int, max_staleness: int) -> bool:
    """Whether a group whose oldest token is ``min_version`` may no longer be trained by
    a trainer at ``version``."""
    return version - min_version > max_staleness


class Reader:
    """Rank 0's reader of ``scored``. It owns what it changes: ``trained`` (the ids of
    the groups trained lately, to refuse a redelivered one; restored from the checkpoint
    by `restore`) and ``counts`` (how entries were settled). What it needs of the trainer
    comes in as arguments: the version it trains at, the step it took."""

    def __init__(self, cfg: Config, consumer: str, wid: str, limits: Limits, ledger: Ledger,
                 metrics: RoleMetrics | None = None):
        self.cfg, self.consumer, self.wid = cfg, consumer, wid
        self.limits, self.ledger = limits, ledger
        self.metrics = metrics or RoleMetrics("trainer", wid)
        self._archive_checked = 0.0  # time.monotonic() of the last look at its backlog
        self.groups_per_step = cfg.trainer.groups_per_step
        self.max_staleness = cfg.trainer.max_staleness
        self.trained: OrderedDict[str, None] = OrderedDict()
        self.trained_ids_kept = TRAINED_IDS_KEPT
        self.counts = {"stale": 0, "duplicates": 0, "dead": 0, "trained_groups": 0,
                       "skipped_steps": 0, "failed_steps": 0, "archive_paused": 0}

    def restore(self, trained_ids: list[str]) -> None:
        self.trained = OrderedDict.fromkeys(trained_ids)

    def trained_ids(self) -> list[str]:
        return list(self.trained)[-TRAINED_IDS_KEPT:]

    async def collect(self, bus: Bus, stop: asyncio.Event, buf: list[Buffered],
                      wait_s: float, version: int) -> list[Buffered]:
        """Fill ``buf`` up to ``groups_per_step`` fresh, new groups for a step at
        ``version``; returns early when stopping or after ``wait_s`` (rank 0 then tells
        the other ranks it is alive)."""
        want = self.groups_per_step
        await self.hold_for_archive(bus, stop)
        seen = {sg.group.group_id for _, sg in buf}
        deadline = time.monotonic() + wait_s
        while len(buf) < want and not stop.is_set() and time.monotonic() < deadline:
            entries = await bus.retrying(lambda: bus.read_lanes(
                "scored", TRAINERS_GROUP, self.consumer, count=want - len(buf),
                block_ms=self.cfg.bus.block_ms), "read scored", stop)
            for e in entries:
                sg = await self.accept(bus, e, seen, version)
                if sg is not None:
                    buf.append((e, sg))
                    seen.add(sg.group.group_id)
        return buf

    async def hold_for_archive(self, bus: Bus, stop: asyncio.Event) -> None:
        """With ``archive.enabled``: while the archive's backlog (`pipeline.archive.backlog`:
        `scored` entries it does not have yet, which the janitor must keep) is at
        ``archive.max_backlog``, take no step. Nothing is lost: the gate closes behind the
        trainer within one window of groups, and opens again as the archive catches up.
        Looked at most every `ARCHIVE_CHECK_S`."""
        cap = self.cfg.archive.max_backlog
        now = time.monotonic()
        if not self.cfg.archive.enabled or now - self._archive_checked < ARCHIVE_CHECK_S:
            return
        self._archive_checked = now
        while not stop.is_set():
            behind = await bus.retrying(lambda: archive_backlog(bus), "archive backlog", stop)
            if behind is None or behind < cap:
                break
            if not self.counts["archive_paused"]:
                log.warning("the archive is %d groups behind (archive.max_backlog %d): no "
                            "step until it catches up", behind, cap)
            self.counts["archive_paused"] = 1
            await asyncio.sleep(ARCHIVE_CHECK_S)
        if self.counts["archive_paused"]:
            log.info("the archive caught up; training again")
        self.counts["archive_paused"] = 0

    async def accept(self, bus: Bus, e: Entry, seen: set[str], version: int
                     ) -> ScoredGroup | None:
        """The entry's group if it is to be trained at ``version``; otherwise settle it
        here (dead-letter, stale, duplicate, deleted), retrying through Redis outages."""
        sg = await triage(bus, e, TRAINERS_GROUP, stream=bus.keys.scored, expect=ScoredGroup,
                          limits=self.limits, max_deliveries=self.cfg.bus.max_deliveries,
                          dead_letter=lambda e, reason, gid: self.dead_letter(
                              bus, e, gid, reason),
                          too_many="trainer: delivered {n} times without a completed step "
                                   "(its step raised; see the trainer log)")
        if sg is None:
            return None
        self.metrics.wait("scored", time.time() - int(e.id.split("-")[0]) / 1000)
        gid = sg.group.group_id
        if gid in self.trained or gid in seen:
            self.counts["duplicates"] += 1
            if await bus.retrying(lambda: bus.ack(e.stream, TRAINERS_GROUP, e.id), "ack"):
                self.ledger.write("duplicate", gid, id=e.id)
            return None
        if is_stale(version, sg.group.min_version, self.max_staleness):
            op = f"stale:{self.consumer}:{e.id}:{e.deliveries}"
            if await self.ledger.settle(
                    op, [{"ev": "stale", "gid": gid, "id": e.id, "version": version,
                          "min_version": sg.group.min_version,
                          "max_staleness": self.max_staleness}],
                    lambda: bus.retrying(lambda: bus.retire(
                        e.stream, TRAINERS_GROUP, [e.id], "stale", op=op), "retire")):
                self.counts["stale"] += 1
            return None
        return sg

    async def dead_letter(self, bus: Bus, e: Entry, gid: str | None, reason: str) -> None:
        """Dead-letter ``e``: ``gid`` is the group it decoded to (retired ``dead``), or
        None for an entry that did not decode (counted ``undecodable``; the group id it
        may name is not believed, `pipeline.bus.inbound`)."""
        claimed = None if gid is not None else peek_group_id(e.fields)
        log.warning("dead-lettering %s (group %s): %s", e.id,
                    gid or f"none; claims {claimed}", reason)
        op = f"dead:{self.consumer}:{e.id}:{e.deliveries}"
        if await self.ledger.settle(
                op, [dead_event(gid, e.id, reason, claimed)],
                lambda: bus.retrying(lambda: bus.dead_letter(
                    e.stream or bus.keys.scored, TRAINERS_GROUP, e, reason=reason,
                    role=self.wid, retire=gid is not None, op=op), "dead-letter")):
            self.counts["dead"] += 1

    async def retire_trained(self, bus: Bus, buf: list[Buffered], step: int, trained_at: int
                             ) -> None:
        """Ack + retire the groups of ``step`` (trained at version ``trained_at``) at most
        once, and remember their ids."""
        op = f"trained:{self.consumer}:{step}:{buf[0][0].id}"
        planned = [{"ev": "trained", "gid": sg.group.group_id, "id": e.id, "step": step,
                    "version": trained_at, "min_version": sg.group.min_version,
                    "max_staleness": self.max_staleness, "n": len(sg.rewards)}
                   for e, sg in buf]
        by_lane: dict[str, list[str]] = {}  # a step may hold groups of every lane
        for e, _ in buf:
            by_lane.setdefault(e.stream or bus.keys.scored, []).append(e.id)

        async def retire() -> list[str]:  # one script per lane, each idempotent under `op`
            done: list[str] = []
            for stream, ids in by_lane.items():
                done += await bus.retire(stream, TRAINERS_GROUP, ids, "trained", op=op)
            return done

        retired = await self.ledger.settle(op, planned, lambda: bus.retrying(retire, "retire"))
        for _, sg in buf:
            self.trained[sg.group.group_id] = None
        while len(self.trained) > self.trained_ids_kept:
            self.trained.popitem(last=False)
        self.counts["trained_groups"] += len(retired)
        if step % TRIM_EVERY_STEPS == 0:  # janitor of `scored`
            for k in bus.lanes.keys:
                await bus.retrying(lambda k=k: bus.trim_acked(
                    k.scored, keep_ms=int(self.cfg.bus.keep_acked_s * 1000)), "trim")

    async def skip_step(self, bus: Bus, buf: list[Buffered], metrics: dict[str, Any],
                        step: int) -> None:
        """A non-finite loss or gradient at ``step``: the step was not taken; its groups
        go to dlq."""
        self.counts["skipped_steps"] += 1
        reason = (f"trainer: non-finite step (loss {metrics.get('loss')}, grad_norm "
                  f"{metrics.get('grad_norm')}) at step {step}; not trained")
        log.error("%s: groups %s", reason, [sg.group.group_id for _, sg in buf][:8])
        for e, sg in buf:
            await self.dead_letter(bus, e, sg.group.group_id, reason)

    async def step_failed(self, bus: Bus, buf: list[Buffered], err: Exception,
                          culprits: list[int], step: int) -> list[Buffered]:
        """``step`` raised. Groups that raise on their own (``culprits``) go to dlq with the
        error at once and the others stay buffered for the next step. If none does (the
        batch as a whole fails), every group is re-read from the pending list: their
        delivery counts rise and `accept` dead-letters them past ``max_deliveries``.
        Returns what stays buffered.

        A device failure (out of memory, a sticky CUDA error: `trainer.gpu_errors`) is
        never the groups' fault: it raises `pipeline.runtime.RoleFatal` before any group
        is dead-lettered or re-read (the caller checks first, so that no culprit search
        runs on a broken device; this is the same rule kept where the groups are charged)."""
        fatal = device_fatal(err, step)
        if fatal is not None:
            raise fatal from err
        self.counts["failed_steps"] += 1
        gids = [sg.group.group_id for _, sg in buf]
        if culprits:
            log.error("step %d raised %r; groups %s raise on their own: dead-lettering them",
                      step, err, [gids[i] for i in culprits])
            for i in culprits:
                e, sg = buf[i]
                await self.dead_letter(bus, e, sg.group.group_id,
                                       f"trainer: its step raised {err!r}"[:400])
            return [b for i, b in enumerate(buf) if i not in culprits]
        log.error("step %d raised on groups %s: %r; re-reading them (dead-lettered after "
                  "%d deliveries)", step, gids[:8], err,
                  self.cfg.bus.max_deliveries, exc_info=err)
        for k in bus.lanes.keys:
            bus.replay_pending(k.scored, TRAINERS_GROUP, self.consumer)
        await asyncio.sleep(0.5)  # no hot loop on a persistent failure
        return []
