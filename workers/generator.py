"""Generator role: admit prompts, sample groups, append them to ``rollouts``.

Loop: claim up to ``batch_groups`` admission slots from the gate (Lua over ``state``);
map each cursor to ``(epoch, prompt_index)`` by a per-epoch seeded shuffle; decode all
their completions in one batch; XADD one `RolloutGroup` per prompt. A watcher coroutine
follows ``control`` and queues each strictly newer, hash-verified weight version on the
engine, which swaps it in between decode steps, so each token's version is exact.

Invariant: once admitted, a group is always appended (even during shutdown the current
batch is finished and written), so an admitted group is never stranded by a clean stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib

import numpy as np

from pipeline import control
from pipeline.bus import worker_id
from pipeline.codec import encode
from pipeline.config import Config
from pipeline.model import load_model
from pipeline.runtime import Heartbeat, connect, join, set_threads
from pipeline.schema import Rollout, RolloutGroup, RunFinished, WeightsPublished
from pipeline.weights import FileWeightStore, WeightError
from workers.engines.base import Completion, SamplingParams
from workers.engines.transformers import TransformersEngine
from workers.tasks import make_task, prompt_for_cursor

log = logging.getLogger("sluice.generator")


def render_prompt(tokenizer: object, text: str) -> list[int]:
    """Token ids of a prompt: through the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return list(tokenizer(rendered, add_special_tokens=False).input_ids)  # type: ignore[operator]
    return list(tokenizer(text, add_special_tokens=False).input_ids)  # type: ignore[operator]


def to_rollout(c: Completion, tokenizer: object) -> Rollout:
    return Rollout(
        completion_ids=c.token_ids.astype(np.int32),
        logprobs=c.logprobs.astype(np.float32),
        versions=c.versions.astype(np.int32),
        mask=np.ones(len(c.token_ids), dtype=np.uint8),
        finish_reason=c.finish_reason,
        text=tokenizer.decode(c.token_ids, skip_special_tokens=True),  # type: ignore[attr-defined]
        candidate_ids=c.candidate_ids,
        candidate_counts=c.candidate_counts,
    )


