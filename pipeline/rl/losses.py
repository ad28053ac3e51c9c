"""GRPO-family policy loss as pure functions (tensors in, loss + metrics out).

This is TRL 1.16 ``GRPOTrainer._compute_loss`` with ``importance_sampling_level="token"``
(``tests/unit/test_vs_trl.py`` checks loss and gradients against TRL's own code to 1e-5):

* ``coef_1 = exp(logps - old)``, ``coef_2 = clamp(coef_1, 1 - eps_low, 1 + eps_high)``
  (DAPO's asymmetric clip when ``epsilon_high`` is set), and
  ``per_token = -min(coef_1 * A, coef_2 * A)``.
* That is multiplied by a truncated/masked importance weight between the policy that
  produced ``old`` and the behaviour policy that sampled the tokens (TRL's
  ``vllm_importance_sampling_correction``; here the sampler is any stale generator), then
  ``beta * k3`` KL to the frozen reference model ``ref``
  (``exp(ref - logps) - (ref - logps) - 1``) is added, not importance weighted, as in
  TRL. With ``kl_bias_correction`` (TRL's ``use_bias_correction_kl``, default True in
  both) the KL term is multiplied by ``coef_1``: value unchanged on-policy, but its
  gradient gains ``kl * grad(logps)``, which makes it the unbiased reverse-KL gradient
  (DeepSeek-V3.2).
* Normalisation by ``loss_type``: ``grpo`` = mean over rows of (row masked sum / row
  tokens); ``bnpo`` = masked sum / batch tokens; ``dr_grpo`` = masked sum /
  (B * max_completion_length); ``dapo`` (default) = masked sum / ``num_items_in_batch``
  (default: this batch's masked tokens). Token counts are clamped to at least 1.

Where it differs from TRL:

* Nothing is divided by gradient-accumulation steps or process count: the caller passes
  the whole step's normaliser as ``norm`` (`LossNorm`: trained tokens and rows over all
  micro-batches and ranks), so the sum of micro-batch losses is the full-batch loss for
  every ``loss_type`` (grpo's mean over rows divides by the step's rows; bnpo, dapo and
  dr_grpo by its tokens or rows). ``num_items_in_batch`` (dapo) overrides the token count.
* The importance weights are computed here from ``old`` vs ``behaviour`` on every call
  instead of once at generation time (same values). ``old_logps=None`` means
  ``logps.detach()`` (TRL with ``num_iterations=1``), so ``coef_1 == 1`` with gradient 1.
* ``is_clip_min`` defaults to 0 (TRL: None); both mean "no lower bound" because ratios
  are positive. Importance weights are 0 where ``mask`` is 0; a NaN behaviour logprob
  (an engine that could not report one) gives weight 1, as in TRL.
* Off-policy options (``pipeline/rl/offpolicy.py``, each named after its source there):
  ``decoupled_ppo`` = False takes the ratio against the behaviour policy (then no separate
  importance weight); ``importance_sampling_level = "sequence"`` is GSPO (TRL's name);
  ``loss_type = "cispo"`` is CISPO with ``epsilon_high`` as the absolute ratio cap ε_max
  (TRL's convention) and dapo's normaliser; ``geo_mask`` drops sequences whose
  geometric-mean ``π_old / π_behaviour`` leaves a band (verl's rollout correction).
* No ``delta`` two-sided clip, no entropy masking, no Liger kernel. Inputs at masked
  positions are replaced by 0 before any maths, so padding garbage (even inf/NaN)
  cannot leak into the loss or the gradient.

With top-k / top-p sampling the trainer's ``logps`` come from
`pipeline.rl.logprobs.candidate_log_softmax` (renormalised over each token's recorded
candidate set), so ``exp(old - behaviour)`` compares the same truncated distribution on
both sides; TRL has no equivalent and compares a truncated sampler with a
full-vocabulary trainer.

Gradient flows only through ``logps``; ``old``, ``behaviour``, ``ref`` and advantages
are detached. Maths runs in at least float32. The metrics beside the loss are computed in
`pipeline.rl.loss_metrics`; the logprobs it takes, in `pipeline.rl.logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from pipeline.rl.centering import centering_term, sampler_mass
from pipeline.rl.loss_metrics import behaviour_ratio_stats, clip_fractions, masked_mean
from pipeline.rl.offpolicy import (
    cispo_per_token,
    geometric_mean_mask,
    ratio_denominator_logps,
    sequence_log_ratio,
)

LossType = Literal["grpo", "dapo", "dr_grpo", "bnpo", "cispo"]
IsMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"]

__all__ = [
    "IsMode",
    "LossConfig",
    "LossNorm",
    "LossType",
    "grpo_loss",
    "importance_weights",
]

_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo")
_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")


@dataclass
class LossConfig:
    """Loss hyper-parameters; validated on construction."""

    loss_type: LossType = "dapo"
    epsilon: float = 0.2
    """Lower clip: ratios below ``1 - epsilon`` are clipped (for A < 0)."""
    epsilon_high: float | None = None
    """Upper clip: ratios above ``1 + epsilon_high`` are clipped (for A > 0); None = epsilon."""
    is_mode: IsMode = "token_truncate"
    is_clip_min: float = 0.0
    """Mask modes zero weights below this; truncate modes raise them to it."""
    is_clip_max: float = 3.0
    beta: float = 0.0
    """k3 KL coefficient; > 0 requires ``ref_logps``."""
    kl_bias_correction: bool = True
    """Multiply the KL term by ``coef_1`` (TRL ``use_bias_correction_kl``)."""
    max_completion_length: int | None = None
    """Required by ``dr_grpo`` (its constant normaliser)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """``sequence``: GSPO's one ratio per sequence (geometric mean of token ratios)."""
    decoupled_ppo: bool = True
    """Ratio against the proximal policy (``old``) plus the ``is_mode`` weight to the
    behaviour policy (AReaL); False: ratio against the behaviour policy, no IS weight."""
    geo_mask: tuple[float, float] | None = None
    """Drop sequences whose geometric-mean ``π_old / π_behaviour`` is outside [lo, hi]."""
    score_centering: bool = False
    """Subtract the sampler-expected score at every trained token (`pipeline.rl.centering`),
    estimated from the sampler's top logprobs when the batch carries them."""

    def __post_init__(self) -> None:
        if self.loss_type not in _LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {_LOSS_TYPES}, got {self.loss_type!r}")
        if self.is_mode not in _IS_MODES:
            raise ValueError(f"is_mode must be one of {_IS_MODES}, got {self.is_mode!r}")
        if not 0.0 <= self.epsilon < 1.0:
            raise ValueError(f"epsilon must be in [0, 1), got {self.epsilon}")
        if self.epsilon_high is not None and self.epsilon_high < 0:
            raise ValueError(f"epsilon_high must be >= 0, got {self.epsilon_high}")
        if not 0.0 <= self.is_clip_min <= self.is_clip_max:
            raise ValueError("need 0 <= is_clip_min <= is_clip_max")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length >= 1")
        if self.loss_type == "cispo" and not (self.epsilon_high and self.epsilon_high > 1.0):
            raise ValueError("loss_type='cispo' needs epsilon_high > 1: the cap ε_max of the "
                             "importance ratio (TRL's convention), e.g. 5.0")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError("importance_sampling_level must be 'token' or 'sequence', got "
                             f"{self.importance_sampling_level!r}")
        if self.score_centering and (self.importance_sampling_level != "token"
                                     or not self.decoupled_ppo or self.loss_type == "cispo"
                                     or self.is_mode.startswith("sequence")):
            raise ValueError("score_centering needs token-level importance weights: "
                             "importance_sampling_level 'token', decoupled_ppo, a token is_mode "
                             "(token_truncate, token_mask, none) and a loss_type other than cispo")
        if self.geo_mask is not None:
            lo, hi = self.geo_mask
            if not 0.0 <= lo <= 1.0 <= hi:
                raise ValueError(f"geo_mask needs 0 <= lo <= 1 <= hi, got {self.geo_mask}")

    @property
    def eps_low(self) -> float:
        return self.epsilon

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True)
class LossNorm:
    """A whole step's normaliser: trained (mask 1) tokens and rows (samples), summed over
    its micro-batches and ranks. None in `grpo_loss` means the batch's own."""

    tokens: float
    rows: int

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError(f"LossNorm.rows must be >= 1, got {self.rows}")


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _bool_mask(mask: Tensor, shape: torch.Size) -> Tensor:
    if mask.shape != shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != logps shape {tuple(shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def importance_weights(
    old_logps: Tensor,
    behaviour_logps: Tensor,
    mask: Tensor,
    mode: IsMode = "token_truncate",
    clip_min: float = 0.0,
    clip_max: float = 3.0,
) -> Tensor:
    """Behaviour-policy correction weights ``[B, T]``, without gradient.

    Token modes use ``exp(old - behaviour)`` per token; sequence modes use
    ``exp(sum over masked tokens of (old - behaviour))`` per row, broadcast to the row.
    ``*_truncate`` clamps to ``[clip_min, clip_max]``; ``*_mask`` keeps values in
    ``[clip_min, clip_max]`` (inclusive) and zeroes the rest; ``none`` is 1.
    Invariant: 0 wherever ``mask`` is 0.
    """
    if mode not in _IS_MODES:
        raise ValueError(f"mode must be one of {_IS_MODES}, got {mode!r}")
    if old_logps.shape != behaviour_logps.shape:
        raise ValueError("old_logps and behaviour_logps must have the same shape")
    m = _bool_mask(mask, old_logps.shape)
    dt = _compute_dtype(old_logps)
    with torch.no_grad():
        diff = torch.where(m, old_logps.detach().to(dt) - behaviour_logps.detach().to(dt), 0.0)
        diff = torch.nan_to_num(diff, nan=0.0)  # unknown behaviour logprob: no correction
        if mode == "none":
            w = torch.ones_like(diff)
        else:
            if mode.startswith("sequence"):
                ratio = torch.exp(diff.sum(dim=-1, keepdim=True)).expand_as(diff)
            else:
                ratio = torch.exp(diff)
            if mode.endswith("truncate"):
                w = ratio.clamp(min=clip_min, max=clip_max)
            else:
                keep = (ratio >= clip_min) & (ratio <= clip_max)
                w = torch.where(keep, ratio, 0.0)
        return torch.where(m, w, 0.0)


def _check_loss_inputs(
    logps: Tensor,
    old_logps: Tensor | None,
    behaviour_logps: Tensor,
    advantages: Tensor,
    cfg: LossConfig,
    ref_logps: Tensor | None,
    num_items_in_batch: float | None,
) -> None:
    """Raise ValueError unless `grpo_loss`'s inputs have matching shapes and the config
    has what it needs (``ref_logps`` for ``beta > 0``, a positive ``num_items_in_batch``)."""
    if logps.dim() != 2:
        raise ValueError(f"logps must be [B, T], got shape {tuple(logps.shape)}")
    shape = logps.shape
    for name, t in (
        ("old_logps", old_logps),
        ("behaviour_logps", behaviour_logps),
        ("ref_logps", ref_logps),
    ):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logps shape {tuple(shape)}")
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(f"advantages must be [B]={shape[0]} or [B, T]={tuple(shape)}, got "
                         f"{tuple(advantages.shape)}")
    if cfg.beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps")
    if num_items_in_batch is not None and num_items_in_batch <= 0:
        raise ValueError(f"num_items_in_batch must be > 0, got {num_items_in_batch}")


def _masked_detached(t: Tensor, m: Tensor, dt: torch.dtype) -> Tensor:
    """``t`` detached, cast to ``dt``, and 0 where the bool mask ``m`` is False (so padding
    values, even inf/NaN, never reach exp() or the gradient). NaN at mask-1 positions stays."""
    return torch.where(m, t.detach().to(dt), 0.0)


def _row_or_token_advantages(advantages: Tensor, m: Tensor, dt: torch.dtype) -> Tensor:
    """Detached advantages in ``dt``, shaped to broadcast against ``[B, T]``: a row
    advantage ``[B]`` becomes ``[B, 1]``; a per-token ``[B, T]`` one is 0 where ``m`` is 0."""
    adv = advantages.detach().to(dt)
    return adv.unsqueeze(1) if adv.dim() == 1 else torch.where(m, adv, 0.0)


def _policy_log_ratio(
    policy_lp: Tensor, old_lp: Tensor, behaviour_lp: Tensor, m: Tensor, cfg: LossConfig
) -> Tensor:
    """Log importance ratio (nats) of the trained policy over the ratio's denominator
    policy: the proximal policy (``old``) with ``decoupled_ppo``, else the behaviour
    policy (``old`` where its logprob is NaN). Per token ``[B, T]``; with
    ``importance_sampling_level = "sequence"`` (GSPO) the mean over each row's masked
    tokens, ``[B, 1]``. Differentiable in ``policy_lp`` only."""
    denominator_lp = ratio_denominator_logps(old_lp, behaviour_lp, cfg.decoupled_ppo)
    log_ratio = policy_lp - denominator_lp
    if cfg.importance_sampling_level == "sequence":  # GSPO: [B, 1]
        log_ratio = sequence_log_ratio(log_ratio, m)
    return log_ratio


def _surrogate_per_token(policy_lp: Tensor, ratio: Tensor, adv: Tensor, cfg: LossConfig) -> Tensor:
    """Per-token policy-gradient loss before any behaviour correction or KL.

    PPO/GRPO's clipped surrogate ``-min(ratio * A, clamp(ratio, 1 - eps_low,
    1 + eps_high) * A)``, or with ``loss_type = "cispo"`` CISPO's
    ``-sg(min(ratio, eps_high)) * A * logps``. ``ratio`` is ``[B, T]`` (token level) or
    ``[B, 1]`` (GSPO), ``adv`` ``[B, 1]`` or ``[B, T]``; the result has their broadcast
    shape (``[B, 1]`` for GSPO with row advantages), except CISPO's, which is ``[B, T]``.
    """
    if cfg.loss_type == "cispo":
        return cispo_per_token(policy_lp, ratio, adv, cfg.eps_high)
    clipped_ratio = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)  # TRL's coef_2
    return -torch.minimum(ratio * adv, clipped_ratio * adv)


def _behaviour_corrected(
    per_token: Tensor, old_lp: Tensor, behaviour_lp: Tensor, m: Tensor, cfg: LossConfig
) -> Tensor:
    """``per_token`` times the corrections for the policy that sampled the tokens: with
    ``decoupled_ppo`` the ``is_mode`` importance weight ``pi_old / pi_behaviour`` (without
    it the ratio is already taken against the sampler), then the ``geo_mask`` sequence
    mask when set. Both are detached and 0 at mask-0 positions."""
    if cfg.decoupled_ppo:
        per_token = per_token * importance_weights(
            old_lp, behaviour_lp, m, cfg.is_mode, cfg.is_clip_min, cfg.is_clip_max
        )
    if cfg.geo_mask is not None:
        per_token = per_token * geometric_mean_mask(old_lp, behaviour_lp, m, *cfg.geo_mask)
    return per_token


def _centering_per_token(
    policy_top_lp: Tensor, sampler_top_lp: Tensor, old_lp: Tensor, behaviour_lp: Tensor,
    m: Tensor, adv: Tensor, cfg: LossConfig
) -> tuple[Tensor, Tensor]:
    """(``A · C`` per token ``[B, T]``, the sampler's top mass ``[B, T]``): the score
    centering term (`pipeline.rl.centering`) at mask-1 tokens whose sampler reported top
    logprobs (``sampler_top_lp`` finite), 0 elsewhere; the ``geo_mask`` drops it with its
    sequence's loss."""
    valid = torch.isfinite(sampler_top_lp) & m.unsqueeze(-1)
    top = torch.where(valid, policy_top_lp.to(old_lp.dtype), 0.0)
    term = adv * centering_term(top, torch.where(valid, sampler_top_lp.to(old_lp.dtype), 0.0),
                                valid, cfg.is_mode, cfg.is_clip_min, cfg.is_clip_max)
    if cfg.geo_mask is not None:
        term = term * geometric_mean_mask(old_lp, behaviour_lp, m, *cfg.geo_mask)
    return term, sampler_mass(sampler_top_lp, valid)


def _k3_kl_per_token(policy_lp: Tensor, ref_lp: Tensor) -> Tensor:
    """Schulman's k3 estimate of KL(pi_theta || pi_ref) per token (nats, >= 0), with
    ``ref_lp`` the frozen KL reference model's logprobs:
    ``exp(ref - logps) - (ref - logps) - 1``. Differentiable in ``policy_lp``."""
    delta = ref_lp - policy_lp
    return torch.exp(delta) - delta - 1.0


def _kl_penalty_per_token(per_token_kl: Tensor, ratio: Tensor, cfg: LossConfig) -> Tensor:
    """The KL term added to the per-token loss: ``beta * k3``, with ``kl_bias_correction``
    ``beta * k3 * ratio`` (same value on-policy; unbiased reverse-KL gradient)."""
    kl_term = per_token_kl * ratio if cfg.kl_bias_correction else per_token_kl
    return cfg.beta * kl_term


def _normalised_loss(
    per_token: Tensor,
    mf: Tensor,
    batch_tokens: Tensor,
    cfg: LossConfig,
    num_items_in_batch: float | None,
    norm: LossNorm | None,
) -> Tensor:
    """Scalar loss: ``per_token`` summed over mask-1 tokens (``mf``, the float mask
    ``[B, T]``) and normalised by ``loss_type``. ``grpo``: sum over rows of (row sum / row
    tokens) / step rows; ``bnpo``: sum / step tokens; ``dr_grpo``: sum / (step rows *
    ``max_completion_length``); ``dapo`` and ``cispo``: sum / ``num_items_in_batch``, else
    step tokens. Step tokens and rows come from ``norm``, else this batch
    (``batch_tokens``, its masked token count clamped to >= 1, and B)."""
    masked = per_token * mf
    step_tokens = batch_tokens if norm is None else max(norm.tokens, 1.0)
    step_rows = mf.shape[0] if norm is None else norm.rows
    if cfg.loss_type == "grpo":
        return (masked.sum(dim=-1) / mf.sum(dim=-1).clamp(min=1.0)).sum() / step_rows
    if cfg.loss_type == "bnpo":
        return masked.sum() / step_tokens
    if cfg.loss_type == "dr_grpo":
        assert cfg.max_completion_length is not None
        return masked.sum() / (step_rows * cfg.max_completion_length)
    # dapo, cispo
    return masked.sum() / (step_tokens if num_items_in_batch is None else num_items_in_batch)


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    behaviour_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    ref_logps: Tensor | None = None,
    num_items_in_batch: float | None = None,
    norm: LossNorm | None = None,
    policy_top_logps: Tensor | None = None,
    sampler_top_logps: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Scalar loss (differentiable in ``logps`` and ``policy_top_logps``) and float metrics.

    With ``cfg.score_centering`` and the sampler's top logprobs ``sampler_top_logps``
    ``[B, T, k]`` (-inf = no entry) beside the policy's at the same ids
    ``policy_top_logps`` (with gradient), each trained token gains ``A · C``
    (`pipeline.rl.centering`); the metrics then add ``sampling/sampler_mass`` (mean top-k
    mass of the sampler), ``sampling/masked_mean`` (share of tokens whose importance ratio
    the bounds truncate or mask, TRL's name) and ``sampling/centered_frac`` (share of
    trained tokens that had top logprobs).

    Shapes: ``logps``/``old_logps``/``behaviour_logps``/``ref_logps``/``mask`` ``[B, T]``,
    ``advantages`` ``[B]`` (one per row) or ``[B, T]`` (per token: on-policy distillation,
    a per-token advantage hook; read at mask-1 tokens only). ``mask`` is bool or 0/1;
    0 = not trained (padding, inserted context). Metrics:
    ``clip_ratio/{low,high,region}_mean``, ``is_ratio/{min,mean,max}`` (raw token ratios
    ``exp(old - behaviour)``; NaN when no token is masked in), ``logprob_diff/mean_abs``
    and ``kl`` (0.0 when beta is 0), all over masked tokens.
    """
    _check_loss_inputs(
        logps, old_logps, behaviour_logps, advantages, cfg, ref_logps, num_items_in_batch
    )
    dt = _compute_dtype(logps)
    m = _bool_mask(mask, logps.shape)
    mf = m.to(dt)
    # Log-probabilities (nats) in dt, 0 at masked positions: padding never reaches exp().
    policy_lp = torch.where(m, logps.to(dt), 0.0)
    old_lp = policy_lp.detach() if old_logps is None else _masked_detached(old_logps, m, dt)
    behaviour_lp = _masked_detached(behaviour_logps, m, dt)  # may hold NaN (unknown)
    adv = _row_or_token_advantages(advantages, m, dt)  # [B, 1] | [B, T]

    ratio = torch.exp(_policy_log_ratio(policy_lp, old_lp, behaviour_lp, m, cfg))  # coef_1
    per_token = _surrogate_per_token(policy_lp, ratio, adv, cfg)
    per_token = _behaviour_corrected(per_token, old_lp, behaviour_lp, m, cfg)
    centering = None
    if cfg.score_centering and sampler_top_logps is not None:
        if policy_top_logps is None or policy_top_logps.shape != sampler_top_logps.shape \
                or sampler_top_logps.shape[:2] != logps.shape:
            raise ValueError("score centering needs policy_top_logps and sampler_top_logps "
                             "of one shape [B, T, k]")
        term, mass = _centering_per_token(policy_top_logps, sampler_top_logps, old_lp,
                                          behaviour_lp, m, adv, cfg)
        per_token = per_token + term
        centering = (mass, torch.isfinite(sampler_top_logps).any(-1) & m)
    per_token_kl = None
    if cfg.beta > 0:
        assert ref_logps is not None
        per_token_kl = _k3_kl_per_token(policy_lp, _masked_detached(ref_logps, m, dt))
        per_token = per_token + _kl_penalty_per_token(per_token_kl, ratio, cfg)

    batch_tokens = mf.sum().clamp(min=1.0)
    loss = _normalised_loss(per_token, mf, batch_tokens, cfg, num_items_in_batch, norm)
    metrics = {
        **clip_fractions(ratio, adv, m, mf, batch_tokens, cispo=cfg.loss_type == "cispo",
                         eps_low=cfg.eps_low, eps_high=cfg.eps_high),
        **behaviour_ratio_stats(old_lp, behaviour_lp, m, mf, batch_tokens,
                                clip_min=cfg.is_clip_min, clip_max=cfg.is_clip_max),
        "kl": 0.0 if per_token_kl is None else masked_mean(per_token_kl, mf, batch_tokens),
    }
    if centering is not None:
        mass, centred = centering
        n_centred = centred.sum().clamp(min=1)
        metrics["sampling/sampler_mass"] = float(torch.where(centred, mass, 0.0).sum()
                                                 / n_centred)
        metrics["sampling/centered_frac"] = masked_mean(centred, mf, batch_tokens)
        metrics["sampling/masked_mean"] = metrics["is_ratio/outside_frac"]
    return loss, metrics
