"""Trainer role: consume ``scored``, drop stale samples, take GRPO steps, publish weights.

One trainer *job* per run (`trainer.lock`): one process, or N torchrun ranks of which rank
0 alone reads the stream, talks to Redis and scatters each step's groups to the others
(`trainer.distributed`). The consumer name is stable (``trainer-0`` by default) so a
restarted trainer reads its own pending entries first and drains them.

Per step (rank 0):
1. read until ``groups_per_step`` usable groups are buffered (`trainer.reader`). A group
   whose oldest token is more than ``max_staleness`` versions behind is retired
   ``stale``; a ``group_id`` already trained is acked without retiring (a duplicate); an
   entry delivered more than ``bus.max_deliveries`` times without a completed step (its
   step kept raising) is dead-lettered;
2. every rank trains its share (`train_step`, in a worker thread so heartbeats and the
   lock keep running): refuse to step if any trained token is older than
   ``max_staleness`` versions (checked twice: on read against the group, here against
   the per-token versions of the tensors about to be trained), micro-batches, GRPO loss,
   backward, clip, AdamW, ``num_iterations`` times (`trainer.step`), LR schedule;
3. every ``weight_sync_steps`` gather the full weights and publish them through the
   run's weight transport, announce — BEFORE retiring, so the gate reopens only once the
   new version is visible to generators;
4. ack + retire the step's groups as ``trained`` (one script: at most once);
5. metrics line to ``metrics.jsonl``; checkpoint every ``save_steps``.
A crash between 2 and 4 redelivers the groups to the restarted trainer, which resumes
from its last checkpoint (older than those groups' step), so they are trained once in
the surviving history.

A step whose loss or gradient norm is not finite is skipped (counted ``skipped_steps``,
logged, never published) and its groups are dead-lettered with the reason. A step that
raises (one process) is logged and its groups are re-read from the pending list, so a
group that keeps failing reaches ``dlq`` after ``max_deliveries``; in a multi-rank job
the exception takes the job down (torchrun semantics) and the restart re-reads them. An
OOM or sticky CUDA error charges no group and stops the trainer (`trainer.gpu_errors`).

LoRA runs (``[model.lora]``): the policy is the frozen base wrapped with a peft adapter;
only the adapter trains, every version is published as an adapter, checkpoints hold the
adapter, and the KL reference is the base with the adapter disabled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from pipeline.bus import control
from pipeline.bus.client import Bus, worker_id
from pipeline.bus.fencing import FencedOut
from pipeline.bus.keys import ARCHIVERS_GROUP, TRAINERS_GROUP
from pipeline.bus.ledger import Ledger
from pipeline.bus.schema import ScoredGroup
from pipeline.bus.version_check import verified_version
from pipeline.config import Config
from pipeline.metrics import start as start_metrics
from pipeline.rl.entropy_control import EntropyControl
from pipeline.rollout_meter import RolloutMeter
from pipeline.runtime import Heartbeat, bound_exit, connect, end_requests, limits, set_threads
from pipeline.tracking import Tracker, open_tracker, trainer_metrics
from pipeline.vlm import without_frozen
from pipeline.weights import make_transport
from trainer import setup
from trainer.batch import Batch, build_batch
from trainer.checkpoint import Checkpointer, TrainerState
from trainer.distributed import (
    IDLE,
    IDLE_HEADER,
    STEP,
    STOP,
    StepHeader,
    compute_thread,
    full_state,
    rank_of,
)
from trainer.fenced import arm, lost
from trainer.gpu_errors import device_fatal
from trainer.lock import TrainerLock, TrainerLockLost
from trainer.perf import ModelShape, device_peak_flops, step_flops
from trainer.reader import Reader, is_stale
from trainer.setup import TrainSetup
from trainer.stats import step_row, step_tokens
from trainer.step import compute_loss, gradient_rows, optimize

log = logging.getLogger("sluice.trainer")
R = TypeVar("R")

ENDED = "ended"  # RunFinished.reason of an orderly end asked for (END_SIGNAL)
IDLE_EVERY_S = 30.0  # rank 0 tells waiting ranks it is alive at least this often


class StaleSampleError(AssertionError):
    """A sample beyond max_staleness reached an optimizer step (a bug, never data)."""


class Trainer:
    def __init__(self, cfg: Config, rank: int = 0):
        self.cfg = cfg
        self.train_cfg = cfg.trainer
        self.consumer = f"trainer-{rank}"
        self.wid = worker_id("trainer", self.consumer)
        self.setup: TrainSetup = setup.build(cfg)  # device, model, optimizer, schedule
        self._compute = compute_thread(self.setup.device)
        self.ranks = self.setup.ranks
        self.metrics = start_metrics(  # rank 0 serves, and reads what it consumes
            cfg.metrics, "trainer", self.wid, serve=self.ranks.is_main,
            groups=[("scored", TRAINERS_GROUP)] + ([("scored", ARCHIVERS_GROUP)]
                                                  if cfg.archive.enabled else []),
            lengths=["scored", "dlq"], window=self.train_cfg.window)
        self.model, self.tokenizer = self.setup.model, self.setup.tokenizer
        self.shape = ModelShape.of(self.model)  # model FLOPs (trainer/perf.py)
        self.peak_flops = device_peak_flops(self.setup.device, cfg.model.dtype,
                                            cfg.trainer.peak_tflops)
        self.optimizer, self.pad_id = self.setup.optimizer, self.setup.pad_id
        self.step_settings = self.setup.settings
        gen = cfg.generation
        self.expects_candidates = gen.top_k > 0 or gen.top_p < 1.0
        self.warned_candidates = False
        out = cfg.output_path
        self.store = make_transport(cfg, keep=self.train_cfg.max_staleness + 2)  # file/lora/nccl
        self.ckpt = Checkpointer(out / "checkpoints", keep=self.train_cfg.keep_checkpoints)
        self.metrics_path = out / "metrics.jsonl"
        self.limits = limits(cfg)
        self.state = TrainerState()
        self.entropy = EntropyControl.of(cfg.trainer)  # the bonus's coefficient per step
        self.last: dict[str, Any] = {}
        self.t_start = time.time()
        self.ledger = Ledger.for_role(out, "trainer", self.consumer,
                                      cfg.run.ledger and self.ranks.is_main)
        self.nccl: Any = self.store if self.store.name == "nccl" else None  # start_nccl
        self.reader = Reader(cfg, self.consumer, self.wid, self.limits, self.ledger,
                             self.metrics)
        self.tracker = Tracker()  # run.report_to, opened by rank 0 once it has resumed
        self.rollout_meter: RolloutMeter | None = RolloutMeter()  # None: cannot read beats

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """The frozen KL reference of a full-weight run (None: no KL, or LoRA's base)."""
        return self.setup.ref.policy if self.setup.ref is not None else None

    def info(self) -> dict[str, Any]:
        return {"step": self.state.step, "version": self.state.version,
                "max_steps": self.train_cfg.max_steps, "ranks": self.ranks.world, **self.counts,
                "weight_fallbacks": getattr(self.store, "fallbacks", 0), "last": self.last}

    async def compute(self, fn: Callable[..., R], *args: Any) -> R:
        """Run ``fn(*args)`` in this rank's compute thread (`trainer.distributed.
        compute_thread`: one thread, bound to the rank's device), off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    @property
    def counts(self) -> dict[str, int]:
        """How the entries read were settled (`trainer.reader.Reader` counts them)."""
        return self.reader.counts

    def is_stale(self, sg: ScoredGroup) -> bool:
        return is_stale(self.state.version, sg.group.min_version, self.train_cfg.max_staleness)

    async def collect(self, bus: Bus, stop: asyncio.Event) -> list[tuple[str, ScoredGroup]]:
        """``groups_per_step`` fresh, new groups as (entry id, group); fewer only when
        stopping (`trainer.reader.Reader.collect`, without the idle deadline)."""
        buf = await self.reader.collect(bus, stop, [], wait_s=float("inf"),
                                        version=self.state.version)
        return [(e.id, sg) for e, sg in buf]

    # ------------------------------------------------------------------ training

    def train_step(self, groups: list[ScoredGroup]) -> dict[str, float]:
        """One optimizer step on this rank's share of ``groups`` (all ranks call it)."""
        stale = [g.group.group_id for g in groups if self.is_stale(g)]
        if stale:
            raise StaleSampleError(f"admitted stale training data: {stale[:5]}")
        batch = build_batch(self.ranks.shard(groups), self.pad_id)
        trained = batch.mask > 0
        age = (self.state.version - batch.versions).float()
        if trained.any() and float(age[trained].max()) > self.train_cfg.max_staleness:
            raise StaleSampleError(
                f"admitted stale training data: a token {int(age[trained].max())} versions "
                f"old (max_staleness {self.train_cfg.max_staleness}) in the batch of version "
                f"{self.state.version}")
        missing = self.candidates_missing(batch)
        every_row = self.entropy.enabled
        forwarded = batch.seq_lens[gradient_rows(batch, self.step_settings.loss, every_row)]
        started = time.perf_counter()
        applied = self.entropy.applied()
        metrics = optimize(self.setup.fwd, self.optimizer, batch, self.step_settings,
                           self.setup.ref, data_parallel=self.ranks.data_parallel(),
                           scaler=self.setup.scaler, entropy_coef=applied,
                           every_row=every_row)
        metrics["perf/fwd_bwd_s"] = time.perf_counter() - started
        metrics["perf/step_flops"] = step_flops(
            self.shape, forwarded, passes=self.step_settings.num_iterations,
            reference=self.step_settings.loss.beta > 0)
        if not metrics["skipped"]:
            self.setup.scheduler.step()
            self.entropy.update(metrics["entropy"])  # every rank: the same global entropy
        if every_row:  # TRL's entropy_coef (after the update) and the one this step used
            metrics["entropy_coef"], metrics["entropy_coef_applied"] = self.entropy.coef, applied
        m = batch.mask
        return {"tokens": batch.num_tokens, "lr": float(self.setup.scheduler.get_last_lr()[0]),
                "staleness_mean": float((age * m).sum() / m.sum().clamp(min=1)),
                "staleness_max": float(age[trained].max()) if trained.any() else 0.0,
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

    def culprits(self, groups: list[ScoredGroup]) -> list[int]:
        """Indices of the groups whose loss raises on their own (after a step raised)."""
        bad = []
        for i, g in enumerate(groups):
            try:
                with torch.no_grad():
                    compute_loss(self.setup.fwd, build_batch([g], self.pad_id), self.step_settings)
            except Exception:
                bad.append(i)
        return bad

    def weights(self) -> dict[str, torch.Tensor] | torch.nn.Module:
        """What to publish: the model (one process; LoRA) or the full state gathered from
        the FSDP shards (every rank calls this; rank 0 gets the tensors); without the
        frozen tensors (`pipeline.vlm`: a VLM's tower and projector), which no version
        carries, whatever the transport."""
        frozen = self.setup.frozen
        if not self.ranks.distributed:
            return self.local_weights()
        state = full_state(self.model, self.ranks)
        return without_frozen(state, frozen) if frozen and state else state

    def local_weights(self) -> dict[str, torch.Tensor] | torch.nn.Module:
        """`weights` of this process's model, without gathering (one process)."""
        frozen = self.setup.frozen
        return without_frozen(self.model.state_dict(), frozen) if frozen else self.model

    def step_all(self, header: StepHeader, groups: list[ScoredGroup]
                 ) -> tuple[dict[str, float], Any]:
        """Send the step to every rank, train this rank's share, and gather the weights
        when the step publishes. Blocking: run in a worker thread on rank 0."""
        _, groups = self.ranks.exchange(header, groups, self.limits)
        metrics = self.train_step(groups)
        source = None
        if header.publish and not metrics["skipped"]:
            source = self.weights()
        return metrics, source

    async def publish(self, bus: Bus | None, source: Any = None) -> None:
        """Publish the version through the run's weight transport (`pipeline.weights`:
        sharded safetensors, the LoRA adapter, or an NCCL push to the vLLM servers and
        then the files; the disk work in a worker thread) and announce it (not without a
        bus: a replay, `trainer.replay`)."""
        t0 = time.perf_counter()
        msg = await self.store.publish(self.local_weights() if source is None else source,
                                       version=self.state.version, step=self.state.step)
        self.last.update(self.store.stats)
        if bus is not None:
            await bus.retrying(lambda: control.announce(
                bus, msg, maxlen=self.cfg.bus.control_maxlen), "announce")
        self.metrics.observe("perf_weight_publish_seconds", time.perf_counter() - t0)

    # ------------------------------------------------------------------ lifecycle

    def load_checkpoint(self) -> TrainerState | None:
        """Every rank: the newest checkpoint into the model, optimizer, schedule and
        entropy controller."""
        st = self.ckpt.load_latest(self.model, self.optimizer, self.setup.scheduler,
                                   self.ranks)
        if st is not None:
            self.entropy.restore(st.entropy_coef, st.last_entropy)
        return st

    async def resume(self, bus: Bus) -> None:
        """Continue from the newest checkpoint; never move ``version`` backwards."""
        st = await self.compute(self.load_checkpoint)
        # state.version only as far as the trainer's own announcements on control back it:
        # every writing role may write `state` (pipeline.bus.version_check)
        redis_version = await verified_version(bus)
        if st is not None:
            self.state = st
            self.reader.restore(st.trained_ids)
            if self.rollout_meter is not None:  # generators' tool counts: partly reported
                self.rollout_meter.resumed = True
            log.info("resumed from step %d (version %d)", st.step, st.version)
        if redis_version >= self.state.version and (st is not None or redis_version > 0):
            # the bus has seen this version (or newer): announce ours as the next one
            self.state.version = redis_version + 1
        # the surviving history restarts here: steps after this checkpoint were lost
        # (`pipeline.archive.history.step_plan`)
        self.ledger.write("resumed", None, step=self.state.step, version=self.state.version)
        await self.publish(bus, await self.compute(self.weights))

    def log_metrics(self, row: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.tracker.log(trainer_metrics(row), step=row["step"])  # never raises

    def checkpoint(self) -> None:
        """Every rank (they gather); rank 0 writes."""
        self.state.trained_ids = self.reader.trained_ids()
        self.state.entropy_coef = self.entropy.coef
        self.state.last_entropy = (self.entropy.last_entropy
                                   if math.isfinite(self.entropy.last_entropy) else None)
        self.ckpt.save(self.model, self.optimizer, self.state, self.setup.scheduler, self.ranks)

    async def start_nccl(self) -> None:
        """GPU runs with ``generation.vllm.weight_transfer = "nccl"``: join the servers'
        weight-transfer group as rank 0 (`pipeline.weights.nccl`; untested on CPU)."""
        if self.nccl is not None:
            await self.nccl.start()

    async def run(self, stop: asyncio.Event, end: asyncio.Event | None = None) -> None:
        """Train until ``max_steps`` or ``stop``. ``end`` set (with ``stop``: an orderly
        end asked for, `pipeline.runtime.END_SIGNAL`): the step in hand finishes, the final
        checkpoint is written and `RunFinished` announced as at ``max_steps``, so the
        evaluator evaluates the newest version and every role exits; a resume clears it."""
        if not self.ranks.is_main:
            try:
                await self.compute(self.follow)
                await self.compute(self.ranks.close)
            finally:
                self._compute.shutdown(wait=False)
            return
        clean = False
        log.info("trainer job of %d ranks on %s (layout %s, micro-batch budget %s)",
                 self.ranks.world, self.setup.device, self.step_settings.layout,
                 self.train_cfg.micro_batch_tokens or "off")
        bus = connect(self.cfg)
        lock = TrainerLock(bus, ttl_s=min(30.0, max(2.5, 5 * self.cfg.bus.heartbeat_s)),
                           fence_dir=self.ckpt.root)
        try:
            await lock.acquire(stop)
            await self.compute(arm, lock, self.ckpt, self.store)  # file I/O, never the loop
            await self.start_nccl()
            groups = [TRAINERS_GROUP] + ([ARCHIVERS_GROUP] if self.cfg.archive.enabled else [])
            for k in bus.lanes.keys:  # the archive's group before the janitor may trim
                for g in groups:
                    await bus.retrying(lambda k=k, g=g: bus.ensure_group(k.scored, g), "group")
            Path(self.cfg.output_path).mkdir(parents=True, exist_ok=True)
            await self.resume(bus)
            self.tracker = await asyncio.to_thread(open_tracker, self.cfg, "trainer",
                                                   self.state.step > 0)
            if self.state.step < self.train_cfg.max_steps:
                await control.clear_finished(bus)
            hb = Heartbeat(bus, self.wid, self.cfg.bus.heartbeat_s, self.info, self.metrics)
            hb.start()
            try:
                reason = await self.steps(bus, stop, lock)
                if lock.lost:  # no final checkpoint, no prune: the run is another job's
                    raise lock.lost_error()
                await self.compute(self.stop_ranks)
                clean = True
                if reason == "max_steps":
                    await control.finish(bus, "max_steps")
                elif end is not None and end.is_set():
                    log.info("ending the run as asked at step %d (version %d)",
                             self.state.step, self.state.version)
                    await control.finish(bus, ENDED)
            finally:
                await hb.stop()
                log.info("trainer stopped at step %d", self.state.step)
        except (FencedOut, TrainerLockLost) as e:  # stop at once; exit non-zero saying why
            raise lost(lock, self.ledger, e) from None
        finally:
            bound_exit()  # what is left is leaving: it must not hold the node forever
            await lock.release()
            await bus.close()
            self.ledger.close()
            await asyncio.to_thread(self.tracker.finish)
            if self.nccl is not None:
                await self.nccl.close()
            await self.compute(self.ranks.close, clean)
            self._compute.shutdown(wait=False)

    async def steps(self, bus: Bus, stop: asyncio.Event, lock: TrainerLock) -> str:
        """Rank 0's loop; returns why it ended (max_steps | stop)."""
        buf: list[tuple[Any, ScoredGroup]] = []
        while self.state.step < self.train_cfg.max_steps and not stop.is_set() and not lock.lost:
            t0 = time.time()
            buf = await self.reader.collect(bus, stop, buf, wait_s=IDLE_EVERY_S,
                                            version=self.state.version)
            if len(buf) < self.train_cfg.groups_per_step:
                if not stop.is_set():
                    await self.compute(self.ranks.exchange, IDLE_HEADER)
                continue  # stopping: the partial buffer stays pending for a restart
            t1 = time.time()
            groups = [sg for _, sg in buf]
            step = self.state.step + 1
            header = StepHeader(STEP, self.state.version,
                                publish=step % self.train_cfg.weight_sync_steps == 0,
                                save=step % self.train_cfg.save_steps == 0)
            try:
                metrics, source = await self.compute(self.step_all, header, groups)
            except StaleSampleError:
                raise
            except Exception as e:
                fatal = device_fatal(e, step)  # the device's failure: charge no group
                if fatal is not None:
                    log.error("%s", fatal)
                    raise fatal from e
                if self.ranks.distributed:
                    raise  # the job goes down; the restart re-reads (torchrun semantics)
                buf = await self.reader.step_failed(
                    bus, buf, e, await self.compute(self.culprits, groups), step)
                continue
            if metrics["skipped"]:
                await self.reader.skip_step(bus, buf, metrics, step)
                buf = []
                continue
            self.state.step = step
            if source is not None:
                self.state.version += 1
                await self.publish(bus, source)
            await self.reader.retire_trained(bus, buf, step, header.version)
            buf = []
            run_state = await bus.retrying(bus.state, "state")
            metrics["filtered"] = run_state.get("retired:filtered", 0)
            metrics.update(await self.rollout_series(bus))
            self.record(groups, metrics, t0, t1, trained_at=header.version)
            if header.save:
                await self.compute(self.checkpoint)
        return "max_steps" if self.state.step >= self.train_cfg.max_steps else "stop"

    async def rollout_series(self, bus: Bus) -> dict[str, float]:
        """TRL's ``rollout/*`` series from the generators' heartbeats
        (`pipeline.rollout_meter`); none, with one warning, where the trainer's Redis user
        may not read them (an ACL file rendered by an older sluice) or the read fails."""
        if self.rollout_meter is None:
            return {}
        try:
            return self.rollout_meter.update(await bus.heartbeats_of("generator"))
        except Exception as e:  # a metric: never worth a step
            log.warning("rollout/* series off: cannot read the generators' heartbeats "
                        "(%s); re-render the ACL (`sluice acl`) to give the trainer read "
                        "access to them", e)
            self.rollout_meter = None
            return {}

    def stop_ranks(self) -> None:
        """The final checkpoint, with every rank, unless this step is already saved (a
        last step on ``save_steps``, or no step since the resume); then the others leave
        `follow`."""
        save = self.ckpt.latest_step() != self.state.step
        self.ranks.exchange(StepHeader(STOP, self.state.version, save=save))
        if save:
            self.checkpoint()

    def follow(self) -> None:
        """Ranks > 0: do what rank 0 says until it says STOP."""
        self.load_checkpoint()
        self.weights()  # rank 0's first publish gathers
        while True:
            header, groups = self.ranks.exchange(IDLE_HEADER)
            if header.command == IDLE:
                continue
            self.state.version = header.version
            if header.command == STOP:
                if header.save:
                    self.checkpoint()
                return
            metrics = self.train_step(groups)
            if header.publish and not metrics["skipped"]:
                self.weights()
            if header.save and not metrics["skipped"]:
                self.checkpoint()

    def record(self, groups: list[ScoredGroup], metrics: dict[str, float], t0: float,
               t1: float, trained_at: int) -> None:
        """metrics.jsonl, the trackers and /metrics (staleness per group: ``trained_at``,
        the version the step trained, minus the group's oldest token version)."""
        now = time.time()
        self.state.tokens_seen += step_tokens(groups)
        row = step_row(groups, metrics, step=self.state.step, version=self.state.version,
                       t_run_s=now - self.t_start, wait_s=t1 - t0, step_s=now - t1,
                       counts=self.counts, tokens_seen=self.state.tokens_seen,
                       pass_threshold=self.cfg.eval.pass_threshold,
                       peak_flops=self.peak_flops)
        self.last = {k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}
        self.log_metrics(row)
        self.metrics.step(row, [trained_at - g.group.min_version for g in groups])


async def main(cfg: Config, stop: asyncio.Event, name: str | None = None) -> None:
    end = end_requests(stop)  # first: a request that arrives while the model loads counts
    set_threads(cfg.trainer.threads)
    await Trainer(cfg, rank_of(name)).run(stop, end)
