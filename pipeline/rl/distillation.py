"""On-policy distillation advantages (numpy; used by the scorer).

The student samples (on-policy), a teacher scores every sampled token, and the
per-token advantage is the negative per-token reverse KL estimate, as in on-policy
distillation (Agarwal et al. 2024, GKD with the student's own samples; Thinking
Machines' "On-Policy Distillation", 2025)::

    A[i, t] = group_adv[i] + coef * (log p_teacher(x_t) - log p_behaviour(x_t))   mask 1
    A[i, t] = 0                                                                     mask 0

``group_adv`` is the GRPO advantage of rollout ``i`` from the reward functions
(`pipeline.rl.advantages`), 0 when there are none (pure distillation). The teacher term is
per token and not centred on the group (no baseline): its expectation under the
sampler is ``-KL(sampler || teacher)`` at each position, which is what the policy
gradient minimises. Tokens inserted by an environment (mask 0) were not sampled, so
they carry no advantage (the trainer reads mask-1 tokens only; 0 keeps that explicit).

``log p_behaviour`` is the sampler's logprob as recorded on the rollout (processed:
after temperature / top-k / top-p), ``log p_teacher`` the teacher's unprocessed
(temperature-1, full-vocabulary) logprob: the term estimates the reverse KL from the
distribution the tokens were actually drawn from to the teacher's own distribution
(see `workers.teacher` for why the teacher is not tempered).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["mean_over_mask", "reverse_kl", "token_advantages"]


def _check(behaviour: Sequence[np.ndarray], teacher: Sequence[np.ndarray],
           masks: Sequence[np.ndarray]) -> None:
    if not len(behaviour) == len(teacher) == len(masks):
        raise ValueError(f"{len(behaviour)} behaviour, {len(teacher)} teacher and "
                         f"{len(masks)} mask arrays: one of each per rollout")
    for i, (b, t, m) in enumerate(zip(behaviour, teacher, masks, strict=True)):
        if not len(b) == len(t) == len(m):
            raise ValueError(f"rollout {i}: {len(b)} behaviour logprobs, {len(t)} teacher "
                             f"logprobs, {len(m)} mask entries")
        if not np.isfinite(np.asarray(t, dtype=np.float64)[np.asarray(m) > 0]).all():
            raise ValueError(f"rollout {i}: a teacher logprob at a mask-1 token is not "
                             "finite")


def token_advantages(group_adv: np.ndarray, behaviour: Sequence[np.ndarray],
                     teacher: Sequence[np.ndarray], masks: Sequence[np.ndarray],
                     coef: float) -> list[np.ndarray]:
    """Per rollout, float32 ``[T_i]``: ``group_adv[i] + coef * (teacher - behaviour)``
    at mask-1 tokens, exactly 0 at mask-0 tokens (module docstring)."""
    group_adv = np.asarray(group_adv, dtype=np.float64)
    if group_adv.shape != (len(masks),):
        raise ValueError(f"group_adv must have shape ({len(masks)},), got {group_adv.shape}")
    _check(behaviour, teacher, masks)
    out = []
    for a, b, t, m in zip(group_adv, behaviour, teacher, masks, strict=True):
        on = np.asarray(m) > 0
        adv = np.zeros(len(m), dtype=np.float64)
        adv[on] = a + coef * (np.asarray(t, np.float64)[on] - np.asarray(b, np.float64)[on])
        out.append(adv.astype(np.float32))
    return out


def mean_over_mask(token_adv: Sequence[np.ndarray], masks: Sequence[np.ndarray]
                   ) -> np.ndarray:
    """float32 ``[n]``: each rollout's mean advantage over its mask-1 tokens (0 with
    none): the one number per rollout that reports show (`ScoredGroup.advantages`)."""
    out = np.zeros(len(masks), dtype=np.float64)
    for i, (a, m) in enumerate(zip(token_adv, masks, strict=True)):
        on = np.asarray(m) > 0
        if on.any():
            out[i] = float(np.asarray(a, np.float64)[on].mean())
    return out.astype(np.float32)


def reverse_kl(behaviour: Sequence[np.ndarray], teacher: Sequence[np.ndarray],
               masks: Sequence[np.ndarray]) -> tuple[float, int]:
    """(sum over mask-1 tokens of ``behaviour - teacher``, number of those tokens): the
    per-token reverse KL estimate (sampler || teacher) of these rollouts is sum / count.
    Summed, not averaged, so a caller can pool reads and groups exactly."""
    _check(behaviour, teacher, masks)
    total, count = 0.0, 0
    for b, t, m in zip(behaviour, teacher, masks, strict=True):
        on = np.asarray(m) > 0
        total += float((np.asarray(b, np.float64)[on] - np.asarray(t, np.float64)[on]).sum())
        count += int(on.sum())
    return total, count
