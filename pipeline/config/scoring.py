"""How rollouts are rewarded (`[scoring]` and its reward functions): read by the
scorers; the evaluator falls back to `scoring.rewards` when `eval.rewards` is unset."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.config.base import DEVICE_PATTERN, OPTIONAL_IMPORT_PATH, _Section


class RewardSpec(_Section):
    fn: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """Import path ``package.module:function``."""
    weight: float = 1.0
    """Weight in the summed reward; 0 records the function's value without using it."""


class ScoringConfig(_Section):
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(fn="workers.tasks.rewards:copy_reward")]
    )
    """Reward functions (called by keyword as TRL does: prompts, completions,
    completion_ids, every column) and weights; the total is the weighted sum. Empty only
    with a `teacher` (pure distillation: every reward 0, advantages from the teacher)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """How advantages are scaled (TRL's scale_rewards); `batch` is per scorer read."""
    zero_variance: Literal["train", "filter"] = "train"
    """A group whose rewards are all equal (advantage 0 everywhere): `train` hands it on
    and it counts in its step at advantage 0, as in TRL (its tokens and rows are in the
    normaliser; at beta 0 it is not forwarded, having no gradient); `filter` retires it
    `filtered` and the trainer fills its step with other groups (fewer, slower steps
    once most groups saturate; docs/compared-with-trl.md)."""
    std_ddof: int = Field(1, ge=0, le=1)
    """Delta degrees of freedom of the reward std: 1 = unbiased (TRL), 0 = population."""
    std_eps: float = Field(1e-4, ge=0)
    """Added to the std before dividing (TRL: 1e-4)."""
    reward_timeout_s: float = Field(30.0, gt=0)
    """Per call of a reward function; one call covers every completion of one scorer read
    (on failure, one call per group), and one probes it at start. The scorer, the
    evaluator and the start-up probe run rewards in a child process, killed (and
    replaced) when a call outlives this."""
    read_count: int = Field(8, ge=1)
    """Groups a scorer reads per XREADGROUP."""
    advantages: str = Field("", pattern=OPTIONAL_IMPORT_PATH)
    """Hook `package.module:function` replacing group advantages: called per group as
    `f(rewards=[...], completion_ids=[...], mask=[...], **columns)`, it returns one
    advantage per rollout, or per token (a list per rollout). Empty: GRPO's
    (`scale_rewards`); `pipeline.rl.advantages:rloo` is RLOO."""
    teacher: str = ""
    """On-policy distillation: a teacher model (hub id or folder, same tokenizer
    vocabulary as the policy). Each sampled token's advantage becomes the group's reward
    advantage + `teacher_coef` x (teacher - behaviour logprob), per token (the teacher at
    temperature 1; docs/distillation.md). Empty: off."""
    teacher_urls: list[str] = Field(default_factory=list)
    """vLLM servers serving `teacher` (prompt logprobs; requests time out after
    generation.vllm.request_timeout_s); empty: each scorer runs the teacher itself."""
    teacher_device: str = Field("cpu", pattern=DEVICE_PATTERN)
    """Device of the in-process teacher (`auto`, `cpu`, `cuda`, `cuda:N`); it loads in
    `model.dtype`."""
    teacher_coef: float = Field(1.0, gt=0)
    """Weight of the teacher's per-token term in the advantage."""

    @model_validator(mode="after")
    def _check_rewards(self) -> ScoringConfig:
        if not self.rewards and not self.teacher:
            raise ValueError("scoring.rewards: empty, and there is no scoring.teacher: "
                             "nothing would give a completion an advantage")
        return self
