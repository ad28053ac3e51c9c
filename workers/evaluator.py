"""Evaluator role: held-out prompts scored with reward functions, per published version.

Metrics (`pipeline.evaluation`): mean reward and per-function means of greedy
completions (greedy episodes with an environment or a rollout hook), greedy ``pass@1``
(total reward >= ``eval.pass_threshold``), and sampled ``sampled_pass@k`` when
``eval.num_samples`` > 0. Reward functions are ``eval.rewards``
(default: the training rewards), called exactly as the scorer calls them, in a reward
process (`workers.reward_runner`) that is killed and replaced when a call outlives
``scoring.reward_timeout_s``: an evaluation whose reward call fails is skipped
(``reward_errors``), and the evaluator goes on.

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
import math
import time
from collections.abc import Callable
from typing import Any

from pipeline.attention import attention_for, check_attention
from pipeline.bus import control
from pipeline.bus.client import worker_id
from pipeline.bus.schema import RunFinished, WeightsPublished
from pipeline.config import Config, ConfigError
from pipeline.devices import resolve_device
from pipeline.evaluation import summarize_scores
from pipeline.metrics import start as start_metrics
from pipeline.model import load_policy, load_tokenizer
from pipeline.runtime import Heartbeat, connect, set_threads
from pipeline.tracking import Tracker, check_report_to, eval_metrics, open_tracker
from pipeline.weights import WeightError, check_store, engine_format, make_transport
from workers.engines.base import Engine, SamplingParams
from workers.engines.transformers import TransformersEngine
from workers.episodes import Episode, RolloutContext, TurnBatcher, check_episodes
from workers.hooks import RolloutFn, load_filter, load_rollout, render_group_prompt
from workers.reward_runner import RewardRunner, check_rewards
from workers.tasks.catalog import Task, task_from_config
from workers.tasks.prompts import Messages, render_prompt
from workers.tasks.rewards import RewardError, RewardFn, episode_inputs, load_rewards, reward_kwargs

log = logging.getLogger("sluice.evaluator")


async def reward_values(runner: RewardRunner, tokenizer: Any, prompts: list[dict[str, Any]],
                        outs: list[Episode | None]) -> list[list[float | None]]:
    """``[rollout][function]`` reward values (None where a function gave None, and for
    every function where the rollout failed: its environment or hook broke), the functions
    called exactly as the scorer calls them, in ``runner``'s reward process
    (`workers.reward_runner`: by keyword, one call per function over every rollout;
    `workers.tasks.rewards.episode_inputs`). ``RewardError`` when a function failed, timed
    out (its process then killed and replaced) or returned something invalid."""
    done = [i for i, e in enumerate(outs) if e is not None]
    rows: list[list[float | None]] = [[None] * len(runner.rewards) for _ in outs]
    if not done:
        return rows
    ros = [outs[i].to_rollout(tokenizer) for i in done]  # type: ignore[union-attr]
    ps = [prompts[i] for i in done]
    comps, extra = episode_inputs(ps, ros)
    (m,) = await runner.matrices([reward_kwargs(
        ps, comps, [r.completion_ids.tolist() for r in ros], [r.finish_reason for r in ros],
        extra)])
    if isinstance(m, RewardError):
        raise m
    for i, row in zip(done, m.tolist(), strict=True):
        rows[i] = [None if math.isnan(v) else float(v) for v in row]
    return rows


async def rollouts_of(engine: Engine, tokenizer: Any, prompts: list[dict[str, Any]],
                      ids: list[list[int]], n: int, params: SamplingParams,
                      rollout: RolloutFn | None,
                      convs: list[Messages | None] | None = None
                      ) -> list[list[Episode | None]]:
    """``n`` rollouts per prompt: completions of one batched ``generate``, or episodes of
    the run's environment / rollout hook (as a generator makes them, with ``params``:
    greedy ones for pass@1). A prompt whose episodes fail gives None rollouts (logged):
    they score no reward."""
    if rollout is None:
        return [[Episode.of(c) for c in g] for g in await engine.generate(ids, n, params)]
    batcher = TurnBatcher(engine)

    async def one(p: dict[str, Any], pids: list[int], conv: Messages | None
                  ) -> list[Episode | None]:
        ctx = RolloutContext(p, pids, n, params, tokenizer, batcher, engine.version,
                             conversation=conv)
        try:
            return list(check_episodes(await rollout(dict(p), ctx), n, "rollout"))
        except Exception as e:  # a broken episode fails its prompt, not the evaluation
            log.warning("held-out prompt %r: rollouts failed: %r", p.get("text"), e)
            return [None] * n

    convs = convs or [None] * len(prompts)
    return list(await asyncio.gather(*(one(p, i, c) for p, i, c in zip(prompts, ids, convs,
                                                                        strict=True))))


async def evaluate(engine: Engine, tokenizer: Any, prompts: list[dict[str, Any]],
                   max_new_tokens: int, rewards: list[RewardFn], *,
                   pass_threshold: float = 1.0, num_samples: int = 0,
                   pass_at: tuple[int, ...] | list[int] = (),
                   sampling: SamplingParams | None = None,
                   timeout_s: float = 30.0, system_prompt: str = "",
                   rollout: RolloutFn | None = None,
                   render: Callable[[Any], tuple[list[int], Messages | None]] | None = None,
                   runner: RewardRunner | None = None,
                   ) -> dict[str, float]:
    """Greedy rollouts of every prompt (and ``num_samples`` sampled ones each with
    ``sampling``), scored with ``rewards``, summarised
    (`pipeline.evaluation.summarize_scores`). ``rollout``: the run's environment or
    rollout hook (`workers.hooks.load_rollout`); None = single completions. ``render``:
    a prompt's ids and conversation as the generators render them
    (`workers.hooks.render_group_prompt`); default `render_prompt`'s. ``runner``: the
    reward process of ``rewards`` to call them in (the evaluator keeps one); None: one
    started for this call (``timeout_s`` per reward call) and closed after. Rewards
    never run in this process: a hang would freeze its event loop. ``RewardError``
    when a reward call failed."""
    if runner is None:
        own = RewardRunner(rewards, timeout_s)
        try:
            return await evaluate(engine, tokenizer, prompts, max_new_tokens, rewards,
                                  pass_threshold=pass_threshold, num_samples=num_samples,
                                  pass_at=pass_at, sampling=sampling,
                                  system_prompt=system_prompt, rollout=rollout,
                                  render=render, runner=own)
        finally:
            await own.close()
    rendered = [render(p["text"]) if render else
                (render_prompt(tokenizer, p["text"], system_prompt), None) for p in prompts]
    ids, convs = [r[0] for r in rendered], [r[1] for r in rendered]
    greedy = [g[0] for g in await rollouts_of(
        engine, tokenizer, prompts, ids, 1, SamplingParams(max_new_tokens, greedy=True),
        rollout, convs)]
    scores = await reward_values(runner, tokenizer, prompts, greedy)
    sampled: list[list[list[float | None]]] = []
    if num_samples > 0:
        params = sampling or SamplingParams(max_new_tokens)
        groups = await rollouts_of(engine, tokenizer, prompts, ids, num_samples, params,
                                   rollout, convs)
        flat = await reward_values(runner, tokenizer,
                                   [p for p in prompts for _ in range(num_samples)],
                                   [c for g in groups for c in g])
        sampled = [flat[i * num_samples:(i + 1) * num_samples] for i in range(len(prompts))]
    return summarize_scores([r.name for r in rewards], [r.weight for r in rewards], scores,
                            pass_threshold, sampled, pass_at)


def eval_vllm_engine(cfg: Config) -> Engine:
    """A `VLLMEngine` over the evaluator's own servers (``eval.vllm_urls``)."""
    from workers.engines.vllm import VLLMEngine

    return VLLMEngine.from_config(cfg, seed=cfg.run.seed, evaluator=True)


