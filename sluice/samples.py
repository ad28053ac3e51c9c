"""What `sluice up` samples while a run goes: the scorers' counters, summed over the
scorers, at each progress tick. The progress line (`sluice.up`) and the end-of-run
summary and reward plot (`sluice.report`) read them; neither owns the other."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """Scorer counters summed over scorers at one instant (cumulative); ``t`` in seconds
    since the run started."""

    t: float
    n: int
    reward: float
    exact: float


@dataclass
class ScorerSamples:
    """The samples of one run, in time order, counted from ``t0`` (``time.time()``)."""

    t0: float = field(default_factory=time.time)
    samples: list[Sample] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.samples)

    @property
    def last(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def record(self, snap: dict[str, Any]) -> None:
        """Add the scorers' counters of a `sluice.monitor.snapshot`."""
        n = reward = exact = 0.0
        for wid, w in snap["workers"].items():
            if wid.startswith("scorer/"):
                n += w.get("reward_n", 0)
                reward += w.get("reward_sum", 0.0)
                exact += w.get("part_sums", {}).get("exact_match", 0.0)
        if self.samples and n < self.samples[-1].n:
            return  # a scorer left (its heartbeat is gone): its counts are not lost work
        self.samples.append(Sample(time.time() - self.t0, int(n), reward, exact))

    def recent(self, window_n: int = 256) -> tuple[float | None, float | None]:
        """Mean sampled reward and exact match over roughly the last ``window_n``
        completions (from cumulative scorer counters; includes filtered groups)."""
        if len(self.samples) < 2:
            return None, None
        last = self.samples[-1]
        ref = next((s for s in reversed(self.samples) if last.n - s.n >= window_n),
                   self.samples[0])
        dn = last.n - ref.n
        if dn <= 0:
            return None, None
        return (last.reward - ref.reward) / dn, (last.exact - ref.exact) / dn

    def first_reward(self, min_n: int = 64) -> float | None:
        """Mean sampled reward of the first sample with at least ``min_n`` completions."""
        return next((s.reward / s.n for s in self.samples if s.n >= min_n), None)

    def curve(self, window_n: int = 128) -> list[tuple[float, float, float]]:
        """``(t, reward, exact)`` at each sample, each the mean over the last
        ``window_n`` completions before it (the reward plot)."""
        pts = []
        for i in range(1, len(self.samples)):
            b = self.samples[i]
            a = next((s for s in reversed(self.samples[:i]) if b.n - s.n >= window_n),
                     self.samples[0])
            dn = b.n - a.n
            if dn > 0:
                pts.append((b.t, (b.reward - a.reward) / dn, (b.exact - a.exact) / dn))
        return pts
