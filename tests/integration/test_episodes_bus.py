"""Multi-turn rollouts through the real bus: a generator runs episodes against an
environment (or a user's rollout hook) and appends them; a scorer rewards them from the
environment; a failing environment retires only its group `dead` with the reason;
``generation.filter_prompt`` and ``scoring.advantages`` hooks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.bus.client import Bus
from pipeline.bus.codec import decode_entry
from pipeline.bus.keys import SCORERS_GROUP
from pipeline.bus.schema import RolloutGroup, ScoredGroup
from pipeline.config import ConfigError, load_config
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from workers.environments import Action, StepResult
from workers.episodes import Episode, RolloutContext
from workers.generator import Generator
from workers.scorer import Scorer
from workers.tasks.catalog import prompt_for_cursor

pytestmark = pytest.mark.integration
HERE = "tests.integration.test_episodes_bus"


class TwoTurns:
    """Answers the model's first turn with ``obs`` (text) and ends after the second with
    reward parts ``{"a": 1.0}`` per step; misbehaves on the prompts in ``fail``:
    ``raise`` in reset, or returns an int observation (``bad_obs``)."""

    def __init__(self, obs: str = "+-", fail: dict[str, str] | None = None) -> None:
        self.obs, self.fail, self.mode = obs, fail or {}, ""

    async def reset(self, prompt: dict[str, Any]) -> None:
        self.mode = self.fail.get(prompt["text"], "")
        if self.mode == "raise":
            raise RuntimeError("boom")

    async def step(self, action: Action) -> StepResult:
        if action.turn == 0:
            return StepResult(17 if self.mode == "bad_obs" else self.obs, {"a": 1.0})
        return StepResult(None, {"a": 1.0, "b": 0.5}, True)


def keep_even(prompt: dict[str, Any]) -> bool:
    return int(prompt["text"][0]) % 2 == 0


async def two_segments(prompt: dict[str, Any], ctx: RolloutContext) -> list[Episode]:
    """A user's rollout: a turn, fixed context ids, a second turn of at most 2 tokens."""
    out = []
    for _ in range(ctx.n):
        b = ctx.episode()
        b.add_model(await ctx.generate(ctx.prompt_ids))
        b.add_context([5, 6, 7])
        b.add_model(await ctx.generate(ctx.prompt_ids + b.token_ids, max_new_tokens=2))
        out.append(b.finish("stop"))
    return out


def per_token(*, rewards: list[float], mask: list[list[int]], **kw: Any) -> list[list[float]]:
    return [[r * m for m in row] for r, row in zip(rewards, mask, strict=True)]


def _cfg(redis: EmbeddedRedis, run: str, model: Path, out: Path, *sets: str) -> Any:
    return load_config(None, [f"run.name={run}", f"run.output_dir={out}",
                              f"bus.redis_url={redis.url}", f"model.path={model}",
                              "model.init=''", "generation.num_generations=3",
                              "generation.max_new_tokens=4", *sets])


def _run_generator(cfg: Any, n: int) -> tuple[Generator, dict[str, int], list[Any], list[Any]]:
    gen = Generator(cfg, "g0")

    async def go() -> tuple[dict[str, int], list[Any], list[Any]]:
        bus = Bus.connect(cfg.redis_url, cfg.run.name)
        try:
            cursors = [await bus.admit(16, gen.wid) for _ in range(n)]
            await gen.generate_batch(bus, [c for c in cursors if c is not None])
            rollouts = [decode_entry(f) for _i, f in await bus.r.xrange(bus.keys.rollouts)]
            return await bus.state(), rollouts, await bus.r.xrange(bus.keys.dlq)
        finally:
            await bus.close()

    return gen, *arun(go())


def _score(cfg: Any) -> list[ScoredGroup]:
    """One scorer read of everything on ``rollouts``, handed on; the `scored` entries."""
    scorer = Scorer(cfg, "s0")

    async def go() -> list[ScoredGroup]:
        bus = Bus.connect(cfg.redis_url, cfg.run.name)
        try:
            await bus.ensure_group(bus.keys.rollouts, SCORERS_GROUP)
            await bus.ensure_group(bus.keys.scored, "trainers")
            entries = await bus.read_lanes("rollouts", SCORERS_GROUP, "s0", count=8,
                                           block_ms=100)
            await scorer.process(bus, entries)
            return [decode_entry(f) for _i, f in await bus.r.xrange(bus.keys.scored)]
        finally:
            await bus.close()

    return arun(go())


def _texts(cfg: Any, gen: Generator, n: int) -> list[str]:
    return [gen.task.prompt(prompt_for_cursor(c, len(gen.task), cfg.run.seed)[1])["text"]
            for c in range(n)]


