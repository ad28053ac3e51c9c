"""The one config type: a run described by one TOML file, read by every role.

`Config` gathers the sections and the rules that join them. Each section checks its own
keys; a rule that reads two sections (the engine and its servers, the micro-batch and
the longest rollout, ``up.stop_at`` and the evaluator's metrics, ...) is a function here,
one per rule, each raising ValueError with a message that starts with the dotted key to
change (tests and users match on it). Validation fills the one cross-section default
first (an environment's own reward), then runs `CROSS_SECTION_RULES` in order: the first
broken rule is the error reported.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pipeline.config.base import _Section
from pipeline.config.generation import EnvironmentConfig, GenerationConfig
from pipeline.config.model import ModelConfig, TaskConfig
from pipeline.config.observers import ArchiveConfig, EvalConfig, MetricsConfig
from pipeline.config.operator import DeployConfig, UpConfig
from pipeline.config.run import BusConfig, RunConfig
from pipeline.config.scoring import RewardSpec, ScoringConfig
from pipeline.config.training import TrainerConfig, WeightsConfig
from pipeline.evaluation import metric_names, parse_target

ENVIRONMENT_REWARD = "workers.tasks.rewards:env_reward"
"""The reward of a run with an environment that names no reward functions of its own:
the episode's reward as the environment reports it."""


def vllm_engine_has_servers(cfg: Config) -> None:
    """The vllm engine needs servers: named ones, or launched by `sluice up`."""
    v = cfg.generation.vllm
    if cfg.generation.engine == "vllm" and not v.urls and not v.launch:
        raise ValueError("generation.vllm.urls: the vllm engine needs server URLs, or "
                         "generation.vllm.launch > 0 for `sluice up` to start servers")


def rollout_hook_excludes_environment(cfg: Config) -> None:
    """A rollout hook and an environment both produce episodes: one of them only."""
    if cfg.environment.enabled and cfg.generation.rollout:
        raise ValueError("generation.rollout: a rollout hook produces the episodes itself; "
                         "it cannot be combined with environment.name or environment.tools")


def tools_are_their_own_environment(cfg: Config) -> None:
    """``environment.tools`` runs the built-in tool-calling environment: not with another
    environment, and each call's timeout fits inside the turn's step timeout."""
    e = cfg.environment
    if e.tools and e.name:
        raise ValueError("environment.tools: the tools run as an environment of their own; "
                         "they cannot be combined with environment.name (expose them from "
                         "that environment's step instead)")
    if e.tools and e.tool_timeout_s >= e.step_timeout_s:
        raise ValueError(f"environment.tool_timeout_s: {e.tool_timeout_s:g}s must be below "
                         f"environment.step_timeout_s ({e.step_timeout_s:g}s), which bounds "
                         "all of a turn's calls together")


def rollout_loop_replaces_hooks(cfg: Config) -> None:
    """A rollout loop's filter and advantages replace the one-function hooks: one of
    them only, so no run has two filters whose order would matter."""
    if cfg.generation.rollout_loop and (cfg.generation.filter_prompt
                                        or cfg.scoring.advantages):
        raise ValueError("generation.rollout_loop: its filter_prompt and compute_advantages "
                         "replace generation.filter_prompt and scoring.advantages; set "
                         "the loop or those hooks, not both")


def micro_batch_holds_a_rollout(cfg: Config) -> None:
    """A micro-batch token budget must fit a prompt plus the longest rollout."""
    mbt, longest = cfg.trainer.micro_batch_tokens, cfg.max_rollout_tokens
    if 0 < mbt <= longest:
        raise ValueError(f"trainer.micro_batch_tokens: {mbt} cannot hold one prompt and "
                         f"a {longest}-token rollout; use 0 (one micro-batch per step) or "
                         "a budget above generation.max_new_tokens (or "
                         "environment.max_episode_tokens)")


def eval_vllm_has_own_servers(cfg: Config) -> None:
    """The evaluator swaps versions into its servers, so they cannot be the generators'."""
    if cfg.eval_engine == "vllm" and not cfg.eval.vllm_urls and not (
            cfg.generation.engine == "vllm" and cfg.generation.vllm.launch > 0):
        raise ValueError("eval.vllm_urls: the evaluator's vllm engine needs servers of its "
                         "own (or generation.vllm.launch > 0 for `sluice up` to start one)")


