"""Evaluator role: greedy exact-match on held-out prompts, per published version.

It follows ``control`` like a generator, evaluates the initial weights, then the newest
announced version at most every ``eval_every_s`` seconds, and the final version when the
run finishes; one JSON line per evaluation in ``<output_dir>/eval.jsonl`` and the latest
figures in its heartbeat. It never writes to a stream, so it can be started or stopped
at any time without affecting the run.

Weights (full or a LoRA adapter: the policy is built by `load_policy`, like a
generator's) are verified by the run's transport and loaded through the engine's own
`load_weights`, so the evaluator scores exactly what generators would sample from.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from pipeline import control
from pipeline.bus import worker_id
from pipeline.config import Config
from pipeline.devices import resolve_device
from pipeline.model import load_policy
from pipeline.runtime import Heartbeat, connect, set_threads
from pipeline.schema import RunFinished, WeightsPublished
from pipeline.transports import WeightError, make_transport
from workers.engines.transformers import TransformersEngine
from workers.prompts import render_prompt
from workers.rewards import exact_match, match_reward
from workers.tasks import task_from_config

log = logging.getLogger("sluice.evaluator")


async def evaluate(engine: TransformersEngine, tokenizer: Any, prompts: list[dict[str, Any]],
                   max_new_tokens: int, system_prompt: str = "") -> dict[str, float]:
    """Greedy decode every prompt; mean exact match and mean match reward (a prompt
    without an answer counts 0)."""
    ids = [render_prompt(tokenizer, p["text"], system_prompt) for p in prompts]
    outs = await engine.greedy(ids, max_new_tokens)
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in outs]
    fields = {"answer": [p.get("answer") for p in prompts],
              "finish_reason": [c.finish_reason for c in outs]}
    em = exact_match(completions=texts, **fields)
    mr = match_reward(completions=texts, **fields)
    return {"exact_match": sum(x or 0.0 for x in em) / len(em),
            "reward": sum(x or 0.0 for x in mr) / len(mr)}


class Evaluator:
    def __init__(self, cfg: Config, every_s: float):
        self.cfg = cfg
        self.every_s = every_s
        self.wid = worker_id("evaluator")
        self.model, self.tokenizer = load_policy(
            cfg, device=resolve_device(cfg.generation.device, "generation.device"))
        self.prompts = task_from_config(cfg, self.tokenizer).heldout(cfg.task.heldout)
        self.engine = TransformersEngine(self.model, self.tokenizer, seed=cfg.run.seed)
        self.weights = make_transport(cfg)  # engine side: receive (verify) versions
        self.path = cfg.output_path / "eval.jsonl"
        self.t0 = time.time()
        self.last: dict[str, Any] = {}

    async def run_once(self, version: int, step: int) -> None:
        res = await evaluate(self.engine, self.tokenizer, self.prompts,
                             self.cfg.generation.max_new_tokens, self.cfg.task.system_prompt)
        now = time.time()
        self.last = {"version": version, "step": step, "t": now - self.t0, "ts": now,
                     "n": len(self.prompts), **res}
        with open(self.path, "a") as f:
            f.write(json.dumps(self.last) + "\n")
        log.info("eval v%d: exact_match %.3f reward %.3f", version, res["exact_match"],
                 res["reward"])

    async def load(self, msg: WeightsPublished) -> bool:
        """Swap in an announced version (verified; the engine is idle, so it applies now).
        False, keeping the current weights, when it cannot be loaded. Verifying and
        reading run in worker threads, so the heartbeat goes on during a big load."""
        try:
            path = await self.weights.receive(msg)
            return await self.engine.load_weights(path, msg.version, msg.format)
        except (WeightError, OSError, ValueError) as e:
            log.warning("cannot evaluate v%d: %s", msg.version, e)
            return False

    async def run(self, stop: asyncio.Event) -> None:
        bus = connect(self.cfg)
        hb = Heartbeat(bus, self.wid, self.cfg.bus.heartbeat_s,
                       lambda: {"version": self.engine.version, "last": self.last})
        hb.start()
        try:
            await self.run_once(0, 0)  # the initial weights, before any training
            pending: WeightsPublished | None = None
            last_eval = time.monotonic()
            async for msg in control.watch(bus, from_id="0", stop=stop, block_ms=200):
                if isinstance(msg, WeightsPublished):
                    if msg.version > self.engine.version:
                        pending = msg
                elif isinstance(msg, RunFinished):
                    final = await control.latest(bus)
                    if final is not None and final.version > self.engine.version \
                            and await self.load(final):
                        await self.run_once(final.version, final.step)
                    break
                if pending and time.monotonic() - last_eval >= self.every_s:
                    if await self.load(pending):
                        await self.run_once(pending.version, pending.step)
                    pending = None
                    last_eval = time.monotonic()
        finally:
            await hb.stop()
            await bus.close()


async def main(cfg: Config, stop: asyncio.Event, every_s: float = 20.0) -> None:
    set_threads(1)
    await Evaluator(cfg, every_s).run(stop)
