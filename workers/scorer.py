"""Scorer role: reward each completion, compute group advantages, hand groups on.

A consumer in group ``scorers`` on ``rollouts``. Per entry, exactly one of:
- hand-off to ``scored`` (atomic with the ack, conditional on the entry still pending);
- retire ``filtered`` when all rewards of the group are equal (no gradient), unless
  ``scoring.zero_variance = "train"`` (then it is handed off at advantage 0, as TRL trains it);
- dead-letter (retired ``dead``): undecodable entry, or reward functions failing on
  ``max_deliveries`` deliveries;
- leave pending: a reward function failed and deliveries remain (read again later).
Entries of crashed scorers are reclaimed with XAUTOCLAIM after ``claim_idle_ms``.

Every state change is one idempotent script keyed by (consumer, entry id, delivery), so a
batch retried after a lost Redis reply neither acts twice nor loses its ledger record.
Scale-down: on SIGTERM a scorer finishes the batch it holds, then leaves the consumer
group only if nothing is pending on it (entries it could not score stay pending and are
reclaimed by the others). Scorers also act as the janitor of ``rollouts``: they trim
acknowledged entries and remove long-idle consumers with nothing pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import numpy as np

from pipeline import control
from pipeline.advantages import (
    batch_advantages,
    combine_rewards,
    is_zero_variance,
)
from pipeline.bus import Bus, Entry, worker_id
from pipeline.codec import DecodeError, decode_entry, encode, peek_group_id
from pipeline.config import Config
from pipeline.keys import SCORERS_GROUP, TRAINERS_GROUP
from pipeline.ledger import Ledger
from pipeline.runtime import Heartbeat, connect, join, limits
from pipeline.schema import RolloutGroup, RunFinished, ScoredGroup
from workers.rewards import RewardError, RewardFn, call_reward, load_reward

log = logging.getLogger("sluice.scorer")


class Scorer:
    def __init__(self, cfg: Config, name: str | None = None):
        self.cfg = cfg
        self.wid = worker_id("scorer", name)
        self.consumer = self.wid.split("/", 1)[1]
        self.rewards: list[RewardFn] = [load_reward(s.fn, s.weight) for s in cfg.scoring.rewards]
        self.weights = np.array([r.weight for r in self.rewards], dtype=np.float64)
        self.limits = limits(cfg)
        self.counts = {"scored": 0, "filtered": 0, "dead": 0, "reward_errors": 0,
                       "reclaimed": 0}
        self.reward_sum = 0.0
        self.reward_n = 0
        self.part_sums: dict[str, float] = {r.name: 0.0 for r in self.rewards}
        self.busy = False
        self.ledger = Ledger.for_role(cfg.output_path, "scorer", self.consumer, cfg.run.ledger)

    def op(self, action: str, e: Entry) -> str:
        return f"{action}:{self.consumer}:{e.id}:{e.deliveries}"

    def info(self) -> dict[str, object]:
        return {**self.counts, "reward_sum": self.reward_sum, "reward_n": self.reward_n,
                "part_sums": self.part_sums, "busy": self.busy}

    async def rewards_of(self, g: RolloutGroup) -> np.ndarray:
        """[n, F] reward matrix (NaN where a function returned None)."""
        prompts = [g.prompt] * len(g.rollouts)
        fields: dict[str, list] = {k: [v] * len(g.rollouts) for k, v in g.prompt.items()}
        fields["finish_reason"] = [r.finish_reason for r in g.rollouts]
        completions = [r.text for r in g.rollouts]
        ids = [r.completion_ids.tolist() for r in g.rollouts]
        cols = await asyncio.gather(*[
            call_reward(rf, prompts, completions, ids, fields, self.cfg.scoring.reward_timeout_s)
            for rf in self.rewards])
        return np.array([[np.nan if v is None else v for v in col] for col in cols],
                        dtype=np.float64).T

    async def dead(self, bus: Bus, e: Entry, reason: str) -> None:
        gid = peek_group_id(e.fields)
        log.warning("dead-lettering %s (group %s): %s", e.id, gid, reason)
        op = self.op("dead", e)
        if await self.ledger.settle(
                op, [{"ev": "dead", "gid": gid, "retired": gid is not None, "id": e.id,
                      "reason": reason[:200]}],
                lambda: bus.dead_letter(bus.keys.rollouts, SCORERS_GROUP, e, reason=reason,
                                        role=self.wid, retire=gid is not None, op=op)):
            self.counts["dead"] += 1

    async def process(self, bus: Bus, entries: list[Entry]) -> None:
        scored: list[tuple[Entry, RolloutGroup, np.ndarray, np.ndarray]] = []
        for e in entries:
            if e.fields is None:  # deleted while pending: nothing to score
                await bus.ack(bus.keys.rollouts, SCORERS_GROUP, e.id)
                continue
            if e.deliveries > self.cfg.bus.max_deliveries:
                await self.dead(bus, e, f"delivered {e.deliveries} times")
                continue
            try:
                g = decode_entry(e.fields, self.limits, expect=RolloutGroup)
                assert isinstance(g, RolloutGroup)
                parts = await self.rewards_of(g)
                total = combine_rewards(parts, self.weights)
                if not np.isfinite(total).all():
                    raise RewardError("+".join(r.name for r in self.rewards),
                                      "no function gave a completion a reward (all None)")
            except DecodeError as err:
                await self.dead(bus, e, f"decode: {err}")
                continue
            except RewardError as err:
                self.counts["reward_errors"] += 1
                if e.deliveries >= self.cfg.bus.max_deliveries:
                    await self.dead(bus, e, f"reward: {err}")
                else:  # stays pending; reclaimed and retried after claim_idle_ms
                    log.warning("reward failed for %s (delivery %d): %s", e.id, e.deliveries, err)
                continue
            scored.append((e, g, parts, total))
        if not scored:
            return
        sc = self.cfg.scoring
        advs = batch_advantages([t for *_, t in scored], scale_rewards=sc.scale_rewards,
                                eps=sc.std_eps, ddof=sc.std_ddof)
        for (e, g, parts, total), adv in zip(scored, advs, strict=True):
            self.reward_sum += float(total.sum())
            self.reward_n += len(total)
            for j, rf in enumerate(self.rewards):
                self.part_sums[rf.name] += float(np.nansum(parts[:, j]))
            gid = g.group_id
            flat = is_zero_variance(total)
            if flat:  # exactly 0, so the trainer can tell it carries no gradient
                adv = np.zeros_like(adv)
            self.ledger.write("scored", gid, id=e.id, n=len(total),
                              adv_sum=round(float(np.sum(adv)), 6))
            if flat and sc.zero_variance == "filter":
                op = self.op("filtered", e)
                if await self.ledger.settle(
                        op, [{"ev": "filtered", "gid": gid, "id": e.id}],
                        lambda e=e, op=op: bus.retire(bus.keys.rollouts, SCORERS_GROUP, [e.id],
                                                      "filtered", op=op)):
                    self.counts["filtered"] += 1
                continue
            sg = ScoredGroup(group=g, rewards=total.astype(np.float32),
                             reward_parts={rf.name: parts[:, j].astype(np.float32)
                                           for j, rf in enumerate(self.rewards)},
                             advantages=np.asarray(adv, dtype=np.float32), scorer=self.wid,
                             t_scored=time.time())
            op = self.op("handoff", e)
            if await self.ledger.settle(
                    op, [{"ev": "handed_off", "gid": gid, "id": e.id,
                          "version": int(g.min_version)}],
                    lambda e=e, sg=sg, op=op: bus.handoff(
                        bus.keys.rollouts, SCORERS_GROUP, e.id, bus.keys.scored, encode(sg),
                        op=op)):
                self.counts["scored"] += 1

    async def watch_control(self, bus: Bus, stop: asyncio.Event) -> None:
        async for msg in control.watch(bus, from_id="0", stop=stop,
                                       block_ms=self.cfg.bus.block_ms):
            if isinstance(msg, RunFinished):
                stop.set()

    async def run(self, stop: asyncio.Event) -> None:
        bus = connect(self.cfg)
        await bus.retrying(lambda: bus.ensure_group(bus.keys.rollouts, SCORERS_GROUP), "group")
        await bus.retrying(lambda: bus.ensure_group(bus.keys.scored, TRAINERS_GROUP), "group")
        hb = Heartbeat(bus, self.wid, self.cfg.bus.heartbeat_s, self.info)
        hb.start()
        watcher = asyncio.create_task(self.watch_control(bus, stop))
        claim_every_s = self.cfg.bus.claim_idle_ms / 2000
        last_claim = 0.0
        log.info("scorer %s started with rewards %s", self.wid, [r.name for r in self.rewards])
        try:
            while not stop.is_set():
                entries = []
                if time.monotonic() - last_claim > claim_every_s:
                    last_claim = time.monotonic()
                    entries = await bus.retrying(lambda: bus.reclaim(
                        bus.keys.rollouts, SCORERS_GROUP, self.consumer,
                        min_idle_ms=self.cfg.bus.claim_idle_ms,
                        count=self.cfg.scoring.read_count), "reclaim", stop)
                    self.counts["reclaimed"] += len(entries)
                    await bus.retrying(lambda: self.janitor(bus), "janitor", stop)
                if not entries:
                    entries = await bus.retrying(lambda: bus.read_group(
                        bus.keys.rollouts, SCORERS_GROUP, self.consumer,
                        count=self.cfg.scoring.read_count, block_ms=self.cfg.bus.block_ms),
                        "read rollouts", stop)
                self.busy = bool(entries)
                await bus.retrying(lambda es=entries: self.process(bus, es), "score", stop)
                self.busy = False
        except asyncio.CancelledError:
            pass
        finally:
            stop.set()
            await join(watcher, self.cfg.bus.block_ms / 1000 + 5)
            left = "unknown"
            with contextlib.suppress(Exception):
                left = "yes" if await bus.retire_consumer(
                    bus.keys.rollouts, SCORERS_GROUP, self.consumer) else "no (entries pending)"
            await hb.stop(forget=left == "yes")
            await bus.close()
            self.ledger.close()
            log.info("scorer %s stopped: %s; left the group: %s", self.wid, self.counts, left)

    async def janitor(self, bus: Bus) -> None:
        """Free acknowledged ``rollouts`` entries and forget long-dead consumers."""
        self.counts["trimmed"] = self.counts.get("trimmed", 0) + await bus.trim_acked(
            bus.keys.rollouts, SCORERS_GROUP, keep=self.cfg.bus.keep_acked)
        await bus.prune_consumers(bus.keys.rollouts, SCORERS_GROUP,
                                  idle_ms=10 * self.cfg.bus.claim_idle_ms)


async def main(cfg: Config, stop: asyncio.Event, name: str | None = None) -> None:
    await Scorer(cfg, name).run(stop)
