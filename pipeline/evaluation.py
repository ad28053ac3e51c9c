"""What an evaluation reports, and when a run has reached its target: pure functions.

The evaluator scores held-out prompts with reward functions (``eval.rewards``, default the
training rewards) and writes one row per evaluated version to ``eval.jsonl``. The metric
names of a row (every one a float in its own key):

- ``reward``: mean weighted total reward of the greedy completions;
- ``rewards/<fn>``: mean of one reward function over the greedy completions (None results
  are left out of the mean; a function that gave only None is left out of the row);
- ``pass@1``: fraction of prompts whose greedy completion *passes* — its total reward is at
  least ``eval.pass_threshold`` (default 1.0: with the built-in tasks' ``copy_reward`` that is
  exactly "the answer, then end-of-sequence");
- ``sampled_pass@k`` for each k in ``eval.pass_at`` with k <= ``eval.num_samples``: the
  unbiased pass@k estimate (Chen et al. 2021) from ``num_samples`` sampled completions per
  prompt at the generation temperature.

``up.stop_at`` names one of these and a threshold (``"pass@1>=0.9"``); `sluice up` stops the
run when an evaluation meets it, and the summary's "time to target" is the time of the first
row that met it. Nothing is hard-coded to exact match or 0.9.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_STOP_AT = re.compile(r"^\s*([A-Za-z_][\w@/.:-]*)\s*(>=|<=)\s*([-+]?(?:\d+\.?\d*|\.\d+)"
                      r"(?:[eE][-+]?\d+)?)\s*$")


@dataclass(frozen=True)
class Target:
    """``metric op value``: met by a row whose ``metric`` is >= (or <=) ``value``."""

    metric: str
    op: str
    value: float

    def met(self, row: Mapping[str, Any]) -> bool:
        x = row.get(self.metric)
        if not isinstance(x, int | float) or isinstance(x, bool) or math.isnan(x):
            return False
        return x >= self.value if self.op == ">=" else x <= self.value

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"


def parse_target(text: str) -> Target | None:
    """``"pass@1>=0.9"`` -> Target; ``""`` -> None. ValueError names the expected form."""
    if not text.strip():
        return None
    m = _STOP_AT.match(text)
    if m is None:
        raise ValueError(f"{text!r}: expected METRIC>=VALUE or METRIC<=VALUE, "
                         "e.g. 'pass@1>=0.9' or 'reward>=0.5'")
    return Target(m.group(1), m.group(2), float(m.group(3)))


def metric_names(reward_names: Iterable[str], num_samples: int,
                 pass_at: Iterable[int]) -> list[str]:
    """Every metric an evaluation with these settings can report (for checking
    ``up.stop_at`` at start)."""
    names = ["reward", "pass@1", *(f"rewards/{n}" for n in reward_names)]
    names += [f"sampled_pass@{k}" for k in sorted(set(pass_at)) if k <= num_samples]
    return names


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` pass: ``1 - C(n-c, k) / C(n, k)``
    (Chen et al. 2021, eq. 1): the chance that k of the n samples, drawn without
    replacement, include at least one that passes."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _nanmean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(vals) / len(vals) if vals else None


def summarize_scores(names: Sequence[str], weights: Sequence[float],
                     greedy: Sequence[Sequence[float | None]], pass_threshold: float,
                     sampled: Sequence[Sequence[Sequence[float | None]]] = (),
                     pass_at: Iterable[int] = ()) -> dict[str, float]:
    """One eval row from reward values.

    ``greedy[i][j]``: reward function ``j`` on prompt ``i``'s greedy completion (None = not
    applicable). ``sampled[i][s][j]``: the same for sample ``s`` of prompt ``i`` (every
    prompt the same number of samples). The total of a completion is the weighted sum of
    its non-None values (as the scorer's); a completion none of whose functions applies
    has total 0 and does not pass."""
    def total(values: Sequence[float | None]) -> float:
        return sum(w * v for w, v in zip(weights, values, strict=True) if v is not None)

    def passes(values: Sequence[float | None]) -> bool:
        return any(v is not None for v in values) and total(values) >= pass_threshold

    n = len(greedy)
    if n == 0:
        raise ValueError("no held-out prompts to evaluate")
    row: dict[str, float] = {
        "reward": sum(total(v) for v in greedy) / n,
        "pass@1": sum(passes(v) for v in greedy) / n,
    }
    for j, name in enumerate(names):
        mean = _nanmean([v[j] for v in greedy])
        if mean is not None:
            row[f"rewards/{name}"] = mean
    if sampled:
        m = len(sampled[0])
        if any(len(s) != m for s in sampled) or len(sampled) != n:
            raise ValueError("every prompt needs the same number of samples")
        correct = [sum(passes(v) for v in s) for s in sampled]
        for k in sorted(set(pass_at)):
            if 1 <= k <= m:
                row[f"sampled_pass@{k}"] = sum(pass_at_k(m, c, k) for c in correct) / n
    return row


def first_reaching(rows: Iterable[Mapping[str, Any]], target: Target | None
                   ) -> Mapping[str, Any] | None:
    """The first eval row that meets ``target`` (None if none does, or no target)."""
    if target is None:
        return None
    return next((r for r in rows if target.met(r)), None)
