"""Score centering: subtract the sampler-expected score at every trained position.

Why. The policy-gradient estimate at a sampled token ``y`` is ``A · w(y) · ∇log p(y)``,
with ``p`` the trained policy, ``q`` the sampler (a vLLM server: other kernels, other
precision, a version or more behind) and ``w`` the importance weight the loss applies
(`pipeline.rl.losses.importance_weights`). Its expectation over ``y ~ q`` holds
``A · E_q[w ∇log p]``, and ``E_q[w ∇log p] = Σ_v q_v w_v ∇log p_v`` is 0 only when the
weights are untruncated (``q w = p``, and ``Σ p ∇log p = 0``). With truncated or masked
weights, or none, every update carries a term that moves ``p`` toward the sampler
whatever the reward. Centering subtracts it: the per-token loss gains
``A · Σ_v sg(c_v) · log p_v`` whose gradient is ``A · E_q[w ∇log p]``.

The estimator (Eq. 14 of arXiv:2609.20807 with its top-k tail model, as NeMo-RL's
``score_centering`` documents it; TRL's ``AsyncGRPOTrainer`` turns it on by default). The
sampler reports its ``k`` most likely tokens ``H`` with their logprobs ``q_H``; the
trainer computes its own ``p`` at those ids, normalised over the full vocabulary (over the
candidate set when the sampler truncated). The unobserved sampler tail is modelled as the
trainer's tail rescaled, ``q_v ≈ ρ p_v`` outside ``H`` with
``ρ = (1 - Σ_H q) / max(1 - Σ_H p, 1e-6)``. Since ``Σ_all p ∇log p = 0``, a tail of mass
``α p`` contributes ``-α p_v`` on the head ids, so ``c_v = m_v - α p_v`` on ``H`` with, by
the loss's importance-sampling mode (``lo``, ``hi`` = ``is_clip_min``, ``is_clip_max``):

* ``none`` (no weight): ``m_v = q_v``, ``α = ρ``;
* ``token_truncate`` (``w = clamp(p/q, lo, hi)``): ``m_v = q_v w_v = clamp(p_v, lo q_v,
  hi q_v)``, ``α = clamp(1, lo ρ, hi ρ)`` (the tail's ratio is ``1/ρ``);
* ``token_mask`` (``w = p/q`` inside ``[lo, hi]``, else 0): ``m_v = p_v`` where
  ``lo <= p_v/q_v <= hi`` else 0, ``α = 1`` where ``lo <= 1/ρ <= hi`` else 0.

Invariants: with ``k`` = the whole vocabulary the estimate is exact (``ρ`` multiplies an
empty tail); when the sampler equals the policy every ``c_v`` is 0 (``p = q``, ``ρ = 1``),
so centering changes nothing on-policy; untruncated weights (``lo = 0``, ``hi = ∞``) give
``c = 0``. Sequence-level modes have no per-token expectation of this form and are
refused (`pipeline.rl.losses.LossConfig`). Coefficients carry no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["centering_coefficients", "centering_term", "sampler_mass"]

_RHO_FLOOR = 1e-6
"""Smallest trainer tail mass ``ρ`` divides by (the estimator's own floor)."""


def _times(bound: float, x: Tensor) -> Tensor:
    """``bound · x`` with an infinite bound meaning no bound (never ``inf · 0``)."""
    return torch.full_like(x, torch.inf) if bound == float("inf") else bound * x


def _probs(logps: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, logps.detach().double().exp(), 0.0)


def centering_coefficients(policy_top_logps: Tensor, sampler_top_logps: Tensor,
                           valid: Tensor, mode: str, clip_min: float,
                           clip_max: float) -> Tensor:
    """``c [..., k]`` (float64, no gradient, 0 where not ``valid``): the coefficients of
    ``log p`` at the sampler's top ids. ``policy_top_logps`` / ``sampler_top_logps`` are
    the trainer's and the sampler's logprobs (nats) at those ids, ``[..., k]``; ``valid``
    marks real entries (an id of -1 is padding). ``mode`` is a token-level ``is_mode``."""
    if mode not in ("none", "token_truncate", "token_mask"):
        raise ValueError(f"score centering needs a token-level is_mode (none, token_truncate, "
                         f"token_mask), got {mode!r}")
    with torch.no_grad():
        p = _probs(policy_top_logps, valid)
        q = _probs(sampler_top_logps, valid)
        head_p = p.sum(-1, keepdim=True).clamp(max=1.0)
        head_q = q.sum(-1, keepdim=True).clamp(max=1.0)
        rho = (1.0 - head_q) / (1.0 - head_p).clamp(min=_RHO_FLOOR)
        if mode == "none":
            m, alpha = q, rho
        elif mode == "token_truncate":
            m = torch.minimum(torch.maximum(p, clip_min * q), _times(clip_max, q))
            alpha = torch.minimum(torch.maximum(torch.ones_like(rho), clip_min * rho),
                                  _times(clip_max, rho))
        else:  # token_mask: a weight is kept where its ratio is inside [lo, hi]
            ratio = torch.where(q > 0, p / q.clamp(min=1e-300), torch.inf)
            m = torch.where((ratio >= clip_min) & (ratio <= clip_max), p, 0.0)
            tail_ratio = torch.where(rho > 0, 1.0 / rho.clamp(min=1e-300), torch.inf)
            alpha = ((tail_ratio >= clip_min) & (tail_ratio <= clip_max)).double()
        return torch.where(valid, m - alpha * p, 0.0)


def centering_term(policy_top_logps: Tensor, sampler_top_logps: Tensor, valid: Tensor,
                   mode: str, clip_min: float, clip_max: float) -> Tensor:
    """``C [...]`` = ``Σ_H sg(c_v) · log p_v`` per position, differentiable in
    ``policy_top_logps``: add ``A · C`` to the per-token loss (before normalisation) and
    its gradient is ``A`` times the estimated ``E_q[w ∇log p]``. 0 where no entry is
    valid (a position whose sampler reported no top logprobs is not centred)."""
    coef = centering_coefficients(policy_top_logps, sampler_top_logps, valid, mode,
                                  clip_min, clip_max).to(policy_top_logps.dtype)
    lp = torch.where(valid, policy_top_logps, 0.0)
    return (coef * lp).sum(-1)


def sampler_mass(sampler_top_logps: Tensor, valid: Tensor) -> Tensor:
    """``Σ_H q`` per position ``[...]``: the share of the sampler's distribution its top
    ids cover (TRL's ``sampling/sampler_mass``); the tail model governs the rest."""
    return _probs(sampler_top_logps, valid).sum(-1)