class Evaluator:
    def __init__(self, cfg: Config, every_s: float):
        self.cfg = cfg
        self.every_s = every_s
        self.wid = worker_id("evaluator")
        self.metrics = start_metrics(cfg.metrics, "evaluator", self.wid)  # before the model
        self.engine: Engine
        if cfg.eval_engine == "vllm":
            self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.revision)
            self.engine = eval_vllm_engine(cfg)
        else:
            model, self.tokenizer = load_policy(
                cfg, device=resolve_device(cfg.generation.device, "generation.device"))
            self.engine = TransformersEngine(model, self.tokenizer, seed=cfg.run.seed,
                                             frozen_prefixes=cfg.model.frozen_prefixes)
        self.prompts = task_from_config(cfg, self.tokenizer).heldout(cfg.task.heldout)
        self.weights = make_transport(cfg)  # engine side: receive (verify) versions
        self.rewards = load_rewards(cfg, "eval.rewards")
        # one reward process for the evaluator's life, killed and replaced on a hang
        self.runner = RewardRunner(self.rewards, cfg.scoring.reward_timeout_s)
        self.reward_errors = 0  # evaluations skipped: a reward call failed
        self.rollout = load_rollout(cfg, self.tokenizer)  # as the generators make them
        self.sampling = SamplingParams.of(cfg.generation, top_logprobs=False)
        cfg.output_path.mkdir(parents=True, exist_ok=True)  # started alone, before any role
        self.path = cfg.output_path / "eval.jsonl"
        self.t0 = time.time()
        self.last: dict[str, Any] = {}
        self.tracker = Tracker()  # run.report_to, opened by `run`

    async def run_once(self, version: int, step: int) -> None:
        """Evaluate the loaded ``version``: a line in eval.jsonl, the tracker, metrics. A
        reward call that fails (raises, times out: its process killed and replaced)
        skips this evaluation, counted in ``reward_errors``; the evaluator goes on."""
        e = self.cfg.eval
        try:
            res = await evaluate(self.engine, self.tokenizer, self.prompts,
                                 self.cfg.generation.max_new_tokens, self.rewards,
                                 pass_threshold=e.pass_threshold, num_samples=e.num_samples,
                                 pass_at=e.pass_at, sampling=self.sampling,
                                 system_prompt=self.cfg.task.system_prompt,
                                 rollout=self.rollout, runner=self.runner,
                                 render=lambda text: render_group_prompt(self.cfg,
                                                                         self.tokenizer, text))
        except RewardError as err:
            self.reward_errors += 1
            log.warning("eval v%d skipped: %s", version, err)
            return
        now = time.time()
        self.last = {"version": version, "step": step, "t": now - self.t0, "ts": now,
                     "n": len(self.prompts), **res}
        with open(self.path, "a") as f:
            f.write(json.dumps(self.last) + "\n")
        self.tracker.log(eval_metrics(self.last), step=step)  # the trainer step; never raises
        self.metrics.evaluated(res)
        log.info("eval v%d: %s", version,
                 "  ".join(f"{k} {v:.3f}" for k, v in res.items()))

    async def load(self, msg: WeightsPublished) -> bool:
        """Swap in an announced version (verified; the engine is idle, so it applies now).
        False, keeping the current weights, when it cannot be loaded. Verifying and
        reading run in worker threads, so the heartbeat goes on during a big load."""
        t0 = time.perf_counter()
        try:
            path = await self.weights.receive(msg)
            ok = await self.engine.load_weights(path, msg.version, engine_format(msg))
        except (WeightError, OSError, ValueError) as e:
            log.warning("cannot evaluate v%d: %s", msg.version, e)
            return False
        if ok:
            self.metrics.observe("perf_weight_apply_seconds", time.perf_counter() - t0)
        return ok

    async def run(self, stop: asyncio.Event) -> None:
        await self.engine.start()
        log.info("evaluator on engine %s: %d held-out prompts, rewards %s",
                 self.cfg.eval_engine, len(self.prompts), [r.name for r in self.rewards])
        bus = connect(self.cfg)
        hb = Heartbeat(bus, self.wid, self.cfg.bus.heartbeat_s,
                       lambda: {"version": self.engine.version, "last": self.last,
                                "reward_errors": self.reward_errors,
                                "reward_restarts": self.runner.restarts}, self.metrics)
        hb.start()
        try:
            resumed = self.path.exists() and self.path.stat().st_size > 0
            self.tracker = await asyncio.to_thread(open_tracker, self.cfg, "evaluator",
                                                   self.path.exists())
            if not resumed:  # the initial weights, before any training (once per run: a
                await self.run_once(0, 0)  # restarted evaluator goes on from the newest)
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
            await self.engine.close()
            await self.weights.close()  # its rebuilt deltas, if any
            await self.runner.close()
            await asyncio.to_thread(self.tracker.finish)


