"""The evaluator's scoring (workers.evaluator.evaluate) on a real tiny model and engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pipeline.model import init_tiny_model, load_model
from workers.engines.base import SamplingParams
from workers.engines.transformers import TransformersEngine
from workers.evaluator import evaluate
from workers.tasks.catalog import make_task
from workers.tasks.rewards import load_reward


def always_one(prompts: list[Any], completions: list[str], completion_ids: list[Any],
               **fields: Any) -> list[float | None]:
    return [1.0] * len(completions)


@pytest.fixture(scope="module")
def engine_and_tok(tmp_path_factory: pytest.TempPathFactory) -> tuple[TransformersEngine, Any]:
    model_dir = init_tiny_model(tmp_path_factory.mktemp("m") / "model", seed=0)
    model, tok = load_model(model_dir)
    return TransformersEngine(model, tok, seed=0), tok


def test_evaluate_reports_rewards_greedy_pass_and_sampled_pass_at_k(
        engine_and_tok: tuple[TransformersEngine, Any]) -> None:
    engine, tok = engine_and_tok
    prompts = make_task("copy", seed=0, num_prompts=16).heldout(12)
    rewards = [load_reward("workers.tasks.rewards:copy_reward"),
               load_reward("workers.tasks.rewards:exact_match", 0.0)]
    row = asyncio.run(evaluate(engine, tok, prompts, 8, rewards, num_samples=4,
                               pass_at=[1, 4, 8], sampling=SamplingParams(8)))
    assert set(row) == {"reward", "pass@1", "rewards/copy_reward", "rewards/exact_match",
                        "sampled_pass@1", "sampled_pass@4"}
    # with copy_reward (1.0 iff the answer, then stop) pass@1 is greedy exact match
    assert row["pass@1"] == row["rewards/exact_match"]
    assert row["reward"] == pytest.approx(row["rewards/copy_reward"])  # exact_match weighs 0
    assert 0.0 < row["reward"] < 0.5  # an untrained model: some characters, few answers
    assert 0.0 <= row["sampled_pass@1"] <= row["sampled_pass@4"] <= 1.0


def test_pass_follows_the_threshold_and_the_eval_rewards(
        engine_and_tok: tuple[TransformersEngine, Any]) -> None:
    engine, tok = engine_and_tok
    prompts = make_task("reverse", seed=0, num_prompts=16).heldout(6)
    one = [load_reward("tests.unit.test_evaluator:always_one", 2.0)]
    row = asyncio.run(evaluate(engine, tok, prompts, 4, one, num_samples=2, pass_at=[2]))
    assert row == {"reward": 2.0, "pass@1": 1.0, "rewards/always_one": 1.0,
                   "sampled_pass@2": 1.0}
    row = asyncio.run(evaluate(engine, tok, prompts, 4, one, pass_threshold=2.5))
    assert row["pass@1"] == 0.0 and "sampled_pass@2" not in row


def test_stop_at_must_name_a_metric_the_evaluator_reports(tmp_path: Path) -> None:
    from pipeline.config import ConfigError, load_config

    cfg = load_config(None, ["up.stop_at=sampled_pass@8>=0.5", "eval.num_samples=8"])
    assert cfg.up.stop_at == "sampled_pass@8>=0.5"
    with pytest.raises(ConfigError, match=r"does not report 'sampled_pass@8'.*pass@1"):
        load_config(None, ["up.stop_at=sampled_pass@8>=0.5"])  # no samples taken
    with pytest.raises(ConfigError, match=r"does not report 'rewards/exact_match'"):
        load_config(None, ["up.stop_at=rewards/exact_match>=0.5"])
