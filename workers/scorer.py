"""Scorer role: reward each completion, compute group advantages, hand groups on.

A consumer in group ``scorers`` on ``rollouts``. Per entry, exactly one of:
- hand-off to ``scored`` (atomic with the ack, conditional on the entry still pending);
- retire ``filtered`` when all rewards of the group are equal (no gradient);
- dead-letter (retired ``dead``): undecodable entry, or reward functions failing on
  ``max_deliveries`` deliveries;
- leave pending: a reward function failed and deliveries remain (read again later).
Entries of crashed scorers are reclaimed with XAUTOCLAIM after ``claim_idle_ms``.
"""

from __future__ import annotations

import asyncio
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
        if await bus.dead_letter(bus.keys.rollouts, SCORERS_GROUP, e, reason=reason,
                                 role=self.wid, retire=gid is not None):
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
                    raise RewardError("a completion got no reward from any function")
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
            if is_zero_variance(total):
                self.counts["filtered"] += await bus.retire(
                    bus.keys.rollouts, SCORERS_GROUP, [e.id], "filtered")
                continue
            sg = ScoredGroup(group=g, rewards=total.astype(np.float32),
                             reward_parts={rf.name: parts[:, j].astype(np.float32)
                                           for j, rf in enumerate(self.rewards)},
                             advantages=np.asarray(adv, dtype=np.float32), scorer=self.wid,
                             t_scored=time.time())
            if await bus.handoff(bus.keys.rollouts, SCORERS_GROUP, e.id, bus.keys.scored,
                                 encode(sg)):
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
            await hb.stop()
            await bus.close()
            log.info("scorer %s stopped: %s", self.wid, self.counts)


async def main(cfg: Config, stop: asyncio.Event, name: str | None = None) -> None:
    await Scorer(cfg, name).run(stop)
