"""The trainer and the weights it publishes (`[trainer]`, `[weights]`): the trainer
reads both; generators and the evaluator read `weights` to load each published version."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import DEVICE_PATTERN, _Section


class TrainerConfig(_Section):
    groups_per_step: int = Field(8, ge=1)
    """Groups (prompts) per optimizer step (after zero-variance groups are filtered, with
    scoring.zero_variance = filter)."""
    max_staleness: int = Field(1, ge=0)
    """Samples with version_now - min(token version) above this are dropped (retired
    `stale`). Also sizes the admission window: (max_staleness + 1) * groups_per_step."""
    admission_window: int = Field(0, ge=0)
    """Groups in flight allowed by the gate; 0 = (max_staleness + 1) * groups_per_step."""
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate (constant)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient norm clip."""
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo", "cispo"] = "dapo"
    """Normalisation of the GRPO loss, as TRL's loss_type (see pipeline/rl/losses.py); `cispo`
    is CISPO (MiniMax-M1): the ratio, capped at epsilon_high and detached, weights
    A·log π for every token; dapo's normaliser."""
    epsilon: float = Field(0.2, gt=0, lt=1)
    """Lower clip range of the surrogate ratio."""
    epsilon_high: float | None = Field(None, gt=0)
    """Upper clip range (DAPO's clip-higher); None = epsilon. With loss_type `cispo`:
    the absolute cap ε_max of the ratio (TRL's convention), required, > 1."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """`sequence`: GSPO (Zheng et al. 2025) — one ratio per sequence, the geometric mean
    of its token ratios, clipped as a whole (TRL's importance_sampling_level)."""
    decoupled_ppo: bool = True
    """AReaL's decoupled PPO (Fu et al. 2025): the ratio is clipped against the proximal
    policy (the trainer's weights at the step's start) and `is_mode` weights it to the
    behaviour policy. False: the ratio is taken against the behaviour (sampling) policy
    itself and no separate weight is applied (the clip then bounds the move from the
    sampler)."""
    geo_mask: tuple[float, float] | None = None
    """verl's rollout correction (rollout_rs = geometric): drop a sequence whose
    geometric-mean ratio exp(mean(log π_old - log π_behaviour)) is outside [lo, hi],
    e.g. [0.5, 2.0]. None = off."""
    is_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"
    ] = "token_truncate"
    """Importance-sampling correction between trainer and behaviour logprobs.
    `token_mask` with is_clip_min/is_clip_max = 0.5/5 is IcePop (Ling Team 2025)."""
    is_clip_min: float = Field(0.0, ge=0)
    """Lower bound of the IS ratio: *_mask modes zero ratios below it, *_truncate modes
    raise them to it (TRL's vllm_importance_sampling_clip_min; 0 = none)."""
    is_clip_max: float = Field(3.0, gt=0)
    """Truncation (or upper mask bound) of the IS ratio."""
    score_centering: bool | None = None
    """Subtract the sampler-expected score at every trained token (TRL's score_centering,
    pipeline/rl/centering.py): with truncated or masked importance weights, or none, the
    gradient otherwise pulls the policy toward the sampler whatever the reward. Estimated
    from the sampler's top logprobs. None (default) = on wherever the sampler reports
    them (generation.num_sampler_logprobs >= 1) and the loss is token-level, as TRL has
    it on by default; true = required (a config without top logprobs or with a
    sequence-level loss is refused); false = off."""
    temperature: float | None = Field(None, gt=0)
    """Temperature of the policy being trained; None = generation.temperature (TRL's
    convention). A lower value than generation's samples from a hotter behaviour policy
    (exploration) and lets the IS correction account for the difference."""
    beta: float = Field(0.0, ge=0)
    """KL coefficient to the frozen initial model (k3 estimator); 0 = no reference."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus (TRL's entropy_coef): the loss subtracts this times the mean
    per-token entropy of the policy over the step's trained tokens, whatever loss_type
    (pipeline/rl/entropy_control.py). With adaptive_entropy, the initial coefficient.
    With the bonus on, rows at advantage 0 are forwarded too (they carry entropy)."""
    adaptive_entropy: bool = False
    """Skywork-OR1's adaptive entropy control (TRL's use_adaptive_entropy): after each
    step the coefficient moves up by entropy_coef_delta when the step's entropy was at or
    below entropy_target and down otherwise, within [entropy_coef_min, entropy_coef_max];
    it is applied only while the entropy is at or below the target."""
    entropy_target: float = Field(0.2, ge=0)
    """Target mean per-token entropy (nats) of adaptive_entropy (TRL's entropy_target)."""
    entropy_coef_delta: float = Field(0.005, gt=0)
    """Step of the adaptive coefficient per optimizer step (TRL's entropy_coef_delta)."""
    entropy_coef_min: float = Field(0.0, ge=0)
    """Lower bound of the adaptive coefficient (TRL's entropy_coef_min)."""
    entropy_coef_max: float = Field(1.0, ge=0)
    """Upper bound of the adaptive coefficient (TRL's entropy_coef_max)."""
    kl_bias_correction: bool = True
    """Multiply the KL term by the policy ratio (TRL's use_bias_correction_kl): the
    unbiased reverse-KL gradient. Only matters when beta > 0."""
    num_iterations: int = Field(1, ge=1, le=64)
    """Optimizer passes over each batch (TRL's num_iterations, μ); old logprobs are
    computed once per batch, before the first pass."""
    weight_sync_steps: int = Field(1, ge=1)
    """Publish and announce weights every this many optimizer steps."""
    save_steps: int = Field(50, ge=1)
    """Checkpoint (weights, optimizer, step, version) every this many steps."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk (oldest pruned)."""
    max_steps: int = Field(200, ge=1)
    """The trainer ends the run (RunFinished) after this many optimizer steps."""
    threads: int = Field(1, ge=1)
    """torch threads of the trainer process."""
    peak_tflops: float | None = Field(None, gt=0)
    """The training device's dense peak TFLOP/s at model.dtype, for perf/mfu_* (MFU);
    None = trainer/perf.py's table for known GPUs, none on the CPU (no MFU reported)."""
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    """`auto` (CUDA if available, else CPU), `cpu`, `cuda` or `cuda:N`. Under torchrun
    `auto`/`cuda` take ``cuda:LOCAL_RANK``; `cuda:N` is refused with several ranks (every
    rank would run on GPU N). Asking for CUDA without it fails at start."""
    fp32_master: bool = True
    """Keep float32 parameters and AdamW state and compute in ``model.dtype`` under
    autocast (mixed precision). False: parameters and optimizer state in model.dtype."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, ~30% slower)."""
    micro_batch_tokens: int = Field(0, ge=0)
    """Token budget of one forward/backward (prompt + completion tokens, counted as
    forwarded: padded or packed); a step's samples are split into micro-batches under it
    and gradients accumulate. The loss normaliser stays that of the whole step. 0 = the
    whole step in one micro-batch. A sample longer than the budget forms its own."""
    packing: bool = False
    """Pack a micro-batch's samples into rows without padding (position ids restart per
    sample; attention stays within each sample: SDPA block mask on CPU, varlen
    flash-attention on CUDA when the model runs with a flash kernel)."""
    prefix_sharing: bool | Literal["prompt", "trie"] = False
    """With packing and an attention that takes a mask (sdpa, eager), forward shared
    prefixes once under a dense tree mask. `true` or `prompt`: a group's prompt once for
    all its completions, a whole group per row (attention grows with the group's length
    squared: measured 0.94x padded, packed 1.82x, on a small model with 32-128-token
    prompts). `trie`: a token trie over the micro-batch's samples, every shared prefix
    once (a group's prompt, multi-turn episodes' common earlier turns, a system prompt
    common to all groups), in rows no longer than the longest sample, as packing's; never
    more rows than packing. Worth it where samples share long prefixes (multi-turn,
    benchmarks/packing.py --multi-turn). Varlen (flash) attentions take no tree mask and
    get packing, with a log line."""
    logprob_chunk_tokens: int = Field(256, ge=1)
    """Completion tokens whose vocabulary logits are materialised at once (the LM head is
    applied to hidden states of completion positions only, in chunks of this many, each
    recomputed in backward): peak logit memory is O(chunk * vocab)."""
    fp32_lm_head: bool = True
    """Apply the LM head in float32 under bf16/fp16 autocast, so the trainer's logprobs
    are not rounded to bf16 (±0.06 at logits near 30); vLLM's sampler still computes its
    logprobs from bf16 logits unless its head runs in float32 too (docs/gpu.md). Costs a
    float32 matmul per chunk (TF32 on CUDA); no effect in float32."""
    lr_scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine"] = "constant"
    """Learning-rate schedule (transformers.get_scheduler) over ``max_steps``."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps of the learning-rate schedule."""

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if self.is_clip_min > self.is_clip_max:
            raise ValueError("is_clip_min must be <= is_clip_max")
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError("entropy_coef_min must be <= entropy_coef_max")
        if self.warmup_steps > self.max_steps:
            raise ValueError("warmup_steps must be <= max_steps")
        if self.loss_type == "cispo" and not (self.epsilon_high and self.epsilon_high > 1):
            raise ValueError("loss_type = cispo needs epsilon_high > 1 (the ratio cap ε_max)")
        if self.geo_mask is not None and not 0 <= self.geo_mask[0] <= 1 <= self.geo_mask[1]:
            raise ValueError("geo_mask needs [lo, hi] with 0 <= lo <= 1 <= hi")
        if self.score_centering is True and not self.centering_allowed:
            raise ValueError("score_centering needs token-level importance weights: "
                             "importance_sampling_level = token, a token is_mode "
                             "(token_truncate, token_mask or none), decoupled_ppo = true "
                             "and a loss_type other than cispo")
        return self

    @property
    def centering_allowed(self) -> bool:
        """The loss admits score centering: token-level importance weights."""
        return (self.importance_sampling_level == "token" and self.decoupled_ppo
                and not self.is_mode.startswith("sequence") and self.loss_type != "cispo")

    @property
    def window(self) -> int:
        return self.admission_window or (self.max_staleness + 1) * self.groups_per_step