def test_episodes_reach_the_stream_and_a_failing_environment_kills_only_its_group(
        redis_server: EmbeddedRedis, run_name: str, tiny_model_dir: Path,
        tmp_path: Path) -> None:
    probe = _cfg(redis_server, run_name, tiny_model_dir, tmp_path)
    texts = _texts(probe, Generator(probe, "probe"), 4)
    fail = {texts[1]: "raise", texts[2]: "bad_obs"}
    cfg = _cfg(redis_server, run_name, tiny_model_dir, tmp_path,
               f"environment.name={HERE}:TwoTurns",
               "environment.kwargs={obs='+-', fail={" + ", ".join(
                   f"'{k}' = '{v}'" for k, v in fail.items()) + "}}")
    gen, state, groups, dlq = _run_generator(cfg, 4)
    assert state["cursor"] == 4 and state["generating"] == 0 and state["retired:dead"] == 2
    reasons = sorted(f[b"reason"].decode() for _i, f in dlq)
    assert "reset raised RuntimeError('boom')" in reasons[0] or \
        "reset raised RuntimeError('boom')" in reasons[1], reasons
    assert any("returned a int" in r and "observation must be text" in r for r in reasons)
    assert len(groups) == 2 and gen.info()["dead_groups"] == 2
    tok = gen.tokenizer
    for g in groups:
        assert isinstance(g, RolloutGroup) and g.prompt["text"] in (texts[0], texts[3])
        for r in g.rollouts:
            inserted = r.completion_ids[r.mask == 0]
            assert tok.decode(inserted) == "+-"  # the observation, and only it, at mask 0
            assert r.logprobs[r.mask == 0].tolist() == [0.0, 0.0]
            assert (r.logprobs[r.mask == 1] < 0).all()
            assert r.env_reward == {"a": 2.0, "b": 0.5}
            assert [m["role"] for m in r.messages] == ["assistant", "user", "assistant"]
            assert r.messages[1]["content"] == "+-"
            first = int(np.argmax(r.mask == 0))  # the model's first turn ends where it starts
            assert tok.decode(r.completion_ids[:first], skip_special_tokens=True) == \
                r.messages[0]["content"]

    # the scorer rewards them with the environment's reward (the default with an env)
    cfg.scoring.zero_variance = "train"
    scored = _score(cfg)
    assert len(scored) == 2
    for sg in scored:
        assert np.allclose(sg.rewards, 2.5) and np.allclose(sg.reward_parts["env_reward"], 2.5)
        assert not sg.advantages.any()  # equal rewards: advantage 0


def test_filter_prompt_skips_retire_filtered(redis_server: EmbeddedRedis, run_name: str,
                                             tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(redis_server, run_name, tiny_model_dir, tmp_path,
               f"generation.filter_prompt={HERE}:keep_even")
    gen, state, groups, dlq = _run_generator(cfg, 6)
    kept = [t for t in _texts(cfg, gen, 6) if int(t[0]) % 2 == 0]
    assert 0 < len(kept) < 6  # both kinds among these prompts (fixed seed)
    assert sorted(g.prompt["text"] for g in groups) == sorted(kept)
    assert state["retired:filtered"] == 6 - len(kept) == gen.info()["skipped_prompts"]
    assert state["cursor"] == 6 and state["generating"] == 0 and not dlq


def test_a_rollout_hook_builds_exact_episodes(redis_server: EmbeddedRedis, run_name: str,
                                              tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(redis_server, run_name, tiny_model_dir, tmp_path,
               f"generation.rollout={HERE}:two_segments")
    _gen, state, groups, _dlq = _run_generator(cfg, 2)
    assert len(groups) == 2 and state.get("retired", 0) == 0
    for g in groups:
        for r in g.rollouts:
            zero = np.flatnonzero(r.mask == 0)
            assert r.completion_ids[zero].tolist() == [5, 6, 7]
            assert 1 <= len(r.mask) - zero[-1] - 1 <= 2  # the second turn, cut to 2 tokens
            assert r.messages is None and r.env_reward is None


def test_a_hook_that_does_not_import_fails_at_start(tiny_model_dir: Path,
                                                    tmp_path: Path) -> None:
    for key in ("generation.rollout", "generation.filter_prompt", "environment.name"):
        cfg = load_config(None, [f"run.output_dir={tmp_path}", f"model.path={tiny_model_dir}",
                                 "model.init=''", f"{key}={HERE}:nope"])
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            Generator(cfg, "g")
    cfg = load_config(None, [f"run.output_dir={tmp_path}", f"model.path={tiny_model_dir}",
                             "model.init=''", f"environment.name={HERE}:TwoTurns",
                             "environment.kwargs={nope=1}"])
    with pytest.raises(ConfigError, match=r"environment\.kwargs.*nope"):
        Generator(cfg, "g")


@pytest.mark.parametrize("hook", ["pipeline.rl.advantages:rloo", f"{HERE}:per_token"])
def test_scoring_advantages_hook(redis_server: EmbeddedRedis, run_name: str,
                                 tiny_model_dir: Path, tmp_path: Path, hook: str) -> None:
    cfg = _cfg(redis_server, run_name, tiny_model_dir, tmp_path,
               f"scoring.advantages={hook}", "scoring.zero_variance=train")
    _gen, _state, groups, _dlq = _run_generator(cfg, 3)
    scored = _score(cfg)
    assert len(scored) == len(groups) == 3
    for sg in scored:
        r = sg.rewards.astype(np.float64)
        if hook.endswith("rloo"):
            n = len(r)
            assert np.allclose(sg.advantages, r - (r.sum() - r) / (n - 1), atol=1e-6)
            assert sg.token_advantages is None
        else:
            assert sg.token_advantages is not None
            for a, x, ro in zip(sg.token_advantages, r, sg.group.rollouts, strict=True):
                assert len(a) == len(ro.completion_ids) and np.allclose(a, x * ro.mask)
