"""Rank 0's side of the ``scored`` stream: read, settle what is not trained, retire what is.

Every entry read ends in exactly one place, each through one idempotent script with an
intent line in the ledger first (`pipeline.bus.ledger`):
- undecodable → ``dlq`` (retired ``dead`` when it names a group);
- delivered more than ``bus.max_deliveries`` times → ``dlq``: the trainer kept failing
  before it could ack it (a step that raised, then a restart or a re-read), so it must
  not crash-loop the trainer;
- a ``group_id`` already trained (or twice in one buffer) → acked, not retired again;
- older than ``max_staleness`` → retired ``stale``;
- trained → retired ``trained`` after the optimizer step and the announcement;
- in a step whose loss or gradient norm was not finite → ``dlq`` with that reason;
- in a step that raised: a group that raises on its own → ``dlq`` with the error; if none
  does, all are re-read (and reach ``dlq`` past ``max_deliveries`` if it keeps failing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from pipeline.bus.client import Bus, Entry
from pipeline.bus.codec import DecodeError, decode_entry, peek_group_id
from pipeline.bus.keys import TRAINERS_GROUP
from pipeline.bus.schema import ScoredGroup

if TYPE_CHECKING:
    from trainer.trainer import Trainer

log = logging.getLogger("sluice.trainer")

Buffered = tuple[Entry, ScoredGroup]
TRIM_EVERY_STEPS = 10


class Reader:
    def __init__(self, trainer: Trainer):
        self.t = trainer

    async def collect(self, bus: Bus, stop: asyncio.Event, buf: list[Buffered],
                      wait_s: float) -> list[Buffered]:
        """Fill ``buf`` up to ``groups_per_step`` fresh, new groups; returns early when
        stopping or after ``wait_s`` (rank 0 then tells the other ranks it is alive)."""
        t = self.t
        want = t.tc.groups_per_step
        seen = {sg.group.group_id for _, sg in buf}
        deadline = time.monotonic() + wait_s
        while len(buf) < want and not stop.is_set() and time.monotonic() < deadline:
            entries = await bus.retrying(lambda: bus.read_lanes(
                "scored", TRAINERS_GROUP, t.consumer, count=want - len(buf),
                block_ms=t.cfg.bus.block_ms), "read scored", stop)
            for e in entries:
                sg = await self.accept(bus, e, seen)
                if sg is not None:
                    buf.append((e, sg))
                    seen.add(sg.group.group_id)
        return buf

    async def accept(self, bus: Bus, e: Entry, seen: set[str]) -> ScoredGroup | None:
        """The entry's group if it is to be trained; otherwise settle it here (dead-letter,
        stale, duplicate, deleted), retrying through Redis outages."""
        t = self.t
        e.stream = e.stream or bus.keys.scored  # built by hand (tests): lane 0's
        if e.fields is None:
            await bus.retrying(lambda: bus.ack(e.stream, TRAINERS_GROUP, e.id), "ack")
            return None
        if e.deliveries > t.cfg.bus.max_deliveries:
            await self.dead_letter(bus, e, peek_group_id(e.fields),
                                   f"trainer: delivered {e.deliveries} times without a "
                                   "completed step (its step raised; see the trainer log)")
            return None
        try:
            sg = decode_entry(e.fields, t.limits, expect=ScoredGroup)
            assert isinstance(sg, ScoredGroup)
        except DecodeError as err:
            log.warning("dead-lettering %s: %s", e.id, err)
            await self.dead_letter(bus, e, peek_group_id(e.fields), f"decode: {err}")
            return None
        gid = sg.group.group_id
        if gid in t.trained or gid in seen:
            t.counts["duplicates"] += 1
            if await bus.retrying(lambda: bus.ack(e.stream, TRAINERS_GROUP, e.id), "ack"):
                t.ledger.write("duplicate", gid, id=e.id)
            return None
        if t.is_stale(sg):
            op = f"stale:{t.consumer}:{e.id}:{e.deliveries}"
            if await t.ledger.settle(
                    op, [{"ev": "stale", "gid": gid, "id": e.id, "version": t.state.version,
                          "min_version": sg.group.min_version,
                          "max_staleness": t.tc.max_staleness}],
                    lambda: bus.retrying(lambda: bus.retire(
                        e.stream, TRAINERS_GROUP, [e.id], "stale", op=op), "retire")):
                t.counts["stale"] += 1
            return None
        return sg

    async def dead_letter(self, bus: Bus, e: Entry, gid: str | None, reason: str) -> None:
        t = self.t
        op = f"dead:{t.consumer}:{e.id}:{e.deliveries}"
        if await t.ledger.settle(
                op, [{"ev": "dead", "gid": gid, "retired": gid is not None, "id": e.id,
                      "reason": reason[:200]}],
                lambda: bus.retrying(lambda: bus.dead_letter(
                    e.stream or bus.keys.scored, TRAINERS_GROUP, e, reason=reason, role=t.wid,
                    retire=gid is not None, op=op), "dead-letter")):
            t.counts["dead"] += 1

    async def retire_trained(self, bus: Bus, buf: list[Buffered], trained_at: int) -> None:
        """Ack + retire a finished step's groups (at most once), remember their ids."""
        t = self.t
        step = t.state.step
        op = f"trained:{t.consumer}:{step}:{buf[0][0].id}"
        planned = [{"ev": "trained", "gid": sg.group.group_id, "id": e.id, "step": step,
                    "version": trained_at, "min_version": sg.group.min_version,
                    "max_staleness": t.tc.max_staleness, "n": len(sg.rewards)}
                   for e, sg in buf]
        by_lane: dict[str, list[str]] = {}  # a step may hold groups of every lane
        for e, _ in buf:
            by_lane.setdefault(e.stream or bus.keys.scored, []).append(e.id)

        async def retire() -> list[str]:  # one script per lane, each idempotent under `op`
            done: list[str] = []
            for stream, ids in by_lane.items():
                done += await bus.retire(stream, TRAINERS_GROUP, ids, "trained", op=op)
            return done

        retired = await t.ledger.settle(op, planned, lambda: bus.retrying(retire, "retire"))
        for _, sg in buf:
            t.trained[sg.group.group_id] = None
        while len(t.trained) > t.trained_ids_kept:
            t.trained.popitem(last=False)
        t.counts["trained_groups"] += len(retired)
        if step % TRIM_EVERY_STEPS == 0:  # janitor of `scored`
            for k in bus.lanes.keys:
                await bus.retrying(lambda k=k: bus.trim_acked(
                    k.scored, keep_ms=int(t.cfg.bus.keep_acked_s * 1000)), "trim")

    async def skip_step(self, bus: Bus, buf: list[Buffered], metrics: dict[str, Any]) -> None:
        """A non-finite loss or gradient: the step was not taken; its groups go to dlq."""
        t = self.t
        t.counts["skipped_steps"] += 1
        reason = (f"trainer: non-finite step (loss {metrics.get('loss')}, grad_norm "
                  f"{metrics.get('grad_norm')}) at step {t.state.step + 1}; not trained")
        log.error("%s: groups %s", reason, [sg.group.group_id for _, sg in buf][:8])
        for e, sg in buf:
            await self.dead_letter(bus, e, sg.group.group_id, reason)

    async def step_failed(self, bus: Bus, buf: list[Buffered], err: Exception,
                          culprits: list[int]) -> list[Buffered]:
        """A step raised. Groups that raise on their own (``culprits``) go to dlq with the
        error at once and the others stay buffered for the next step. If none does (the
        batch as a whole fails), every group is re-read from the pending list: their
        delivery counts rise and `accept` dead-letters them past ``max_deliveries``.
        Returns what stays buffered."""
        t = self.t
        t.counts["failed_steps"] += 1
        gids = [sg.group.group_id for _, sg in buf]
        if culprits:
            log.error("step %d raised %r; groups %s raise on their own: dead-lettering them",
                      t.state.step + 1, err, [gids[i] for i in culprits])
            for i in culprits:
                e, sg = buf[i]
                await self.dead_letter(bus, e, sg.group.group_id,
                                       f"trainer: its step raised {err!r}"[:400])
            return [b for i, b in enumerate(buf) if i not in culprits]
        log.error("step %d raised on groups %s: %r; re-reading them (dead-lettered after "
                  "%d deliveries)", t.state.step + 1, gids[:8], err,
                  t.cfg.bus.max_deliveries, exc_info=err)
        for k in bus.lanes.keys:
            bus.replay_pending(k.scored, TRAINERS_GROUP, t.consumer)
        await asyncio.sleep(0.5)  # no hot loop on a persistent failure
        return []
