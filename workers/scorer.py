"""Scorer role: reward each completion, compute group advantages, hand groups on.

A consumer in group ``scorers`` on ``rollouts``. Per entry, exactly one of:
- hand-off to ``scored`` (atomic with the ack, conditional on the entry still pending);
- retire ``filtered`` when all rewards of the group are equal (no gradient), unless
  ``scoring.zero_variance = "train"`` (then it is handed off at advantage 0, as TRL trains it);
  with a teacher, only when every token's advantage is 0 as well (in practice never);
- dead-letter: an undecodable entry (counted ``undecodable``, retires nothing); retired
  ``dead``: reward functions (or the teacher) failing on ``max_deliveries`` deliveries,
  or a scored group its reader would reject (checked by decoding the hand-off's bytes
  with the trainer's limits: e.g. a reward finite in float64 but not in float32);
- leave pending: a reward function or the teacher failed and deliveries remain (read
  again later).
Entries of crashed scorers are reclaimed with XAUTOCLAIM after ``claim_idle_ms``.

Rewards are computed for a whole read at once (`workers.group_scores.rewards_of`: one call
per function over every completion of every decoded group, so a reward model sees a
batch; the functions run concurrently in the scorer's reward process, which is killed
and replaced when a call outlives ``reward_timeout_s``: `workers.reward_runner`).
If that call fails, each group is retried alone (concurrently), so a failure is charged
only to the groups that fail on their own: they count in ``reward_errors`` and follow
the rule above; the others are scored. The read's hand-offs then go to Redis in one
pipelined round trip (`Bus.handoff_many`: one idempotent HANDOFF script per entry).

At start (and in `sluice up` / `sluice score` before any role runs: `check_rewards`) each
function is probed once on a held-out prompt of the task; one that cannot be called
(wrong signature, missing column, wrong result shape) stops the scorer with the
function's own error instead of dead-lettering every group.

On-policy distillation (``scoring.teacher``, `workers.teacher`): the teacher scores
every sampled token of the read (one batch, same whole-read-then-per-group rule as the
rewards), and each rollout gets per-token advantages (`pipeline.rl.distillation`): its
reward advantage (0 with ``scoring.rewards = []``) + ``teacher_coef`` x (teacher -
behaviour logprob) at mask-1 tokens. ``advantages`` then holds their mean over mask-1
tokens (reports); the ledger's ``adv_sum`` stays the sum of the reward advantages (the
audited, group-centred part; the teacher term is not centred) and ``kl`` records the
group's mean per-token reverse KL (behaviour - teacher), which the heartbeat, the
``sluice_sample_teacher_kl`` gauge and a log line every `KL_LOG_EVERY_S` report too.
The teacher's vocabulary is checked against the policy's at start (`check_teacher`).

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.bus import control
from pipeline.bus.client import Bus, worker_id
from pipeline.bus.codec import DecodeError, decode, encode, peek_group_id
from pipeline.bus.inbound import triage
from pipeline.bus.keys import ARCHIVERS_GROUP, SCORERS_GROUP, TRAINERS_GROUP
from pipeline.bus.ledger import Ledger, dead_event
from pipeline.bus.replies import Entry
from pipeline.bus.schema import RolloutGroup, RunFinished, ScoredGroup
from pipeline.config import Config
from pipeline.metrics import start as start_metrics
from pipeline.rl.advantages import (
    batch_advantages,
    combine_rewards,
    is_zero_variance,
)
from pipeline.rl.distillation import mean_over_mask, reverse_kl, token_advantages
from pipeline.runtime import LEAVE_TIMEOUT_S, Heartbeat, connect, join, limits
from workers.group_scores import hook_advantages, loop_advantages, rewards_of, teacher_of
from workers.hooks import load_hook
from workers.reward_runner import RewardRunner, check_rewards
from workers.rollout_loop import load_loop
from workers.tasks.catalog import Task
from workers.tasks.rewards import (
    RewardError,
    RewardFn,
    load_rewards,
    probe_rewards,
)
from workers.teacher import Teacher, TeacherError, check_teacher, load_teacher

log = logging.getLogger("sluice.scorer")
KL_LOG_EVERY_S = 10.0  # the teacher's reverse KL is logged at most this often


@dataclass
class Scored:
    """A group of one read whose rewards (and teacher logprobs) are in."""

    entry: Entry
    group: RolloutGroup
    parts: np.ndarray  # [n, F]: each reward function's value (NaN where it gave None)
    total: np.ndarray  # [n]: the weighted total reward
    teacher_logprobs: list[np.ndarray] | None  # per rollout, per token; None: no teacher


@dataclass
class Handoff:
    """One group's hand-off to ``scored``: the HANDOFF script's arguments and the ledger
    lines it settles."""

    entry_id: str
    payload: bytes
    op: str
    planned: list[dict[str, object]]


class Scorer:
    def __init__(self, cfg: Config, name: str | None = None):
        self.cfg = cfg
        self.wid = worker_id("scorer", name)
        self.consumer = self.wid.split("/", 1)[1]
        self.metrics = start_metrics(cfg.metrics, "scorer", self.wid,
                                     groups=[("rollouts", SCORERS_GROUP)], lengths=["rollouts"])
        self.rewards: list[RewardFn] = load_rewards(cfg)
        self.runner = RewardRunner(self.rewards, cfg.scoring.reward_timeout_s)
        self.adv_hook = load_hook(cfg.scoring.advantages, "scoring.advantages")
        self.loop = load_loop(cfg, "scorer")  # its compute_advantages replaces the hook
        self.adv_key = ("generation.rollout_loop" if self.loop is not None
                        else "scoring.advantages")
        self.weights = np.array([r.weight for r in self.rewards], dtype=np.float64)
        self.limits = limits(cfg)
        self.counts = {"scored": 0, "filtered": 0, "dead": 0, "reward_errors": 0,
                       "teacher_errors": 0, "reclaimed": 0}
        self.reward_sum = 0.0
        self.reward_n = 0
        self.teacher: Teacher | None = None
        if cfg.scoring.teacher:
            check_teacher(cfg)
            self.teacher = load_teacher(cfg)
        self.kl_sum, self.kl_n = 0.0, 0  # reverse KL (behaviour - teacher), mask-1 tokens
        self._kl_logged = (time.monotonic(), 0.0, 0)
        self.part_sums: dict[str, float] = {r.name: 0.0 for r in self.rewards}
        self.busy = False
        self.ledger = Ledger.for_role(cfg.output_path, "scorer", self.consumer, cfg.run.ledger)

    def op(self, action: str, e: Entry) -> str:
        return f"{action}:{self.consumer}:{e.id}:{e.deliveries}"

    def info(self) -> dict[str, object]:
        kl = {"teacher_kl_sum": self.kl_sum, "teacher_tokens": self.kl_n} if self.teacher else {}
        return {**self.counts, "reward_sum": self.reward_sum, "reward_n": self.reward_n,
                "part_sums": self.part_sums, "busy": self.busy,
                "reward_restarts": self.runner.restarts, **kl}

    async def dead(self, bus: Bus, e: Entry, reason: str, gid: str | None) -> None:
        """Dead-letter ``e``: ``gid`` is the group it decoded to (retired ``dead``), or
        None for an entry that did not decode (counted ``undecodable``; the group id it
        may name is not believed, `pipeline.bus.inbound`)."""
        claimed = None if gid is not None else peek_group_id(e.fields)
        log.warning("dead-lettering %s (group %s): %s", e.id,
                    gid or f"none; claims {claimed}", reason)
        op = self.op("dead", e)
        if await self.ledger.settle(
                op, [dead_event(gid, e.id, reason, claimed)],
                lambda: bus.dead_letter(e.stream, SCORERS_GROUP, e, reason=reason,
                                        role=self.wid, retire=gid is not None, op=op)):
            self.counts["dead"] += 1

    async def process(self, bus: Bus, entries: list[Entry]) -> None:
        """Settle one read: decode (`pipeline.bus.inbound.triage`), reward and ask the
        teacher (`score`), compute the read's advantages, settle each group
        (`settle`: filtered, dead or handed off) and hand the read's groups off in one
        pipelined round trip (module docstring)."""
        decoded: list[tuple[Entry, RolloutGroup]] = []
        now = time.time()
        for e in entries:
            if e.fields is not None:  # queue wait: from the append (the id's time) to now
                self.metrics.wait("rollouts", now - int(e.id.split("-")[0]) / 1000)
            g = await triage(bus, e, SCORERS_GROUP, stream=bus.keys.rollouts,
                             expect=RolloutGroup, limits=self.limits,
                             max_deliveries=self.cfg.bus.max_deliveries,
                             dead_letter=lambda e, reason, gid: self.dead(bus, e, reason, gid))
            if g is not None:
                decoded.append((e, g))
        scored = await self.score(bus, decoded)
        if not scored:
            return
        sc = self.cfg.scoring
        advs = batch_advantages([s.total for s in scored], scale_rewards=sc.scale_rewards,
                                eps=sc.std_eps, ddof=sc.std_ddof)
        if self.loop is not None:  # the read's rows, for compute_advantages (one HMGET)
            self.loop.state.load(await bus.loop_read([s.group.prompt_index for s in scored]))
        handoffs = [h for s, adv in zip(scored, advs, strict=True)
                    if (h := await self.settle(bus, s, adv)) is not None]
        if self.loop is not None:  # written before the hand-off: a group trained is seen
            await bus.loop_write(self.loop.state.take_writes())
        if handoffs:  # the read's hand-offs in one pipelined round trip (module docstring)
            src = scored[0].entry.stream  # one read is one lane's (`Bus.read_lanes`)
            done = await self.ledger.settle_many(
                [(h.op, h.planned) for h in handoffs],
                lambda: bus.handoff_many(src, SCORERS_GROUP, bus.lanes.of_stream(src).scored,
                                         [(h.entry_id, h.payload, h.op) for h in handoffs]))
            self.counts["scored"] += sum(1 for new_id in done if new_id)
        self.log_kl()

    async def score(self, bus: Bus, decoded: list[tuple[Entry, RolloutGroup]]
                    ) -> list[Scored]:
        """The rewards (and teacher logprobs) of every decoded group, the whole read at
        once. A group whose reward functions or teacher failed on their own is counted
        and dead-lettered on its last delivery, otherwise left pending to be read again;
        it is not in the result."""
        groups = [g for _, g in decoded]
        results, teacher = await asyncio.gather(
            rewards_of(self.runner, groups),
            teacher_of(self.teacher, groups))
        scored: list[Scored] = []
        for (e, g), parts, tlp in zip(decoded, results, teacher, strict=True):
            try:
                if isinstance(parts, RewardError):
                    raise parts
                if isinstance(tlp, TeacherError):
                    raise tlp
                total = self.total(parts)
            except (RewardError, TeacherError) as err:
                what = "teacher" if isinstance(err, TeacherError) else "reward"
                self.counts[f"{what}_errors"] += 1
                if e.deliveries >= self.cfg.bus.max_deliveries:
                    await self.dead(bus, e, f"{what}: {err}", g.group_id)
                else:  # stays pending; reclaimed and retried after claim_idle_ms
                    log.warning("%s failed for %s (delivery %d): %s", what, e.id,
                                e.deliveries, err)
                continue
            scored.append(Scored(e, g, parts, total, tlp))
        return scored

    async def settle(self, bus: Bus, s: Scored, adv: np.ndarray) -> Handoff | None:
        """One scored group, given its group-relative reward advantages ``adv``: counted,
        written to the ledger, then retired ``filtered`` (no gradient and
        ``scoring.zero_variance = "filter"``), dead-lettered (the advantages hook
        failed, or its encoding would not decode with the limits the trainer uses:
        handed off, the trainer would dead-letter it undecodable, which retires nothing,
        and the group would hold a window slot for good), or returned as the hand-off."""
        e, g, parts, total = s.entry, s.group, s.parts, s.total
        self.reward_sum += float(total.sum())
        self.reward_n += len(total)
        for j, rf in enumerate(self.rewards):
            self.part_sums[rf.name] += float(np.nansum(parts[:, j]))
        flat = is_zero_variance(total)
        if flat:  # exactly 0, so the trainer can tell it carries no gradient
            adv = np.zeros_like(adv)
        # the ledger's adv_sum: the group-relative reward advantages, centred on the group
        # (audited); not a hook's replacement, nor the teacher's per-token term
        adv_sum = round(float(np.sum(adv)), 6)
        try:
            adv, tadv, flat = await self.final_advantages(s, adv, flat)
        except ValueError as err:  # the hook's bug: the group's, like a reward's
            self.counts["reward_errors"] += 1
            await self.dead(bus, e, f"{self.adv_key}: {err}", g.group_id)
            return None
        gid = g.group_id
        handoff = None
        if not (flat and self.cfg.scoring.zero_variance == "filter"):
            sg = ScoredGroup(group=g.for_training(), rewards=total.astype(np.float32),
                             reward_parts={rf.name: parts[:, j].astype(np.float32)
                                           for j, rf in enumerate(self.rewards)},
                             advantages=np.asarray(adv, dtype=np.float32) if tadv is None
                             else mean_over_mask(tadv, [r.mask for r in g.rollouts]),
                             scorer=self.wid, t_scored=time.time(), token_advantages=tadv)
            payload = encode(sg)
            try:  # what the trainer will decode, exactly: the same bytes, codec and limits
                decode(payload, self.limits, expect=ScoredGroup)
            except DecodeError as err:  # e.g. a reward finite in float64, inf in float32
                await self.dead(bus, e, f"scored group its reader would reject: {err}", gid)
                return None
            handoff = Handoff(e.id, payload, self.op("handoff", e),
                              [{"ev": "handed_off", "gid": gid, "id": e.id,
                                "version": int(g.min_version)}])
        kl = self.teacher_kl(s)
        self.ledger.write("scored", gid, id=e.id, n=len(total), adv_sum=adv_sum, **kl)
        if handoff is None:  # flat, and scoring.zero_variance = "filter"
            op = self.op("filtered", e)
            if await self.ledger.settle(
                    op, [{"ev": "filtered", "gid": gid, "id": e.id}],
                    lambda: bus.retire(e.stream, SCORERS_GROUP, [e.id], "filtered", op=op)):
                self.counts["filtered"] += 1
        return handoff

    async def final_advantages(self, s: Scored, adv: np.ndarray, flat: bool
                               ) -> tuple[np.ndarray, list[np.ndarray] | None, bool]:
        """What the group trains with: per rollout, per token when a hook or the teacher
        gives them (None otherwise), and whether it all is zero (``flat``: no gradient;
        given for the group-relative ``adv``). The ``scoring.advantages`` hook (or the
        rollout loop's ``compute_advantages``, given ``adv`` and the per-row state of
        the read: `workers.rollout_loop`) replaces the group-relative advantages; the
        teacher's term is added per token on top (module docstring). ``ValueError`` when
        the hook raises or returns garbage."""
        tadv = None
        if self.adv_hook is not None:
            adv, tadv = await hook_advantages(self.adv_hook, s.group, s.total)
        elif self.loop is not None:
            parts = {rf.name: s.parts[:, j] for j, rf in enumerate(self.rewards)}
            adv, tadv = await loop_advantages(self.loop, s.group, s.total, parts, adv)
        if self.adv_hook is not None or self.loop is not None:
            flat = not adv.any() and (tadv is None or not any(a.any() for a in tadv))
        if s.teacher_logprobs is not None:
            masks = [r.mask for r in s.group.rollouts]
            behaviour = [r.logprobs for r in s.group.rollouts]
            coef = self.cfg.scoring.teacher_coef
            if tadv is None:
                tadv = token_advantages(adv, behaviour, s.teacher_logprobs, masks, coef)
            else:
                teacher_term = token_advantages(np.zeros(len(masks)), behaviour,
                                                s.teacher_logprobs, masks, coef)
                tadv = [(x + y).astype(np.float32)
                        for x, y in zip(tadv, teacher_term, strict=True)]
            flat = not any(a.any() for a in tadv)
        return adv, tadv, flat

    def teacher_kl(self, s: Scored) -> dict[str, float | int]:
        """The group's mean per-token reverse KL (behaviour - teacher) for the ledger,
        added to the scorer's running sums; nothing without a teacher."""
        if s.teacher_logprobs is None:
            return {}
        kl_sum, kl_n = reverse_kl([r.logprobs for r in s.group.rollouts], s.teacher_logprobs,
                                  [r.mask for r in s.group.rollouts])
        self.kl_sum += kl_sum
        self.kl_n += kl_n
        return {"kl": round(kl_sum / max(kl_n, 1), 6), "kl_n": kl_n}

    def total(self, parts: np.ndarray) -> np.ndarray:
        """The weighted total reward of each completion (``[n, F]`` -> ``[n]``); 0 with no
        reward functions (pure distillation). ``RewardError`` when every function gave
        a completion None."""
        if not self.rewards:
            return np.zeros(len(parts), dtype=np.float64)
        total = combine_rewards(parts, self.weights)
        if not np.isfinite(total).all():
            raise RewardError("+".join(r.name for r in self.rewards),
                              "no function gave a completion a reward (all None)")
        return total

    def log_kl(self) -> None:
        """Every `KL_LOG_EVERY_S` at most: the teacher's mean per-token reverse KL over the
        tokens scored since the last such line."""
        t0, sum0, n0 = self._kl_logged
        now = time.monotonic()
        if self.teacher is None or now - t0 < KL_LOG_EVERY_S or self.kl_n == n0:
            return
        log.info("teacher reverse KL %.4f nats/token over %d tokens (%.4f since the start)",
                 (self.kl_sum - sum0) / (self.kl_n - n0), self.kl_n - n0,
                 self.kl_sum / self.kl_n)
        self._kl_logged = (now, self.kl_sum, self.kl_n)

    async def watch_control(self, bus: Bus, stop: asyncio.Event) -> None:
        async for msg in control.watch(bus, from_id="0", stop=stop,
                                       block_ms=self.cfg.bus.block_ms):
            if isinstance(msg, RunFinished):
                stop.set()

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await probe_rewards(self.cfg, self.rewards, probe=self.runner.probe)
        except BaseException:
            await self.runner.close()
            raise
        if self.teacher is not None:
            await self.teacher.start()
        bus = connect(self.cfg)
        for lane in bus.lanes.keys:
            await bus.retrying(lambda k=lane: bus.ensure_group(k.rollouts, SCORERS_GROUP),
                               "group")
            await bus.retrying(lambda k=lane: bus.ensure_group(k.scored, TRAINERS_GROUP),
                               "group")
            if self.cfg.archive.enabled:  # before any hand-off, so none is trimmed unarchived
                await bus.retrying(lambda k=lane: bus.ensure_group(k.scored, ARCHIVERS_GROUP),
                                   "group")
        hb = Heartbeat(bus, self.wid, self.cfg.bus.heartbeat_s, self.info, self.metrics)
        hb.start()
        watcher = asyncio.create_task(self.watch_control(bus, stop))
        claim_every_s = self.cfg.bus.claim_idle_ms / 2000
        last_claim = 0.0
        log.info("scorer %s started with rewards %s%s", self.wid,
                 [r.name for r in self.rewards],
                 f" and teacher {self.cfg.scoring.teacher}" if self.teacher else "")
        try:
            while not stop.is_set():
                entries = []
                if time.monotonic() - last_claim > claim_every_s:
                    last_claim = time.monotonic()
                    for lane in bus.lanes.keys:  # a claimed batch is one lane's
                        entries = await bus.retrying(lambda k=lane: bus.reclaim(
                            k.rollouts, SCORERS_GROUP, self.consumer,
                            min_idle_ms=self.cfg.bus.claim_idle_ms,
                            count=self.cfg.scoring.read_count), "reclaim", stop)
                        self.counts["reclaimed"] += len(entries)
                        if entries:
                            break
                    await bus.retrying(lambda: self.janitor(bus), "janitor", stop)
                if not entries:
                    entries = await bus.retrying(lambda: bus.read_lanes(
                        "rollouts", SCORERS_GROUP, self.consumer,
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
                gone = []
                for k in bus.lanes.keys:  # bounded: a scorer leaving never hangs on Redis
                    gone.append(await asyncio.wait_for(bus.retire_consumer(
                        k.rollouts, SCORERS_GROUP, self.consumer), LEAVE_TIMEOUT_S))
                left = "yes" if all(gone) else "no (entries pending)"
            await hb.stop(forget=left == "yes")
            await bus.close()
            if self.teacher is not None:
                await self.teacher.close()
            await self.runner.close()
            self.ledger.close()
            log.info("scorer %s stopped: %s; left the group: %s", self.wid, self.counts, left)

    async def janitor(self, bus: Bus) -> None:
        """Free acknowledged ``rollouts`` entries and forget long-dead consumers, in every
        lane."""
        for k in bus.lanes.keys:
            self.counts["trimmed"] = self.counts.get("trimmed", 0) + await bus.trim_acked(
                k.rollouts, keep_ms=int(self.cfg.bus.keep_acked_s * 1000))
            await bus.prune_consumers(k.rollouts, SCORERS_GROUP,
                                      idle_ms=10 * self.cfg.bus.claim_idle_ms)


def preflight(cfg: Config, task: Task | None, policy_tokenizer: Callable[[], Any]) -> None:
    """What the scorer loads first, checked before any role starts (`sluice score`,
    `sluice up`): the ``scoring.advantages`` hook imports (or the rollout loop is set
    up), every reward function is called once on a held-out prompt in a reward process
    (`workers.reward_runner.check_rewards`; ``task`` built here when not given), and a
    teacher's vocabulary is the policy's (`check_teacher`; ``policy_tokenizer`` is called
    only then). Each failure is a ``ConfigError`` / ``ValueError`` naming the key."""
    load_hook(cfg.scoring.advantages, "scoring.advantages")
    load_loop(cfg, "scorer")
    check_rewards(cfg, task)
    if cfg.scoring.teacher:
        check_teacher(cfg, policy_tokenizer())


async def main(cfg: Config, stop: asyncio.Event, name: str | None = None) -> None:
    await Scorer(cfg, name).run(stop)
