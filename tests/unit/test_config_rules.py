"""pipeline.config.root: the cross-section rules, one function each, checked in order
after the environment's reward default is filled."""

from __future__ import annotations

import re

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.config.root import CROSS_SECTION_RULES, ENVIRONMENT_REWARD

ENV = "environment.name='a.b:C'"

BROKEN = [  # (overrides, the start of the message: the dotted key to change)
    (["generation.engine=vllm"], "generation.vllm.urls: the vllm engine needs server URLs"),
    ([ENV, "generation.rollout='a.b:r'"], "generation.rollout: a rollout hook produces"),
    (["trainer.micro_batch_tokens=8"],
     "trainer.micro_batch_tokens: 8 cannot hold one prompt and a 8-token rollout"),
    ([ENV, "trainer.micro_batch_tokens=200"],
     "trainer.micro_batch_tokens: 200 cannot hold one prompt and a 256-token rollout"),
    (["eval.engine='vllm'"], "eval.vllm_urls: the evaluator's vllm engine needs servers"),
    (["bus.partitions=17"],
     "bus.partitions: 17 lanes cannot share an admission window of 16 groups"),
    (["up.stop_at='foo>=0.9'"],
     "up.stop_at: the evaluator does not report 'foo'; it reports reward, pass@1, "
     "rewards/copy_reward"),
    (["weights.full_every=2", "model.lora={sync='merged'}"],
     "weights.full_every: deltas are for full"),
    (["generation.vllm.weight_transfer='nccl'", "model.lora={sync='adapter'}"],
     "generation.vllm.weight_transfer: nccl carries full weights, and model.lora.sync"),
    (["generation.vllm.api_server_count=2", "model.lora={sync='adapter'}"],
     "generation.vllm.api_server_count: vLLM loads LoRA adapters at run time only"),
    (["trainer.device='cuda:1'", "up.trainer_ranks=2"],
     "trainer.device: 'cuda:1' names one GPU, but up.trainer_ranks = 2 ranks"),
]


@pytest.mark.parametrize(("overrides", "message"), BROKEN, ids=[m.split(":")[0] for _, m in BROKEN])
def test_each_rule_fails_naming_its_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_there_are_fourteen_rules_each_a_function_of_the_config() -> None:
    assert len(CROSS_SECTION_RULES) == 14
    cfg = load_config(None)
    assert all(rule(cfg) is None for rule in CROSS_SECTION_RULES)


def test_the_first_broken_rule_is_the_error() -> None:
    with pytest.raises(ConfigError, match=r"generation\.vllm\.urls") as e:
        load_config(None, ["generation.engine=vllm", ENV, "generation.rollout='a.b:r'"])
    assert "generation.rollout" not in str(e.value)


def test_an_environment_gets_its_own_reward_before_the_rules_check() -> None:
    cfg = load_config(None, [ENV, "up.stop_at='rewards/env_reward>=0.5'"])
    assert [r.fn for r in cfg.scoring.rewards] == [ENVIRONMENT_REWARD]
    with pytest.raises(ConfigError, match=r"it reports reward, pass@1, rewards/env_reward"):
        load_config(None, [ENV, "up.stop_at='rewards/copy_reward>=0.5'"])


def test_rewards_a_run_names_are_kept_with_an_environment() -> None:
    cfg = load_config(None, [ENV, "scoring.rewards=[{fn='a.b:c'}]"])
    assert [r.fn for r in cfg.scoring.rewards] == ["a.b:c"]


def test_without_an_environment_the_rewards_are_the_default() -> None:
    assert [r.fn for r in load_config(None).scoring.rewards] == [
        "workers.tasks.rewards:copy_reward"]


def test_several_front_ends_are_fine_with_merged_lora_sync() -> None:
    cfg = load_config(None, ["generation.vllm.api_server_count=8",
                             "model.lora={sync='merged'}"])
    assert cfg.generation.vllm.api_server_count == 8
