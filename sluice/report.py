"""End-of-run summary and reward-curve plot for `sluice up`.

Figures come from files the roles wrote (``metrics.jsonl`` by the trainer, ``eval.jsonl``
by the evaluator) and from the supervisor's samples of the scorers' counters, so the
summary is reproducible from the run directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pipeline.config import Config
from pipeline.evaluation import first_reaching, parse_target
from sluice.samples import ScorerSamples


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file written by a role; a torn last line (killed writer) is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _metrics_of(row: dict[str, Any]) -> dict[str, Any]:
    """An eval row without its bookkeeping (version, step, times, n)."""
    return {k: v for k, v in row.items() if k not in ("version", "step", "t", "ts", "n")}


def summary_dict(cfg: Config, samples: ScorerSamples, snap: dict[str, Any],
                 reason: str) -> dict[str, Any]:
    out = cfg.output_path
    metrics = read_jsonl(out / "metrics.jsonl")
    evals = read_jsonl(out / "eval.jsonl")
    last = samples.last
    wall = last.t if last else 0.0
    completions = last.n if last else 0
    first_reward = samples.first_reward(64)
    reward_after, exact_after = samples.recent(256)
    target = parse_target(cfg.up.stop_at)
    hit = first_reaching(evals, target)
    stal = [m["staleness_mean"] for m in metrics]
    final = snap["state"].get("version")  # the newest version the trainer published
    return {
        "reason": reason,
        "steps": metrics[-1]["step"] if metrics else 0,
        "wall_s": round(wall, 1),
        "completions_scored": completions,
        "completions_per_s": round(completions / wall, 2) if wall else None,
        "sampled_reward_first": first_reward,
        "sampled_reward_last": reward_after,
        "sampled_exact_last": exact_after,
        "eval_before": _metrics_of(evals[0]) if evals else None,
        "eval_after": _metrics_of(evals[-1]) if len(evals) > 1 else None,
        "eval_pass@1_before": evals[0].get("pass@1") if evals else None,
        "eval_pass@1_after": evals[-1].get("pass@1") if len(evals) > 1 else None,
        "eval_reward_before": evals[0]["reward"] if evals else None,
        "eval_reward_after": evals[-1]["reward"] if len(evals) > 1 else None,
        "eval_version_before": evals[0].get("version") if evals else None,
        "eval_version_after": evals[-1].get("version") if len(evals) > 1 else None,
        "final_version": final,
        "final_version_evaluated": bool(evals) and final is not None
        and evals[-1].get("version") == final,
        "target": str(target) if target else None,
        "time_to_target_s": round(hit["ts"] - samples.t0, 1) if hit else None,
        "step_at_target": hit["step"] if hit else None,
        # The version that met up.stop_at and its figure. The run ends in order after it,
        # so the final version (eval_*_after) is a few steps later and is evaluated again:
        # it need not still meet the target.
        "version_at_target": hit.get("version") if hit else None,
        "value_at_target": hit.get(target.metric) if hit and target else None,
        "staleness_mean": sum(stal) / len(stal) if stal else None,
        "staleness_max": max((m["staleness_max"] for m in metrics), default=None),
        "dropped_stale": snap["conservation"]["by_reason"]["stale"],
        "filtered": snap["conservation"]["by_reason"]["filtered"],
        "dead": snap["conservation"]["by_reason"]["dead"],
        "conservation": snap["conservation"],
    }


def plot(cfg: Config, samples: ScorerSamples, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = cfg.output_path
    evals = read_jsonl(out / "eval.jsonl")
    fig, ax = plt.subplots(figsize=(7, 4))
    pts = samples.curve(128)
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label="sampled reward (scorers)")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], label="sampled exact match", alpha=0.7)
    if evals:
        ax.plot([e["ts"] - samples.t0 for e in evals], [e.get("pass@1") for e in evals], "o-",
                label="held-out greedy pass@1")
    ax.set_xlabel("wall time (s)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"sluice: {cfg.run.name} ({cfg.task.name})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def evaluated_versions(s: dict[str, Any]) -> str:
    """Which versions the held-out figures are of, and whether the last is the final one
    (a run stopped at once, or one whose final evaluation failed, has figures of an older
    version: the reader must see that)."""
    first, last, final = (s["eval_version_before"], s["eval_version_after"],
                          s["final_version"])
    if first is None:
        return ""
    if last is None:
        last = first
    if final is None:
        return f"  (v{first} -> v{last})"
    if s["final_version_evaluated"]:
        return f"  (v{first} -> v{last}, the final version)"
    return f"  (v{first} -> v{last}; the final version, v{final}, was not evaluated)"


def summarize(cfg: Config, samples: ScorerSamples, snap: dict[str, Any], reason: str
              ) -> bool:
    """Print the summary, write summary.json and the plot; True if the books balance."""
    s = summary_dict(cfg, samples, snap, reason)
    out = cfg.output_path
    (out / "summary.json").write_text(json.dumps(s, indent=2))
    if cfg.up.plot and samples:
        try:
            plot(cfg, samples, out / "reward_curve.png")
        except Exception as e:
            print(f"plot failed: {e}", file=sys.stderr)

    def f(x: Any, spec: str = ".3f") -> str:
        return "-" if x is None else format(x, spec)

    c = s["conservation"]
    which = evaluated_versions(s)
    to_target = ("no up.stop_at" if s["target"] is None else
                 f"{s['target']}: not reached" if s["time_to_target_s"] is None else
                 f"{s['target']}: {s['time_to_target_s']:.0f} s (step {s['step_at_target']}, "
                 f"v{s['version_at_target']}: {f(s['value_at_target'])})")
    print(f"""
sluice run {cfg.run.name!r} ended: {reason}
  steps                 {s['steps']} in {s['wall_s']} s
  completions scored    {s['completions_scored']} ({f(s['completions_per_s'], '.1f')}/s)
  held-out pass@1       {f(s['eval_pass@1_before'])} -> {f(s['eval_pass@1_after'])}{which}
  held-out reward       {f(s['eval_reward_before'])} -> {f(s['eval_reward_after'])}
  sampled reward        {f(s['sampled_reward_first'])} -> {f(s['sampled_reward_last'])}
  time to target        {to_target}
  staleness mean / max  {f(s['staleness_mean'], '.2f')} / {f(s['staleness_max'], '.0f')}
  retired               {c['by_reason']}
  conservation          cursor {c['cursor']} == retired {c['retired']} + in_flight \
{c['in_flight']}: {'balanced' if c['balanced'] else 'NOT BALANCED'}
  run directory         {out}""")
    return bool(c["balanced"])