def preflight(cfg: Config, task: Task | None, policy_tokenizer: Callable[[], Any], *,
              alone: bool) -> None:
    """What the evaluator loads first, checked before any role starts: its tracker
    (``run.report_to``) and ``eval.rewards`` when set (each called once, as the scorer's
    are). ``alone`` (`sluice eval`, not under `sluice up`, whose generator checks cover
    the rest): also ``generation.device``, ``eval.vllm_urls`` on the vLLM engine (the
    generators' servers would be swapped to the evaluated version), the task, the
    rollout hooks and the weight store it reads (`pipeline.weights.check_store`). Each
    failure is a ``ConfigError`` / ``ValueError`` naming the key."""
    if alone:
        device = resolve_device(cfg.generation.device, "generation.device")
        if cfg.eval_engine == "transformers":
            check_attention(attention_for(cfg, device), device.type,
                            device_key="generation.device")
    check_report_to(cfg)
    if alone:
        if cfg.eval_engine == "vllm" and not cfg.eval.vllm_urls:
            raise ConfigError("eval.vllm_urls: `sluice eval` on vLLM needs servers of its "
                              "own (the generators' would be swapped to the evaluated "
                              "version)")
        task = task_from_config(cfg, policy_tokenizer())
        load_rollout(cfg)
        load_filter(cfg)
        check_store(cfg, write=False)
    if cfg.eval.rewards is not None:
        check_rewards(cfg, task, "eval.rewards")


async def main(cfg: Config, stop: asyncio.Event, name: str | None = None,
               every_s: float | None = None) -> None:
    """The evaluator role (``name`` is accepted as every role's is; there is one
    evaluator per run, `pipeline.bus.client.worker_id`'s default)."""
    set_threads(1)
    await Evaluator(cfg, cfg.eval.every_s if every_s is None else every_s).run(stop)