def partitions_fit_the_window(cfg: Config) -> None:
    """Each bus lane gets an equal share of the admission window, at least one group."""
    if cfg.bus.partitions > cfg.trainer.window:
        raise ValueError(f"bus.partitions: {cfg.bus.partitions} lanes cannot share an "
                         f"admission window of {cfg.trainer.window} groups (each lane "
                         "needs one); lower bus.partitions or raise "
                         "trainer.admission_window")


def stop_at_is_reported(cfg: Config) -> None:
    """``up.stop_at`` names a metric the evaluator reports with this run's rewards (it
    reads `eval_rewards`, so an environment's default reward must be filled first)."""
    target = parse_target(cfg.up.stop_at)
    if target is None:
        return
    e = cfg.eval
    names = [r.fn.rsplit(":", 1)[1] for r in cfg.eval_rewards]
    known = metric_names(names, e.num_samples, e.pass_at)
    if target.metric not in known:
        raise ValueError(f"up.stop_at: the evaluator does not report {target.metric!r}"
                         f"; it reports {', '.join(known)}")


def deltas_are_full_weights_only(cfg: Config) -> None:
    """Weight deltas apply to full weights; a LoRA adapter is published whole."""
    if cfg.weights.full_every > 1 and cfg.model.lora is not None:
        raise ValueError("weights.full_every: deltas are for full weights; a LoRA run "
                         "publishes its adapter whole (leave it at 1)")


def nccl_is_full_weights_only(cfg: Config) -> None:
    """The nccl push carries full weights (vLLM's weight-transfer engine updates the
    model's own tensors, not adapters): a LoRA run takes it only with ``lora.sync =
    "merged"`` (the push carries base + adapter merged); adapters go through the store."""
    if cfg.generation.vllm.weight_transfer == "nccl" and cfg.model.serving_lora is not None:
        raise ValueError('generation.vllm.weight_transfer: nccl carries full weights, and '
                         'model.lora.sync = "adapter" publishes adapters; set '
                         'model.lora.sync = "merged" (each version pushed as the merged '
                         'full weights) or weight_transfer = "file"')


def score_centering_has_top_logprobs(cfg: Config) -> None:
    """Score centering estimates the sampler's expected score from its top logprobs."""
    if cfg.trainer.score_centering is True and cfg.generation.num_sampler_logprobs < 1:
        raise ValueError("generation.num_sampler_logprobs: trainer.score_centering needs the "
                         "sampler's top logprobs; set it to k >= 1 (TRL uses 8)")


def vllm_truncation_has_sets(cfg: Config) -> None:
    """Truncated sampling on vLLM: candidate sets come from the top logprobs, or the user
    accepts the bias by name."""
    g = cfg.generation
    if g.engine != "vllm" or (g.top_k == 0 and g.top_p >= 1.0):
        return
    if (0 < g.top_k <= g.num_sampler_logprobs) or g.vllm.accept_biased_truncation:
        return
    raise ValueError(
        "generation.top_k/top_p: vLLM does not return the candidate sets the trainer "
        "renormalises over; set generation.num_sampler_logprobs >= generation.top_k "
        "(sets read off the top logprobs; needs top_k > 0), or accept biased IS ratios "
        "with generation.vllm.accept_biased_truncation = true")


def adapter_sync_has_one_front_end(cfg: Config) -> None:
    """vLLM refuses runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING) behind more
    than one API server, so adapter-only LoRA sync needs one front end per server."""
    if cfg.generation.vllm.api_server_count > 1 and cfg.model.serving_lora is not None:
        raise ValueError("generation.vllm.api_server_count: vLLM loads LoRA adapters at "
                         "run time only behind one API server; use 1, or "
                         "model.lora.sync = \"merged\" (servers then take full weights)")


