"""Off-policy corrections for stale samples, as pure tensor functions.

Three log-probabilities exist for every trained token (all ``[B, T]``):

* ``logps`` — the policy being optimised (π_θ, with gradient);
* ``old`` — the *proximal* policy: the trainer's weights at the start of this step
  (``logps.detach()`` when ``num_iterations`` = 1);
* ``behaviour`` — the policy that sampled the token (a generator's weights, up to
  ``max_staleness`` versions older; NaN where the engine could not report it).

The corrections here, each selected in ``TrainerConfig`` and named after its source:

* **Decoupled PPO** (AReaL, Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
  Reinforcement Learning System", eq. 5): the clipped ratio is ``π_θ / π_old`` (a trust
  region around the proximal policy) and the behaviour correction is a separate
  importance weight ``π_old / π_behaviour`` (``importance_weights`` in ``losses.py``, by
  ``is_mode``). This is sluice's default (``decoupled_ppo = true``). With
  ``decoupled_ppo = false`` the ratio is taken against the behaviour policy itself
  (``ratio_denominator_logps``): the standard PPO objective that treats the sampler as
  "old",
  whose clip bounds how far a stale batch can move the policy from its sampler.
* **Token masking of extreme ratios** (IcePop, Ling Team 2025, "Small Leak Can Sink a
  Great Ship"): ``is_mode = "token_mask"`` with ``is_clip_min``/``is_clip_max`` (e.g.
  0.5 and 5) zeroes the gradient of tokens whose ``π_old / π_behaviour`` leaves the band.
* **Geometric-mean sequence mask** (verl's rollout correction, ``rollout_rs =
  "geometric"``): :func:`geometric_mean_mask` drops whole sequences whose per-token
  geometric-mean ratio ``exp(mean_t(old - behaviour))`` leaves ``[low, high]``; unlike a
  product ratio it does not grow with length.
* **GSPO** (Zheng et al. 2025, "Group Sequence Policy Optimization";
  ``importance_sampling_level = "sequence"``, TRL's name): one ratio per sequence,
  ``exp(mean_t(logps - denominator))`` (:func:`sequence_log_ratio`), clipped as a whole.
* **CISPO** (MiniMax-M1, 2025; ``loss_type = "cispo"``, TRL's name):
  :func:`cispo_per_token` clips the importance ratio itself, detached, at ``ε_max`` and
  multiplies the REINFORCE term ``A · log π_θ``: every token keeps a gradient (PPO's clip
  zeroes clipped tokens' gradients), only its weight is bounded.

Invariants: every function returns values only where ``mask`` is 1 (0 elsewhere, or a
row value that the caller multiplies by the mask); nothing here carries gradient except
through ``logps``; NaN behaviour logprobs mean "no correction" for that token.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["cispo_per_token", "geometric_mean_mask", "ratio_denominator_logps",
           "sequence_log_ratio"]


def ratio_denominator_logps(old: Tensor, behaviour: Tensor, decoupled: bool) -> Tensor:
    """The log-probabilities the policy ratio is taken against: the proximal policy
    (``old``) when decoupled, else the behaviour policy (``old`` where it is NaN)."""
    if decoupled:
        return old
    return torch.where(torch.isnan(behaviour), old, behaviour)


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """GSPO's per-sequence log ratio ``[B, 1]``: the mean of ``log_ratio`` over each row's
    masked tokens (0 for a row with none). Differentiable in ``log_ratio``."""
    m = mask.to(log_ratio.dtype)
    return ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def geometric_mean_mask(old: Tensor, behaviour: Tensor, mask: Tensor, low: float,
                        high: float) -> Tensor:
    """Row mask ``[B, 1]`` (float 0/1, no gradient): 1 where the geometric mean of the
    row's token ratios ``π_old / π_behaviour`` lies in ``[low, high]`` (inclusive).
    A row with no masked token, or NaN behaviour logprobs only, has ratio 1."""
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"geometric mask bounds need 0 <= low <= 1 <= high, got {low}, {high}")
    with torch.no_grad():
        m = mask.bool()
        diff = torch.where(m, old.detach() - behaviour.detach(), 0.0)
        diff = torch.nan_to_num(diff, nan=0.0)
        geo = torch.exp(sequence_log_ratio(diff, m))
        return ((geo >= low) & (geo <= high)).to(old.dtype)


def cispo_per_token(logps: Tensor, ratio: Tensor, advantages: Tensor, eps_max: float) -> Tensor:
    """CISPO's per-token loss ``-sg(min(ratio, eps_max)) · A · logps`` (``[B, T]``).

    ``ratio`` is the importance ratio (token ``[B, T]`` or sequence ``[B, 1]``),
    ``advantages`` ``[B, 1]``. The gradient w.r.t. ``logps`` is ``-min(ratio, eps_max)·A``
    for every token: the weight is clipped, the token is never dropped."""
    if eps_max <= 0:
        raise ValueError(f"CISPO's eps_max must be > 0, got {eps_max}")
    return -torch.clamp(ratio.detach(), max=eps_max) * advantages * logps
