"""Trainer role: consume ``scored``, drop stale samples, take GRPO steps, publish weights.

One consumer per rank in group ``trainers``, with a stable name (``trainer-<rank>``) so a
restarted trainer reads its own pending entries first and drains them.

Per step:
1. read until ``groups_per_step`` usable groups are buffered. A group whose oldest token
   is more than ``max_staleness`` versions behind the published version is retired
   ``stale``; a ``group_id`` already trained is acked without retiring (a duplicate);
2. assert that no stale sample slipped through (checked twice, on read and here);
3. forward, GRPO loss, backward, clip, AdamW step, ``num_iterations`` times
   (`trainer.policy`);
4. every ``weight_sync_steps`` publish weights and announce them — BEFORE retiring, so
   the gate reopens only once the new version is visible to generators;
5. ack + retire the step's groups as ``trained`` (one script: at most once);
6. metrics line to ``metrics.jsonl``; checkpoint every ``save_steps``.
A crash between 3 and 5 redelivers the groups to the restarted trainer, which resumes
from its last checkpoint (older than those groups' step), so they are trained once in
the surviving history.

LoRA runs (``[model.lora]``): the policy is the frozen base wrapped with a peft adapter;
only the adapter trains (the optimizer holds only trainable parameters), every version is
published as an adapter (``format="lora"``), checkpoints hold the adapter, and the KL
reference is the base with the adapter disabled (`trainer.policy.reference_logps`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline import control
from pipeline.bus import Bus, Entry, worker_id
from pipeline.codec import DecodeError, decode_entry, peek_group_id
from pipeline.config import Config
from pipeline.keys import TRAINERS_GROUP
from pipeline.ledger import Ledger
from pipeline.model import load_model, load_policy
from pipeline.runtime import Heartbeat, connect, limits, set_threads
from pipeline.schema import ScoredGroup
from pipeline.weights import FileWeightStore
from trainer.batch import Batch, build_batch
from trainer.checkpoint import Checkpointer, TrainerState
from trainer.loss import LossConfig
from trainer.policy import StepSettings, optimize

log = logging.getLogger("sluice.trainer")

TRAINED_IDS_KEPT = 100_000


class StaleSampleError(AssertionError):
    """A sample beyond max_staleness reached an optimizer step (a bug, never data)."""


class Trainer:
    def __init__(self, cfg: Config, rank: int = 0):
        self.cfg = cfg
        self.tc = cfg.trainer
        self.consumer = f"trainer-{rank}"
        self.wid = worker_id("trainer", self.consumer)
        self.lora = cfg.model.lora is not None
        self.model, self.tokenizer = load_policy(cfg)
        self.model.train()
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=self.tc.lr,
                                           betas=self.tc.adam_betas,
                                           weight_decay=self.tc.weight_decay)
        self.step_settings = StepSettings(
            loss=LossConfig(
                loss_type=self.tc.loss_type, epsilon=self.tc.epsilon,
                epsilon_high=self.tc.epsilon_high, is_mode=self.tc.is_mode,
                is_clip_min=self.tc.is_clip_min, is_clip_max=self.tc.is_clip_max,
                beta=self.tc.beta, kl_bias_correction=self.tc.kl_bias_correction,
                max_completion_length=cfg.generation.max_new_tokens),
            temperature=self.tc.temperature or cfg.generation.temperature,
            num_iterations=self.tc.num_iterations, max_grad_norm=self.tc.max_grad_norm)
        gen = cfg.generation
        self.expects_candidates = gen.top_k > 0 or gen.top_p < 1.0
        self.warned_candidates = False
        out = cfg.output_path
        self.store = FileWeightStore(out / "weights", keep=self.tc.max_staleness + 2)
        self.ckpt = Checkpointer(out / "checkpoints", keep=self.tc.keep_checkpoints)
        self.metrics_path = out / "metrics.jsonl"
        self.limits = limits(cfg)
        self.state = TrainerState()
        self.trained: OrderedDict[str, None] = OrderedDict()
        self.counts = {"stale": 0, "duplicates": 0, "dead": 0, "trained_groups": 0}
        self.last: dict[str, Any] = {}
        self.t_start = time.time()
        self.ref_model: torch.nn.Module | None = None
        self.ledger = Ledger.for_role(out, "trainer", self.consumer, cfg.run.ledger)
        self.nccl: Any = None  # NCCLWeightSync when weights go to vLLM over NCCL
        if self.tc.beta > 0 and not self.lora:  # frozen reference: loaded once, never synced
            self.ref_model, _ = load_model(cfg.model.path, dtype=cfg.model.dtype)
            self.ref_model.requires_grad_(False)

    # ------------------------------------------------------------------ info

    def info(self) -> dict[str, Any]:
        return {"step": self.state.step, "version": self.state.version,
                "max_steps": self.tc.max_steps, **self.counts, "last": self.last}

    # ------------------------------------------------------------------ reading

    def is_stale(self, sg: ScoredGroup) -> bool:
        return self.state.version - sg.group.min_version > self.tc.max_staleness

    async def collect(self, bus: Bus, stop: asyncio.Event) -> list[tuple[str, ScoredGroup]]:
        """Buffer ``groups_per_step`` fresh, new groups (fewer only if stopping)."""
        buf: list[tuple[str, ScoredGroup]] = []
        seen: set[str] = set()
        while len(buf) < self.tc.groups_per_step and not stop.is_set():
            entries = await bus.retrying(lambda: bus.read_group(
                bus.keys.scored, TRAINERS_GROUP, self.consumer,
                count=self.tc.groups_per_step - len(buf), block_ms=self.cfg.bus.block_ms),
                "read scored", stop)
            for e in entries:
                sg = await self.accept(bus, e, seen)
                if sg is not None:
                    buf.append((e.id, sg))
                    seen.add(sg.group.group_id)
        return buf

    async def accept(self, bus: Bus, e: Entry, seen: set[str]) -> ScoredGroup | None:
        """The entry's group if it is to be trained; otherwise settle it here (dead-letter,
        stale, duplicate, deleted), retrying through Redis outages."""
        if e.fields is None:
            await bus.retrying(lambda: bus.ack(bus.keys.scored, TRAINERS_GROUP, e.id), "ack")
            return None
        try:
            sg = decode_entry(e.fields, self.limits, expect=ScoredGroup)
            assert isinstance(sg, ScoredGroup)
        except DecodeError as err:
            log.warning("dead-lettering %s: %s", e.id, err)
            gid, reason = peek_group_id(e.fields), f"decode: {err}"
            op = f"dead:{self.consumer}:{e.id}:{e.deliveries}"
            if await self.ledger.settle(
                    op, [{"ev": "dead", "gid": gid, "retired": gid is not None, "id": e.id,
                          "reason": reason[:200]}],
                    lambda: bus.retrying(lambda: bus.dead_letter(
                        bus.keys.scored, TRAINERS_GROUP, e, reason=reason, role=self.wid,
                        retire=gid is not None, op=op), "dead-letter")):
                self.counts["dead"] += 1
            return None
        gid = sg.group.group_id
        if gid in self.trained or gid in seen:
            self.counts["duplicates"] += 1
            if await bus.retrying(lambda: bus.ack(bus.keys.scored, TRAINERS_GROUP, e.id), "ack"):
                self.ledger.write("duplicate", gid, id=e.id)
            return None
        if self.is_stale(sg):
            op = f"stale:{self.consumer}:{e.id}:{e.deliveries}"
            if await self.ledger.settle(
                    op, [{"ev": "stale", "gid": gid, "id": e.id, "version": self.state.version,
                          "min_version": sg.group.min_version,
                          "max_staleness": self.tc.max_staleness}],
                    lambda: bus.retrying(lambda: bus.retire(
                        bus.keys.scored, TRAINERS_GROUP, [e.id], "stale", op=op), "retire")):
                self.counts["stale"] += 1
            return None
        return sg

    # ------------------------------------------------------------------ training

    def train_step(self, groups: list[ScoredGroup]) -> dict[str, float]:
        stale = [g.group.group_id for g in groups if self.is_stale(g)]
        if stale:
            raise StaleSampleError(f"admitted stale training data: {stale[:5]}")
        batch = build_batch(groups, self.pad_id)
        missing = self.candidates_missing(batch)
        metrics = optimize(self.model, self.optimizer, batch, self.step_settings,
                           self.ref_model)
        m = batch.mask
        age = (self.state.version - batch.versions).float()
        return {"tokens": batch.num_tokens,
                "staleness_mean": float((age * m).sum() / m.sum().clamp(min=1)),
                "staleness_max": float(age[m > 0].max()) if m.sum() > 0 else 0.0,
                "candidates/missing_frac": missing, **metrics}

    def candidates_missing(self, batch: Batch) -> float:
        """Fraction of rows trained over the full vocabulary although the sampler truncated
        (an engine that cannot report candidate sets); warns once per process."""
        if not self.expects_candidates:
            return 0.0
        n_rows = batch.completion_ids.shape[0]
        missing = n_rows if batch.candidates is None else batch.candidates_missing
        if missing and not self.warned_candidates:
            self.warned_candidates = True
            log.warning("generation uses top-k/top-p but %d of %d rollouts carry no candidate "
                        "sets: their IS ratios compare a truncated sampler with a full-vocab "
                        "trainer (biased); see metric candidates/missing_frac", missing, n_rows)
        return missing / max(n_rows, 1)

    async def publish(self, bus: Bus) -> None:
        """Write the version to the store and announce it; with NCCL weight transfer,
        broadcast it to the vLLM servers first, so generators find it already loaded."""
        if self.nccl is not None and not self.nccl.broken:
            try:
                paused_s = await self.nccl.push(self.model.state_dict(), self.state.version)
                self.last["nccl_pause_s"] = paused_s
            except Exception as e:  # the store + announcement below still carry it
                log.error("NCCL weight push of v%d failed: %s", self.state.version, e)
        if self.lora:
            msg = self.store.publish_lora(self.model, version=self.state.version,
                                          step=self.state.step, base_model=self.cfg.model.path)
        else:
            msg = self.store.publish(self.model.state_dict(), version=self.state.version,
                                     step=self.state.step)
        await bus.retrying(lambda: control.announce(bus, msg, maxlen=self.cfg.bus.control_maxlen),
                           "announce")

    # ------------------------------------------------------------------ lifecycle

    async def resume(self, bus: Bus) -> None:
        """Continue from the newest checkpoint; never move ``version`` backwards."""
        st = self.ckpt.load_latest(self.model, self.optimizer)
        redis_version = (await bus.state()).get("version", -1)
        if st is not None:
            self.state = st
            self.trained = OrderedDict.fromkeys(st.trained_ids)
            log.info("resumed from step %d (version %d)", st.step, st.version)
        if redis_version >= self.state.version and (st is not None or redis_version > 0):
            # the bus has seen this version (or newer): announce ours as the next one
            self.state.version = redis_version + 1
        await self.publish(bus)

    def log_metrics(self, row: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def checkpoint(self) -> None:
        self.state.trained_ids = list(self.trained)[-TRAINED_IDS_KEPT:]
        self.ckpt.save(self.model, self.optimizer, self.state)

    async def start_nccl(self) -> None:
        """GPU runs with ``generation.vllm.weight_transfer = "nccl"``: join the servers'
        weight-transfer group as rank 0 (workers.engines.vllm_nccl; untested on CPU)."""
        v = self.cfg.generation.vllm
        if self.cfg.generation.engine != "vllm" or v.weight_transfer != "nccl":
            return
        from workers.engines.vllm_nccl import NCCLWeightSync

        self.nccl = NCCLWeightSync(v.urls, v.nccl_master_address, v.nccl_master_port)
        await self.nccl.init()

    async def run(self, stop: asyncio.Event) -> None:
        await self.start_nccl()
        bus = connect(self.cfg)
        await bus.retrying(lambda: bus.ensure_group(bus.keys.scored, TRAINERS_GROUP), "group")
        Path(self.cfg.output_path).mkdir(parents=True, exist_ok=True)
        await self.resume(bus)
        if self.state.step < self.tc.max_steps:
            await control.clear_finished(bus)
        hb = Heartbeat(bus, self.wid, self.cfg.bus.heartbeat_s, self.info)
        hb.start()
        finished_reason = "stopped"
        try:
            while self.state.step < self.tc.max_steps and not stop.is_set():
                t0 = time.time()
                buf = await self.collect(bus, stop)
                if len(buf) < self.tc.groups_per_step:
                    break  # stopping: leave the partial buffer pending for a restart
                t1 = time.time()
                groups = [sg for _, sg in buf]
                trained_at = self.state.version  # the version staleness was checked against
                metrics = self.train_step(groups)
                self.state.step += 1
                if self.state.step % self.tc.weight_sync_steps == 0:
                    self.state.version += 1
                    await self.publish(bus)
                op = f"trained:{self.consumer}:{self.state.step}:{buf[0][0]}"
                planned = [{"ev": "trained", "gid": sg.group.group_id, "id": entry_id,
                            "step": self.state.step, "version": trained_at,
                            "min_version": sg.group.min_version,
                            "max_staleness": self.tc.max_staleness, "n": len(sg.rewards)}
                           for entry_id, sg in buf]
                retired = await self.ledger.settle(op, planned, lambda b=buf, op=op: bus.retrying(
                    lambda: bus.retire(bus.keys.scored, TRAINERS_GROUP, [i for i, _ in b],
                                       "trained", op=op), "retire"))
                for _, sg in buf:
                    self.trained[sg.group.group_id] = None
                while len(self.trained) > TRAINED_IDS_KEPT:
                    self.trained.popitem(last=False)
                self.counts["trained_groups"] += len(retired)
                if self.state.step % 10 == 0:  # janitor of `scored`
                    await bus.retrying(lambda: bus.trim_acked(
                        bus.keys.scored, TRAINERS_GROUP, keep=self.cfg.bus.keep_acked), "trim")
                run_state = await bus.retrying(bus.state, "state")
                metrics["filtered"] = run_state.get("retired:filtered", 0)
                self.record(groups, metrics, t0, t1)
                if self.state.step % self.tc.save_steps == 0:
                    self.checkpoint()
            else:
                finished_reason = "max_steps" if self.state.step >= self.tc.max_steps else "stop"
            self.checkpoint()
            if finished_reason == "max_steps":
                await control.finish(bus, "max_steps")
        finally:
            await hb.stop()
            await bus.close()
            self.ledger.close()
            if self.nccl is not None:
                await self.nccl.close()
            log.info("trainer stopped at step %d (%s)", self.state.step, finished_reason)

    def record(self, groups: list[ScoredGroup], metrics: dict[str, float], t0: float,
               t1: float) -> None:
        now = time.time()
        rewards = np.concatenate([g.rewards for g in groups])
        n = len(rewards)
        row: dict[str, Any] = {
            "step": self.state.step, "version": self.state.version, "t": now - self.t_start,
            "reward": float(rewards.mean()), "reward_std": float(rewards.std()),
            "samples": n, "groups": len(groups),
            "rollout_wait_s": t1 - t0, "step_time_s": now - t1,
            "samples_per_s": n / max(now - t0, 1e-9),
            "tokens_per_s": metrics["tokens"] / max(now - t0, 1e-9),
            "dropped_stale": self.counts["stale"], "duplicates": self.counts["duplicates"],
            **{f"reward/{k}": float(np.nanmean(np.concatenate(
                [g.reward_parts[k] for g in groups]))) for k in groups[0].reward_parts},
            **metrics}
        self.last = {k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}
        self.log_metrics(row)


async def main(cfg: Config, stop: asyncio.Event, rank: int = 0) -> None:
    set_threads(cfg.trainer.threads)
    await Trainer(cfg, rank).run(stop)
