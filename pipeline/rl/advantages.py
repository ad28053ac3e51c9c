"""Reward combination and group-relative advantages (numpy; used by the scorer).

This is TRL ``GRPOTrainer._generate_and_score_completions`` maths for one group (or one
scorer read of several groups):

* total reward = ``nansum(rewards_per_func * weights, axis=1)``: a reward function that
  returned ``None`` (NaN here) is left out of that row's sum.
* advantage = ``r - mean(r over the group)``; with ``scale_rewards="group"`` divided by
  ``std(group) + eps``, with ``"batch"`` by ``std(every reward given) + eps``, with
  ``"none"`` only centred.

Differences from TRL, on purpose:

* a row whose functions *all* returned ``None`` totals NaN (TRL warns and sums to 0);
  the caller treats it as an error instead of training on a made-up zero.
* ``ddof`` is a parameter. The default 1 (unbiased, Bessel) is what ``torch.std`` in TRL
  computes; ``ddof=0`` gives the population std. A group with ``n <= ddof`` has std 0.
* ``"batch"`` means the rewards of the groups handed to ``batch_advantages`` (one scorer
  read), not TRL's whole gathered generation batch.
* NaN or inf rewards raise ``ValueError`` rather than propagating.

``eps`` defaults to TRL's 1e-4. Advantages are float32; intermediate maths is float64.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

ScaleRewards = Literal["group", "batch", "none"]

__all__ = [
    "ScaleRewards",
    "batch_advantages",
    "check_hook_advantages",
    "combine_rewards",
    "group_advantages",
    "is_zero_variance",
    "rloo",
]

_SCALES = ("group", "batch", "none")


def combine_rewards(per_fn: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted total per row: ``nansum(per_fn * weights, axis=1)`` -> float64 ``[n]``.

    ``per_fn`` is ``[n, F]`` with NaN where function ``f`` returned None for row ``i``;
    ``weights`` is ``[F]``. Invariant: a row with every entry NaN totals NaN (not 0).
    """
    per_fn = np.asarray(per_fn, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    if per_fn.ndim != 2:
        raise ValueError(f"per_fn must be 2-D [n, F], got shape {per_fn.shape}")
    if weights.shape != (per_fn.shape[1],):
        raise ValueError(f"weights must have shape ({per_fn.shape[1]},), got {weights.shape}")
    total = np.nansum(per_fn * weights, axis=1)
    total[np.isnan(per_fn).all(axis=1)] = np.nan
    return total


def _as_rewards(rewards: np.ndarray) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D array, got shape {r.shape}")
    if not np.isfinite(r).all():
        raise ValueError("rewards must be finite (NaN/inf rows are errors, not rewards)")
    return r


def _std(r: np.ndarray, ddof: int) -> float:
    if ddof < 0:
        raise ValueError(f"ddof must be >= 0, got {ddof}")
    if r.size <= ddof:
        return 0.0
    return float(np.std(r, ddof=ddof))


def _centre(r: np.ndarray) -> np.ndarray:
    # Exact zeros for equal rewards: r - mean(r) can be ~1e-16, which /eps would inflate.
    return np.zeros_like(r) if r.max() == r.min() else r - r.mean()


def _scale(centred: np.ndarray, denom: float) -> np.ndarray:
    # denom is 0 only with eps=0 and no spread: the advantages are zero, not 0/0 = NaN.
    return np.zeros_like(centred) if denom == 0.0 else centred / denom


def _check_scale(scale_rewards: str, eps: float) -> None:
    if scale_rewards not in _SCALES:
        raise ValueError(f"scale_rewards must be one of {_SCALES}, got {scale_rewards!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def group_advantages(
    rewards: np.ndarray,
    *,
    scale_rewards: ScaleRewards = "group",
    eps: float = 1e-4,
    ddof: int = 1,
) -> np.ndarray:
    """Advantages of ONE group -> float32 ``[n]``.

    ``"group"``: ``(r - mean) / (std(r, ddof) + eps)``; ``"none"``: ``r - mean``.
    ``"batch"`` needs the other groups' rewards, so it raises here: use
    :func:`batch_advantages`. Invariant: the output sums to ~0 and is exactly zero when
    every reward is equal.
    """
    _check_scale(scale_rewards, eps)
    if scale_rewards == "batch":
        raise ValueError("scale_rewards='batch' needs every group: use batch_advantages()")
    r = _as_rewards(rewards)
    adv = _centre(r)
    if scale_rewards == "group":
        adv = _scale(adv, _std(r, ddof) + eps)
    return adv.astype(np.float32)


def batch_advantages(
    groups: list[np.ndarray],
    *,
    scale_rewards: ScaleRewards = "batch",
    eps: float = 1e-4,
    ddof: int = 1,
) -> list[np.ndarray]:
    """Advantages of several groups -> one float32 array per group, same order.

    Each group is centred on its own mean. ``"batch"`` divides by ``std + eps`` of the
    concatenation of all groups' rewards (TRL ``scale_rewards="batch"``); ``"group"``
    and ``"none"`` equal :func:`group_advantages` applied to each group.
    """
    _check_scale(scale_rewards, eps)
    rs = [_as_rewards(g) for g in groups]
    if scale_rewards != "batch":
        return [group_advantages(r, scale_rewards=scale_rewards, eps=eps, ddof=ddof) for r in rs]
    if not rs:
        return []
    denom = _std(np.concatenate(rs), ddof) + eps
    return [_scale(_centre(r), denom).astype(np.float32) for r in rs]


def is_zero_variance(rewards: np.ndarray, atol: float = 1e-6) -> bool:
    """True when all rewards are equal within ``atol`` (max - min <= atol).

    Such a group has all-zero advantages and carries no gradient; the scorer retires it
    as "filtered". A single-reward group is zero-variance.
    """
    r = _as_rewards(rewards)
    return bool(r.max() - r.min() <= atol)


def rloo(*, rewards: list[float], **kwargs: object) -> list[float]:
    """RLOO advantages of one group, usable as ``scoring.advantages =
    "pipeline.rl.advantages:rloo"``: each sample's reward minus the mean of the *other*
    samples' rewards, ``r_i - (sum(r) - r_i) / (n - 1) = n / (n - 1) * (r_i - mean(r))``
    (Ahmadian et al. 2024; no std scaling). Sums to 0; a group of one gets 0."""
    r = _as_rewards(np.asarray(rewards))
    n = r.size
    if n < 2:
        return [0.0] * n
    return (r - (r.sum() - r) / (n - 1)).astype(np.float64).tolist()


def check_hook_advantages(value: object, lengths: list[int], where: str
                          ) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """What a ``scoring.advantages`` hook returned for a group whose rollouts have
    ``lengths`` tokens: one finite number per rollout -> (float32 ``[n]``, None), or one
    list per rollout with one number per token -> (their per-rollout means, the float32
    arrays). Anything else is a ``ValueError`` saying what came back."""
    n = len(lengths)
    if hasattr(value, "tolist") and not isinstance(value, list | tuple):
        value = value.tolist()  # type: ignore[union-attr]
    if not isinstance(value, list | tuple) or len(value) != n:
        got = f"{len(value)} values" if isinstance(value, list | tuple) else type(value).__name__
        raise ValueError(f"{where} must return {n} advantages (one per rollout, or one list "
                         f"per rollout of per-token values), got {got}")
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        adv = np.asarray(value, dtype=np.float64)
        if not np.isfinite(adv).all():
            raise ValueError(f"{where} returned a non-finite advantage")
        return adv.astype(np.float32), None
    rows = []
    for i, (v, t) in enumerate(zip(value, lengths, strict=True)):
        a = np.asarray(v.tolist() if hasattr(v, "tolist") else v, dtype=np.float64)
        if a.ndim != 1 or a.size != t:
            raise ValueError(f"{where}: rollout {i} has {t} tokens but {a.size} per-token "
                             "advantages")
        if not np.isfinite(a).all():
            raise ValueError(f"{where}: rollout {i} has a non-finite advantage")
        rows.append(a.astype(np.float32))
    means = np.asarray([float(a.mean()) if a.size else 0.0 for a in rows], np.float32)
    return means, rows
