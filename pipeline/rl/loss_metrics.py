"""The diagnostics `pipeline.rl.losses.grpo_loss` reports next to its loss.

Pure functions of the loss's intermediate tensors, all without gradient, each returning
plain floats (the metric names are TRL's where TRL has the metric):

* `clip_fractions`: ``clip_ratio/{low,high,region}_mean``, how often the policy ratio
  was clipped in the direction that zeroes its gradient;
* `behaviour_ratio_stats`: ``is_ratio/*`` and ``logprob_diff/mean_abs``, how far the
  proximal policy (``old``) is from the one that sampled the tokens (``behaviour``);
* `masked_mean`: the mean over trained (mask 1) tokens the others use.

Conventions shared with the loss: ``m`` is the bool mask ``[B, T]``, ``mf`` the same as
floats in the compute dtype, ``batch_tokens`` its sum clamped to >= 1 (a 0-d tensor);
inputs are already 0 at mask-0 positions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["behaviour_ratio_stats", "clip_fractions", "masked_mean"]


def masked_mean(x: Tensor, mf: Tensor, batch_tokens: Tensor) -> float:
    """Mean of ``x`` over mask-1 tokens, ``sum(x * mf) / batch_tokens``, without gradient."""
    with torch.no_grad():
        return float((x.to(mf.dtype) * mf).sum() / batch_tokens)


def clip_fractions(
    ratio: Tensor,
    adv: Tensor,
    m: Tensor,
    mf: Tensor,
    batch_tokens: Tensor,
    *,
    cispo: bool,
    eps_low: float,
    eps_high: float,
) -> dict[str, float]:
    """``clip_ratio/{low,high,region}_mean``: the fraction of masked tokens (GSPO: of rows
    with a masked token, TRL's convention; 0.0 when none) whose ratio was clipped in the
    direction that zeroes its gradient: below ``1 - eps_low`` with A < 0, above
    ``1 + eps_high`` with A > 0. CISPO (TRL's ``cispo_clip_ratio``): ratio above the cap
    ``eps_high`` with A > 0, and ``low`` is always 0. ``ratio`` is ``[B, T]``, or
    ``[B, 1]`` for GSPO; ``adv`` ``[B, 1]`` or ``[B, T]``. Without gradient."""
    with torch.no_grad():
        if ratio.shape[-1] == 1 and adv.shape[-1] > 1:  # GSPO with per-token advantages:
            adv = (adv * mf).sum(-1, keepdim=True)  # a row's sign is its advantages' sum's
        if cispo:
            high = (ratio > eps_high) & (adv > 0)
            low = torch.zeros_like(high)
        else:
            low = (ratio < 1.0 - eps_low) & (adv < 0)
            high = (ratio > 1.0 + eps_high) & (adv > 0)
        if ratio.shape[-1] == 1:  # GSPO: fractions of sequences
            rows = m.any(dim=-1)

            def fraction(x: Tensor) -> float:
                return float(x.squeeze(-1)[rows].to(mf.dtype).mean()) if rows.any() else 0.0
        else:

            def fraction(x: Tensor) -> float:
                return masked_mean(x, mf, batch_tokens)

        return {
            "clip_ratio/low_mean": fraction(low),
            "clip_ratio/high_mean": fraction(high),
            "clip_ratio/region_mean": fraction(low | high),
        }


def behaviour_ratio_stats(
    old_lp: Tensor, behaviour_lp: Tensor, m: Tensor, mf: Tensor, batch_tokens: Tensor,
    *, clip_min: float, clip_max: float,
) -> dict[str, float]:
    """``is_ratio/{min,mean,max}`` of the raw token ratios ``exp(old - behaviour)`` over
    masked tokens with a known behaviour logprob (NaN when there are none);
    ``is_ratio/outside_frac``: the fraction of them outside ``[clip_min, clip_max]``
    (``is_clip_min`` / ``is_clip_max``: the tokens ``is_mode`` truncates or masks; NaN
    with none); and ``logprob_diff/mean_abs``: mean ``|old - behaviour|`` (nats) over
    masked tokens, an unknown behaviour logprob counting 0. Without gradient."""
    with torch.no_grad():
        raw = torch.exp(old_lp - behaviour_lp)[m]
        raw = raw[~torch.isnan(raw)]
        empty = raw.numel() == 0
        outside = (raw > clip_max) | (raw < clip_min)
        abs_diff = torch.nan_to_num((old_lp - behaviour_lp).abs(), nan=0.0)
        return {
            "is_ratio/min": math.nan if empty else float(raw.min()),
            "is_ratio/mean": math.nan if empty else float(raw.mean()),
            "is_ratio/max": math.nan if empty else float(raw.max()),
            "is_ratio/outside_frac": math.nan if empty else float(outside.float().mean()),
            "logprob_diff/mean_abs": masked_mean(abs_diff, mf, batch_tokens),
        }
