"""TRL's ``rollout/*`` series, from the generators' heartbeats, for the trainer's step row.

TRL's async trainer logs, every step, how many requests its rollout workers have in
flight (``rollout/concurrency``), how many they may have (``rollout/concurrency_cap``) and
how fast they generate (``rollout/generated_tok_s``). In sluice those live in other
processes: each generator's heartbeat (`workers.generator.Generator.info`) carries its
engine's per-server ``inflight`` and ``caps`` (vLLM engines; the in-process engine has
neither) and its running count of generated completion ``tokens``, stamped with the
beat's wall time ``t``. The trainer reads the generator heartbeats once per step and
`RolloutMeter.update` turns them into the three series:

- ``rollout/concurrency`` = Σ over generators and their servers of ``inflight``;
- ``rollout/concurrency_cap`` = Σ of ``caps``; both absent when no generator reports
  them (the in-process engine);
- ``rollout/generated_tok_s`` = Σ over generators of Δtokens / Δt between the last two
  distinct beats seen of each, on its own clock (a beat's ``t`` is its own writer's).
  Steps are often faster than beats (``bus.heartbeat_s``): a generator whose beat has not
  moved since the previous update keeps the rate of its last two beats, so the series
  does not flicker to 0 between beats; a generator that is alive but idle beats with an
  unchanged count and shows 0. A generator counts once two of its beats were seen; one
  whose count went down (a new process under the same id: counters start at 0) counts
  from that beat on; one absent from the beats (gone, its beat expired) is forgotten.
  Absent until some generator has a rate.

Pure: no Redis, no clock; the trainer hands in what it read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def _sum_values(x: Any) -> float | None:
    if not isinstance(x, Mapping) or not x:
        return None
    vals = [float(v) for v in x.values() if isinstance(v, int | float)]
    return sum(vals) if vals else None


@dataclass
class RolloutMeter:
    seen: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Generator id -> (beat time s, tokens) of the newest beat seen."""
    rates: dict[str, float] = field(default_factory=dict)
    """Generator id -> tokens/s between its last two distinct beats."""

    def update(self, beats: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
        """The ``rollout/*`` series for the generator heartbeats ``beats`` (id -> beat)."""
        out: dict[str, float] = {}
        running: list[float] = []
        caps: list[float] = []
        for wid, beat in beats.items():
            engine = beat.get("engine")
            if isinstance(engine, Mapping):
                if (n := _sum_values(engine.get("inflight"))) is not None:
                    running.append(n)
                if (c := _sum_values(engine.get("caps"))) is not None:
                    caps.append(c)
            t, tokens = beat.get("t"), beat.get("tokens")
            if isinstance(t, int | float) and isinstance(tokens, int):
                self._beat(wid, float(t), tokens)
        for gone in set(self.seen) - set(beats):
            self.seen.pop(gone)
            self.rates.pop(gone, None)
        if running:
            out["rollout/concurrency"] = sum(running)
        if caps:
            out["rollout/concurrency_cap"] = sum(caps)
        if self.rates:
            out["rollout/generated_tok_s"] = sum(self.rates.values())
        return out

    def _beat(self, wid: str, t: float, tokens: int) -> None:
        prev = self.seen.get(wid)
        if prev is not None and t <= prev[0]:
            return  # the same beat as last time: keep its rate
        if prev is not None and tokens >= prev[1]:
            self.rates[wid] = (tokens - prev[1]) / (t - prev[0])
        else:  # first sight, or a new process under the same id: no rate yet
            self.rates.pop(wid, None)
        self.seen[wid] = (t, tokens)