def ranks_take_their_gpu_from_local_rank(cfg: Config) -> None:
    """A trainer job of several ranks gives each rank ``cuda:LOCAL_RANK``; an explicit
    ``cuda:N`` would put every rank on GPU N (FSDP2 over one device, and NCCL refuses
    two ranks of one group on one GPU), so it is refused rather than guessed at."""
    if cfg.up.trainer_ranks > 1 and cfg.trainer.device.startswith("cuda:"):
        raise ValueError(
            f"trainer.device: {cfg.trainer.device!r} names one GPU, but up.trainer_ranks = "
            f"{cfg.up.trainer_ranks} ranks would all run on it; a multi-rank job takes each "
            "rank's GPU from LOCAL_RANK: use \"cuda\" or \"auto\" (limit the GPUs with "
            "CUDA_VISIBLE_DEVICES)")


def score_centering_on(cfg: Config) -> bool:
    """Whether the trainer centres the score: asked for, or (None) wherever the sampler
    reports top logprobs and the loss is token-level."""
    t = cfg.trainer
    if t.score_centering is not None:
        return t.score_centering
    return cfg.generation.num_sampler_logprobs >= 1 and t.centering_allowed


CROSS_SECTION_RULES: tuple[Callable[[Config], None], ...] = (
    vllm_engine_has_servers,
    rollout_hook_excludes_environment,
    rollout_loop_replaces_hooks,
    tools_are_their_own_environment,
    micro_batch_holds_a_rollout,
    eval_vllm_has_own_servers,
    partitions_fit_the_window,
    stop_at_is_reported,
    deltas_are_full_weights_only,
    nccl_is_full_weights_only,
    score_centering_has_top_logprobs,
    vllm_truncation_has_sets,
    adapter_sync_has_one_front_end,
    ranks_take_their_gpu_from_local_rank,
)
"""Checked in this order after every section validated itself; the first that fails is
the error (so a config breaking two rules names the earlier one)."""


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    up: UpConfig = Field(default_factory=UpConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    archive: ArchiveConfig = Field(default_factory=ArchiveConfig)
    deploy: DeployConfig = Field(default_factory=DeployConfig)

    # pydantic runs "after" model validators in definition order: the default below is
    # filled before the rules check (stop_at_is_reported reads the rewards).
    @model_validator(mode="after")
    def _default_environment_rewards(self) -> Config:
        """An environment run that names no reward functions is scored by the
        environment's own reward (`ENVIRONMENT_REWARD`); named ones are kept."""
        if self.environment.name and "rewards" not in self.scoring.model_fields_set:
            self.scoring.rewards = [RewardSpec(fn=ENVIRONMENT_REWARD)]
        return self

    @model_validator(mode="after")
    def _check_cross_section_rules(self) -> Config:
        for rule in CROSS_SECTION_RULES:
            rule(self)
        return self

    @property
    def multi_turn(self) -> bool:
        """Rollouts are episodes (an environment, tools or a rollout hook), not one
        completion."""
        return bool(self.environment.enabled or self.generation.rollout)

    @property
    def max_rollout_tokens(self) -> int:
        """The longest rollout the trainer can see: ``generation.max_new_tokens``, or an
        episode's ``environment.max_episode_tokens`` (when longer) with multi-turn rollouts."""
        g = self.generation.max_new_tokens
        return max(g, self.environment.max_episode_tokens) if self.multi_turn else g

    @property
    def eval_engine(self) -> Literal["transformers", "vllm"]:
        """The evaluator's engine, `auto` resolved (see ``eval.engine``)."""
        if self.eval.engine != "auto":
            return self.eval.engine
        own = self.eval.vllm_urls or self.generation.vllm.launch > 0
        return "vllm" if self.generation.engine == "vllm" and own else "transformers"

    @property
    def eval_rewards(self) -> list[RewardSpec]:
        """The evaluator's reward functions: ``eval.rewards``, else ``scoring.rewards``."""
        return self.scoring.rewards if self.eval.rewards is None else self.eval.rewards

    @property
    def output_path(self) -> Path:
        return Path(self.run.output_dir).resolve()

    @property
    def embedded_socket(self) -> Path:
        return self.output_path / "redis" / "redis.sock"

    @property
    def redis_url(self) -> str:
        """The bus URL every role uses: the configured one, else the embedded socket."""
        return self.bus.redis_url or f"unix://{self.embedded_socket}"
