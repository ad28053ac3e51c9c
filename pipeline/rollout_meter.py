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
- ``rollout/generated_tok_s`` = Σ over generators of Δtokens / Δt over each generator's
  beats of the last ``window_s`` (60 s) seconds, on its own clock (a beat's ``t`` is its
  own writer's). A generator adds a group's tokens to its count when the group is done,
  so over one beat interval (``bus.heartbeat_s``, 2 s) the count mostly stands still and
  then jumps: the window spans many groups. It runs from the oldest beat seen within the
  window (or just before it) to the newest, so a generator counts once two of its beats
  were seen; one alive but idle shows 0; one whose count went down (a new process under
  the same id: counters start at 0) starts over; one absent from the beats (gone, its
  beat expired) is forgotten. Absent until some generator has a rate.

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
    window_s: float = 60.0
    seen: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    """Generator id -> its distinct beats (time s, tokens), oldest first, spanning at
    least ``window_s`` once it has run that long."""

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
        rates = [(h[-1][1] - h[0][1]) / (h[-1][0] - h[0][0])
                 for h in self.seen.values() if len(h) > 1]
        if running:
            out["rollout/concurrency"] = sum(running)
        if caps:
            out["rollout/concurrency_cap"] = sum(caps)
        if rates:
            out["rollout/generated_tok_s"] = sum(rates)
        return out

    def _beat(self, wid: str, t: float, tokens: int) -> None:
        history = self.seen.setdefault(wid, [])
        if history and t <= history[-1][0]:
            return  # the same beat as last time
        if history and tokens < history[-1][1]:
            history.clear()  # a new process under the same id: its count restarted
        history.append((t, tokens))
        # keep the newest beat at or before the window's start, and everything after it
        while len(history) > 2 and history[1][0] <= t - self.window_s:
            history.pop(0)