class WeightsConfig(_Section):
    store: str = ""
    """Where the trainer publishes weight versions and generators and the evaluator read
    them (docs/weights-store.md): empty = ``<output_dir>/weights``; a directory (a shared
    filesystem, NFS or Lustre, when roles run on several machines); or
    ``s3://bucket/prefix`` on an S3-compatible object store, whose credentials come from the
    standard AWS environment variables or credentials file, never from this file."""
    endpoint_url: str = Field("", pattern=r"^$|^https?://[^\s@]+$")
    """s3:// stores: the S3 endpoint, e.g. ``http://10.0.0.5:8333`` for SeaweedFS or MinIO
    (no user or password in it); empty = AWS (or the ``AWS_ENDPOINT_URL`` environment
    variable)."""
    cache_dir: str = ""
    """Local directory where generators and the evaluator keep versions downloaded from an
    s3:// store and versions rebuilt from deltas (each verified there before loading);
    empty = ``<output_dir>/weights-cache``."""
    full_every: int = Field(1, ge=1, le=100_000)
    """1 = every version is full weights. K > 1: a full version every K versions and
    between them deltas (only the elements that changed since the previous version, in
    model.dtype), which engines apply to the version they hold, checked by the full
    state's sha256. Full-weight runs only (a LoRA adapter is published whole)."""

    @field_validator("store")
    @classmethod
    def _check_store(cls, v: str) -> str:
        scheme = v.split("://", 1)[0] if "://" in v else ""
        if scheme and scheme != "s3":
            raise ValueError(f"a directory or s3://bucket/prefix, not a {scheme}:// URL")
        if scheme == "s3" and not v[len("s3://"):].split("/", 1)[0]:
            raise ValueError("s3:// needs a bucket: s3://bucket/prefix")
        return v