class Generator:
    def __init__(self, cfg: Config, name: str | None = None):
        self.cfg = cfg
        self.wid = worker_id("generator", name)
        self.task = make_task(cfg.task.name, seed=cfg.run.seed, num_prompts=cfg.task.num_prompts,
                              path=cfg.task.path or None)
        model, self.tokenizer = load_model(cfg.model.path, dtype=cfg.model.dtype)
        # distinct, reproducible sampling streams per generator name
        seed = (cfg.run.seed * 1_000_003 + zlib.crc32(self.wid.encode())) % 2**31
        self.engine = TransformersEngine(model, self.tokenizer, seed=seed, version=0)
        self.store = FileWeightStore(cfg.output_path / "weights")
        self.params = SamplingParams(
            max_new_tokens=cfg.generation.max_new_tokens, temperature=cfg.generation.temperature,
            top_k=cfg.generation.top_k, top_p=cfg.generation.top_p)
        self.groups = 0
        self.completions = 0
        self.tokens = 0
        self.gate_wait_s = 0.0
        self.gate_closed = False
        self.rejected_weights = 0

    def info(self) -> dict[str, object]:
        return {"version": self.engine.version, "groups": self.groups,
                "completions": self.completions, "tokens": self.tokens,
                "gate_wait_s": round(self.gate_wait_s, 3), "gate_closed": self.gate_closed,
                "rejected_weights": self.rejected_weights}

    def apply(self, msg: WeightsPublished) -> None:
        """Queue a strictly newer version on the engine; refuse bad weights, keep serving."""
        if msg.version <= self.engine.version:
            return
        try:
            state = self.store.load(msg)
        except (WeightError, OSError, ValueError) as e:
            self.rejected_weights += 1
            log.warning("refusing weights v%d: %s", msg.version, e)
            return
        self.engine.update_weights(state, msg.version)

    async def watch_control(self, bus, stop: asyncio.Event) -> None:
        async for msg in control.watch(bus, from_id="0", stop=stop,
                                       block_ms=self.cfg.bus.block_ms):
            if isinstance(msg, WeightsPublished):
                self.apply(msg)
            elif isinstance(msg, RunFinished):
                log.info("run finished (%s); stopping", msg.reason)
                stop.set()

    async def admit_batch(self, bus, stop: asyncio.Event) -> list[int]:
        """Claim up to batch_groups cursors; waits (with backoff) while the gate is closed."""
        window = self.cfg.trainer.window
        wait_s = 0.01
        while not stop.is_set():
            cursors: list[int] = []
            for _ in range(self.cfg.generation.batch_groups):
                c = await bus.retrying(lambda: bus.admit(window), "admit", stop)
                if c is None:
                    break
                cursors.append(c)
            if cursors:
                self.gate_closed = False
                return cursors
            self.gate_closed = True
            t0 = time.monotonic()
            await asyncio.sleep(wait_s)
            self.gate_wait_s += time.monotonic() - t0
            wait_s = min(wait_s * 1.5, 0.2)
        return []

    async def catch_up(self, bus) -> None:
        """Before a batch: if ``state.version`` moved past the engine, apply the newest
        announcement now rather than waiting for the watcher to be scheduled."""
        st = await bus.state()
        if st.get("version", 0) > self.engine.version:
            msg = await control.latest(bus)
            if msg is not None:
                self.apply(msg)

    async def generate_batch(self, bus, cursors: list[int]) -> None:
        t_admit = time.time()
        metas, prompt_ids = [], []
        for c in cursors:
            epoch, idx = prompt_for_cursor(c, len(self.task), self.cfg.run.seed)
            prompt = self.task.prompt(idx)
            metas.append((epoch, idx, prompt))
            prompt_ids.append(render_prompt(self.tokenizer, str(prompt["text"])))
        results = await self.engine.generate(prompt_ids, self.cfg.generation.num_generations,
                                             self.params)
        t_done = time.time()
        for (epoch, idx, prompt), pids, comps in zip(metas, prompt_ids, results, strict=True):
            group = RolloutGroup(
                group_id=f"{epoch}:{idx}", prompt_index=idx, epoch=epoch, prompt=prompt,
                prompt_ids=np.asarray(pids, dtype=np.int32), generator=self.wid,
                t_admit=t_admit, t_done=t_done,
                rollouts=[to_rollout(c, self.tokenizer) for c in comps])
            payload = encode(group)
            # retried on connection loss: an admitted group must reach the stream
            await bus.retrying(lambda p=payload: bus.emit(p), "emit group")
            self.groups += 1
            self.completions += len(comps)
            self.tokens += sum(len(c.token_ids) for c in comps)

    async def run(self, stop: asyncio.Event) -> None:
        bus = connect(self.cfg)
        hb = Heartbeat(bus, self.wid, self.cfg.bus.heartbeat_s, self.info)
        hb.start()
        watcher = asyncio.create_task(self.watch_control(bus, stop))
        log.info("generator %s started (engine %s)", self.wid, self.cfg.generation.engine)
        try:
            while not stop.is_set():
                await bus.retrying(lambda: self.catch_up(bus), "catch up", stop)
                cursors = await self.admit_batch(bus, stop)
                if cursors:
                    await self.generate_batch(bus, cursors)
        except asyncio.CancelledError:
            pass
        finally:
            stop.set()
            await join(watcher, self.cfg.bus.block_ms / 1000 + 5)
            await hb.stop()
            await bus.close()
            log.info("generator %s stopped: %d groups", self.wid, self.groups)


async def main(cfg: Config, stop: asyncio.Event, name: str | None = None) -> None:
    set_threads(cfg.generation.threads)
    await Generator(cfg, name).run(stop)
