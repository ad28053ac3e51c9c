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

With ``environment.tools`` a generator's beat also carries ``tools``: per tool its
cumulative ``calls``, ``failures`` and summed ``latency_s`` (`workers.environments.tools`),
next to its cumulative ``completions``. `RolloutMeter.update` reports what changed since
the trainer's previous read, summed over generators. A generator's counts run from its
own start, so in a fresh run its first beat counts in full (the calls of the groups the
first step trained were made before the trainer's first read: a baseline there would
drop them); a trainer that ``resumed`` from a checkpoint takes each generator's first
beat as its baseline instead (a trainer process before it may have reported those
counts). A count that went down is a new process, whose counts are all new:

- ``tools/<name>/calls`` and ``tools/<name>/failures`` per tool (0 in a step without
  calls, once the tool was reported), ``tools/<name>/latency_s`` the mean seconds per
  call (only in a step with calls);
- TRL's two series under TRL's names: ``tools/call_frequency`` (calls per completion,
  over the completions generators finished meanwhile; absent when none) and
  ``tools/failure_frequency`` (failures per call; 0.0 without calls, as in TRL).

TRL computes its two over the batch it trains on; here they are over the calls made
between two trainer steps, by any generator, whatever became of the groups (a group that
died or was filtered still called its tools). Beats are written every ``bus.heartbeat_s``,
so calls show in the step after the beat that carries them; in a fresh run, the sum over
steps is every call the generators reported by the last read (exact).

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


def _tool_counts(x: Any) -> dict[str, tuple[int, int, float]] | None:
    """A beat's ``tools`` map as name -> (calls, failures, latency_s); None when absent or
    not of that shape (an older generator, a foreign writer: no series, no crash)."""
    if not isinstance(x, Mapping):
        return None
    out: dict[str, tuple[int, int, float]] = {}
    for name, v in x.items():
        if not isinstance(name, str) or not isinstance(v, Mapping):
            return None
        c, f, lat = v.get("calls"), v.get("failures"), v.get("latency_s")
        if not (isinstance(c, int) and isinstance(f, int) and isinstance(lat, int | float)):
            return None
        out[name] = (c, f, float(lat))
    return out


@dataclass
class RolloutMeter:
    window_s: float = 60.0
    seen: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    """Generator id -> its distinct beats (time s, tokens), oldest first, spanning at
    least ``window_s`` once it has run that long."""
    tool_counts: dict[str, tuple[int, dict[str, tuple[int, int, float]]]] = field(
        default_factory=dict)
    """Generator id -> its completions and per-tool (calls, failures, latency_s) at the
    previous read: the baseline of the next deltas."""
    tool_names: list[str] = field(default_factory=list)
    """Every tool a generator reported, in first-seen order (their series run on at 0)."""
    resumed: bool = False
    """True once the trainer resumed from a checkpoint: a generator's first beat is then a
    baseline, not new counts (module docstring)."""

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
        out.update(self._tools(beats))
        return out

    def _tools(self, beats: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
        """The ``tools/*`` series (module docstring) since the previous read."""
        d_completions = 0
        delta: dict[str, list[float]] = {}  # name -> [calls, failures, latency_s]
        for wid, beat in beats.items():
            now = _tool_counts(beat.get("tools"))
            done = beat.get("completions")
            if now is None or not isinstance(done, int):
                continue
            for name in now:
                if name not in self.tool_names:
                    self.tool_names.append(name)
            before = self.tool_counts.get(wid)
            self.tool_counts[wid] = (done, now)
            if before is None:
                if self.resumed:
                    continue  # its first beat after a resume: the baseline
                before = (0, {})  # a fresh run: everything since the generator started
            prev_done, prev = before
            restarted = done < prev_done or any(
                n in prev and now[n][0] < prev[n][0] for n in now)
            if restarted:
                prev_done, prev = 0, {}
            d_completions += done - prev_done
            for name, (c, f, lat) in now.items():
                pc, pf, plat = prev.get(name, (0, 0, 0.0))
                acc = delta.setdefault(name, [0, 0, 0.0])
                acc[0] += c - pc
                acc[1] += f - pf
                acc[2] += lat - plat
        for gone in set(self.tool_counts) - set(beats):
            self.tool_counts.pop(gone)
        if not self.tool_names:
            return {}
        out: dict[str, float] = {}
        for name in self.tool_names:
            c, f, lat = delta.get(name, (0, 0, 0.0))
            out[f"tools/{name}/calls"] = float(c)
            out[f"tools/{name}/failures"] = float(f)
            if c > 0:
                out[f"tools/{name}/latency_s"] = max(lat, 0.0) / c
        calls = sum(v[0] for v in delta.values())
        failures = sum(v[1] for v in delta.values())
        if d_completions > 0:
            out["tools/call_frequency"] = calls / d_completions
        out["tools/failure_frequency"] = failures / calls if calls > 0 else 0.0
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
