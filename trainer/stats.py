"""Per-step statistics of the groups a step trained, under TRL's ``GRPOTrainer`` names.

Pure functions over `ScoredGroup`s, computed on rank 0 from the whole step (every rank's
share), so a multi-rank job reports the same figures as one process. As in TRL, a
completion's length counts every completion token including the EOS, and a completion
is *clipped* when it hit ``max_new_tokens`` (finish_reason ``length``; a `scored` entry
carries it as the rollout's ``clipped`` flag, not as text).
"""

from __future__ import annotations

import resource
from typing import Any

import numpy as np

from pipeline.bus.schema import ScoredGroup
from trainer.perf import mfu_metrics


def step_tokens(groups: list[ScoredGroup]) -> int:
    """Prompt + completion tokens of the step, each completion with its own copy of the
    prompt (TRL's ``num_input_tokens_seen`` increment, summed into ``num_tokens``)."""
    return sum(len(g.group.prompt_ids) * len(g.group.rollouts)
               + sum(len(r.completion_ids) for r in g.group.rollouts) for g in groups)


def rollout_stats(groups: list[ScoredGroup], pass_threshold: float = 1.0) -> dict[str, float]:
    """Completion lengths, the clipped fraction and the fraction of groups whose rewards
    are all equal (zero std: advantage 0 everywhere), over the step's groups, split into
    *solved* (every completion's total reward ≥ ``pass_threshold``, the evaluator's pass
    rule: nothing left to learn on that prompt) and *stuck* (all equal below it: no
    signal to learn from); ``solved + stuck = frac_reward_zero_std``."""
    lengths = np.array([len(r.completion_ids) for g in groups for r in g.group.rollouts])
    clipped = [r.clipped for g in groups for r in g.group.rollouts]
    if not len(lengths):
        return {}
    return {"completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(np.mean(clipped)),
            **zero_std_split([g.rewards for g in groups], pass_threshold)}


def zero_std_split(rewards: list[np.ndarray], pass_threshold: float) -> dict[str, float]:
    """``frac_reward_zero_std`` of groups with total rewards ``rewards`` (one array per
    group) and its ``/solved`` and ``/stuck`` parts (`rollout_stats`); the TRL baseline
    of ``benchmarks/`` reports the same split with this function."""
    flat = np.array([bool(np.isclose(np.std(r), 0.0)) for r in rewards])
    solved = flat & np.array([bool(np.all(np.asarray(r) >= pass_threshold)) for r in rewards])
    return {"frac_reward_zero_std": float(np.mean(flat)),
            "frac_reward_zero_std/solved": float(np.mean(solved)),
            "frac_reward_zero_std/stuck": float(np.mean(flat & ~solved))}


def reward_part_means(groups: list[ScoredGroup]) -> dict[str, float]:
    """``reward/<part>`` and ``reward/<part>/{std,min,max}``: each reward part's mean
    (population std, extremes) over the step's completions that have it. The parts are
    the union over the step's groups (in first-seen order), because groups scored under
    different ``scoring.rewards`` (a config change, scorers of two versions) carry
    different keys: a part a group lacks is absent from that group's share, not a crash
    after the step was published. NaN (a function's None) is left out of every figure,
    and a part with no value in the whole step is left out of the result."""
    values: dict[str, list[np.ndarray]] = {}
    for g in groups:
        for k, v in g.reward_parts.items():
            values.setdefault(k, []).append(np.asarray(v, dtype=np.float64).ravel())
    out: dict[str, float] = {}
    for k, vs in values.items():
        x = np.concatenate(vs)
        x = x[np.isfinite(x)]
        if len(x):
            out[f"reward/{k}"] = float(x.mean())
            out[f"reward/{k}/std"] = float(x.std())
            out[f"reward/{k}/min"] = float(x.min())
            out[f"reward/{k}/max"] = float(x.max())
    return out


def peak_rss_mb() -> float:
    """The largest resident set this process has had, in MiB (the kernel's high-water
    mark; Linux reports kilobytes): what the host must hold for the trainer, model,
    optimizer state and the step's activations and logits together."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def step_row(groups: list[ScoredGroup], metrics: dict[str, float], *, step: int,
             version: int, t_run_s: float, wait_s: float, step_s: float,
             counts: dict[str, int], tokens_seen: int, pass_threshold: float,
             peak_flops: float | None) -> dict[str, Any]:
    """One step's metrics row (metrics.jsonl, the trackers, /metrics): the sampled reward,
    rates over the step's wall time (``wait_s`` for its groups + ``step_s`` training),
    rollout and reward-part figures, MFU, then the step's own ``metrics``, which win."""
    rewards = np.concatenate([g.rewards for g in groups])
    n = len(rewards)
    wall_s = max(wait_s + step_s, 1e-9)
    return {
        "step": step, "version": version, "t": t_run_s,
        "reward": float(rewards.mean()), "reward_std": float(rewards.std()),
        "samples": n, "groups": len(groups),
        "rollout_wait_s": wait_s, "step_time_s": step_s,
        "samples_per_s": n / wall_s, "tokens_per_s": metrics["tokens"] / wall_s,
        "dropped_stale": counts["stale"], "duplicates": counts["duplicates"],
        "num_tokens": tokens_seen, "memory/peak_rss_mb": peak_rss_mb(),
        **rollout_stats(groups, pass_threshold),
        **reward_part_means(groups),  # the union of the groups' parts
        **mfu_metrics(metrics["perf/step_flops"], metrics["perf/fwd_bwd_s"], wait_s + step_s,
                      peak_flops),
        **metrics}
