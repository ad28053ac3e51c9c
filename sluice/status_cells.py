"""What `sluice status` says about one worker: its health, its age and its role's counters
as short self-labelled cells ("12.3 grp/s", "errors 0"), most important first, from the
heartbeat the worker writes (`pipeline.runtime.Heartbeat`: ``t``, ``started``,
``healthy``, ``exited``, ``pid``, ``host``, ``metrics``, ``waits`` and the role's own
``info()``).

Rates. A heartbeat carries cumulative counters, its own time ``t`` and ``started`` (when
the worker's heartbeat began, i.e. the process's start). A rate is read two ways:

- one look (`sluice status`): counter / (t - started), the average since the worker
  started (a restarted worker starts from 0 again, so this never mixes two processes);
- with an earlier heartbeat of the same process (``--watch`` keeps the looks of the last
  `RATE_WINDOW_S`, `earlier_beats`): Δcounter / Δt between the two heartbeats, the
  recent rate.

The trainer's steps/s: its ``step`` does not start at 0 in a resumed process, so one look
counts this process's steps as ``trained_groups`` / the groups of its last step.

Invariant: every function here is pure (a heartbeat dict in, text out) and never raises on
a missing or mistyped field: a worker of an older or newer version shows "-" there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

Cell = tuple[str, str]
"""(text, rich style); the style "" is plain."""

RATE_WINDOW_S = 10.0
"""`--watch` computes rates over (at most) the last this many seconds of heartbeats."""

LATE_AFTER_BEATS = 3.0
"""A heartbeat older than this many ``bus.heartbeat_s`` marks its worker "late" (hung,
stopped by a signal, or cut off from Redis: its own health flag cannot say so)."""


def num(x: Any, default: float = 0.0) -> float:
    """``x`` as a float; ``default`` for None, a string or a NaN (never raises)."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return default
    return default if math.isnan(v) else v


def role_of(wid: str) -> str:
    """A worker id is ``role/name`` (`pipeline.runtime.worker_id`)."""
    return wid.split("/", 1)[0]


def fmt_age(age_s: float) -> str:
    """Seconds as at most 6 characters: 0.4s, 12s, 3m05s, 2h03m, 4d02h."""
    if age_s < 10:
        return f"{max(age_s, 0.0):.1f}s"
    if age_s < 60:
        return f"{age_s:.0f}s"
    m, s = divmod(int(age_s), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h < 24 else f"{h // 24}d{h % 24:02d}h"


def health(w: dict[str, Any], now: float, heartbeat_s: float | None) -> Cell:
    """exited (its last beat said so), NO (it says it is unhealthy: Redis or its engine),
    late (no beat for `LATE_AFTER_BEATS` periods), else ok."""
    if w.get("exited"):
        return "exited", "dim"
    if not w.get("healthy"):
        return "NO", "bold red"
    if heartbeat_s and now - num(w.get("t"), now) > LATE_AFTER_BEATS * heartbeat_s:
        return "late", "yellow"
    return "ok", "green"


def rate(w: dict[str, Any], earlier: dict[str, Any] | None,
         count: Callable[[dict[str, Any]], float]) -> tuple[float | None, float | None]:
    """(per second, over how many seconds) of ``count(heartbeat)``: between ``earlier``
    and ``w`` when ``earlier`` is an older beat of the same process, else since the
    worker started; (None, None) when neither spans any time."""
    t = num(w.get("t"))
    if earlier is not None and earlier.get("started") == w.get("started"):
        dt = t - num(earlier.get("t"), t)
        if dt > 0:
            return (count(w) - count(earlier)) / dt, dt
    life = t - num(w.get("started"), t)
    return (count(w) / life, life) if life > 0 else (None, None)


def _r(x: float | None, unit: str) -> str:
    if x is None:
        return f"- {unit}"
    return f"{x:.2f} {unit}" if x < 10 else f"{x:.1f} {unit}" if x < 1000 else f"{x:.0f} {unit}"


def _n(label: str, x: Any, bad_if_positive: bool = False) -> Cell:
    v = int(num(x))
    return f"{label} {v}", "red" if bad_if_positive and v > 0 else ""


def _f(label: str, x: Any, spec: str = ".3f") -> Cell:
    return (f"{label} -" if x is None or isinstance(x, str) else
            f"{label} {num(x):{spec}}"), ""


def _groups_scored(w: dict[str, Any]) -> float:
    return num(w.get("scored")) + num(w.get("filtered")) + num(w.get("dead"))


def _trainer_steps(w: dict[str, Any]) -> float:
    per_step = num((w.get("last") or {}).get("groups"))
    return num(w.get("trained_groups")) / per_step if per_step > 0 else 0.0


GROUPS_MOVED: dict[str, Callable[[dict[str, Any]], float]] = {
    "generator": lambda b: num(b.get("groups")), "scorer": _groups_scored,
    "archiver": lambda b: num(b.get("archived"))}
"""The groups a worker of each role has moved (its rate is the role's grp/s)."""


def generator_cells(w: dict[str, Any], earlier: dict[str, Any] | None) -> list[Cell]:
    groups_s, _ = rate(w, earlier, GROUPS_MOVED["generator"])
    gate_share, _ = rate(w, earlier, lambda b: num(b.get("gate_wait_s")))
    tok_s, _ = rate(w, earlier, lambda b: num(b.get("tokens")))
    return [(_r(groups_s, "grp/s"), ""),
            ("gate wait -" if gate_share is None else f"gate wait {min(gate_share, 1):.0%}",
             "yellow" if gate_share is not None and gate_share > 0.5 else ""),
            _n("leases", w.get("leases")), (_r(tok_s, "tok/s"), ""),
            _n("groups", w.get("groups")), _n("dead", w.get("dead_groups"), True),
            _n("lost leases", w.get("lost_leases"), True),
            _n("taken over", w.get("taken_over")),
            _n("rejected weights", w.get("rejected_weights"), True),
            _n("skipped prompts", w.get("skipped_prompts"))]


def scorer_cells(w: dict[str, Any], earlier: dict[str, Any] | None) -> list[Cell]:
    groups_s, _ = rate(w, earlier, GROUPS_MOVED["scorer"])
    n = num(w.get("reward_n"))
    return [(_r(groups_s, "grp/s"), ""), _n("errors", w.get("reward_errors"), True),
            _n("dead", w.get("dead"), True), _n("filtered", w.get("filtered")),
            _f("reward", num(w.get("reward_sum")) / n if n else None),
            _n("scored", w.get("scored")), _n("restarts", w.get("reward_restarts"), True),
            _n("reclaimed", w.get("reclaimed")), ("busy" if w.get("busy") else "idle", "")]


def trainer_cells(w: dict[str, Any], earlier: dict[str, Any] | None) -> list[Cell]:
    last = w.get("last") or {}
    if earlier is not None and earlier.get("started") == w.get("started") \
            and num(w.get("t")) > num(earlier.get("t")):
        steps_s, _ = rate(w, earlier, lambda b: num(b.get("step")))
    else:
        steps_s, _ = rate(w, None, _trainer_steps)
    return [(f"step {w.get('step', '-')}", "bold"), (_r(steps_s, "step/s"), ""),
            _f("stale", last.get("staleness_mean"), ".2f"), _f("reward", last.get("reward")),
            _f("loss", last.get("loss"), ".4f"), _n("trained", w.get("trained_groups")),
            _n("dropped stale", w.get("stale")), _n("failed steps", w.get("failed_steps"), True),
            _n("skipped steps", w.get("skipped_steps")),
            _n("weight fallbacks", w.get("weight_fallbacks"), True),
            _n("ranks", w.get("ranks"))]


def eval_metric(last: dict[str, Any]) -> str | None:
    """The evaluator's headline figure: pass@1 when it reports one, else reward."""
    return next((k for k in ("pass@1", "reward") if k in last), None)


def evaluator_cells(w: dict[str, Any], earlier: dict[str, Any] | None) -> list[Cell]:
    last = w.get("last") or {}
    metric = eval_metric(last)
    head = _f(metric or "pass@1", last.get(metric) if metric else None)
    return [(head[0], "bold"), (f"of v{last.get('version', '-')}", ""),
            _f("reward", last.get("reward")) if metric != "reward" else ("", ""),
            _n("errors", w.get("reward_errors"), True),
            _n("restarts", w.get("reward_restarts"), True)]


def archiver_cells(w: dict[str, Any], earlier: dict[str, Any] | None) -> list[Cell]:
    groups_s, _ = rate(w, earlier, GROUPS_MOVED["archiver"])
    return [(_r(groups_s, "grp/s"), ""), _n("archived", w.get("archived")),
            _n("buffered", w.get("buffered")), _n("files", w.get("files")),
            _n("skipped", w.get("skipped")), _n("recovered", w.get("recovered"))]


ROLE_CELLS: dict[str, Callable[[dict[str, Any], dict[str, Any] | None], list[Cell]]] = {
    "generator": generator_cells, "scorer": scorer_cells, "trainer": trainer_cells,
    "evaluator": evaluator_cells, "archiver": archiver_cells}
"""Each role's cells, most important first: the first two or three are what an operator
reads at a glance (rate and the role's trouble counter); a narrow terminal shows a
prefix of them (`sluice.status_view`)."""

ROLE_ORDER = ("trainer", "generator", "scorer", "evaluator", "archiver")
"""The order the workers table lists roles in (unknown roles after these)."""

SHOWN_KEYS = frozenset({
    "pid", "host", "t", "started", "healthy", "exited", "version", "metrics", "waits",
    "last", "part_sums", "engine", "groups", "completions", "tokens", "dead_groups",
    "skipped_prompts", "gate_wait_s", "rejected_weights", "taken_over", "lost_leases",
    "leases", "scored", "filtered", "dead", "reward_errors", "reward_sum", "reward_n",
    "busy", "reward_restarts", "reclaimed", "step", "trained_groups", "stale",
    "failed_steps", "skipped_steps", "weight_fallbacks", "ranks", "archived", "buffered",
    "files", "skipped", "recovered", "max_steps", "waiting_for_weights", "weights_behind"})
"""Heartbeat keys the cells above (or `alerts`) already show; `--wide` adds every other
scalar as ``key=value``, so nothing the heartbeat carries is hidden from it."""


def alerts(w: dict[str, Any]) -> list[Cell]:
    """What is wrong with a worker and shows whatever the width: a generator waiting
    for weights (more than ``trainer.max_staleness`` versions behind: it admits nothing),
    vLLM servers out of rotation."""
    out: list[Cell] = []
    if w.get("waiting_for_weights"):
        out.append((f"{int(num(w.get('weights_behind')))} versions behind", "bold red"))
    eng = w.get("engine")
    if isinstance(eng, dict) and "servers" in eng \
            and num(eng.get("servers_up")) < num(eng.get("servers")):
        out.append((f"servers {int(num(eng.get('servers_up')))}/{int(num(eng['servers']))}",
                    "bold red"))
    return out


def extra_cells(w: dict[str, Any], pending: int | None) -> list[Cell]:
    """`--wide`'s remainder: pending entries, engine details, reconnects and every other
    scalar the heartbeat carries."""
    out: list[Cell] = []
    if pending is not None:
        out.append((f"pending {pending}", ""))
    eng = w.get("engine")
    if isinstance(eng, dict) and "servers" in eng:
        caps = ",".join(str(c) for c in (eng.get("caps") or {}).values())
        out.append((f"servers {int(num(eng.get('servers_up')))}/{int(num(eng['servers']))}"
                    f" caps {caps} retries {int(num(eng.get('retries')))}", ""))
    return out + [(f"{k}={v}", "") for k, v in w.items()
                  if k not in SHOWN_KEYS and not isinstance(v, dict | list)]


def where(w: dict[str, Any]) -> list[Cell]:
    """The last two cells of every role: the process (pid@host) and its /metrics URL."""
    return [(f"pid {w.get('pid', '-')}@{w.get('host', '-')}", "dim"),
            (str(w.get("metrics") or ""), "dim")]


def cells(wid: str, w: dict[str, Any], earlier: dict[str, Any] | None,
          pending: int | None = None) -> tuple[list[Cell], list[Cell]]:
    """Worker ``wid``'s (role cells + `where`, `extra_cells`): the first list has the
    same length for every worker of the role (so its cells align in columns; one may be
    empty text); an unknown role has only `where` there and shows its scalar counters
    among the extra cells."""
    fn = ROLE_CELLS.get(role_of(wid))
    return (fn(w, earlier) if fn else []) + where(w), extra_cells(w, pending)


def earlier_beats(history: Sequence[dict[str, Any]], snap: dict[str, Any],
                  window_s: float = RATE_WINDOW_S) -> dict[str, dict[str, Any]]:
    """For each worker of ``snap``, the oldest heartbeat of the same process (same
    ``started``) among the earlier snapshots in ``history`` that is older than its
    current one by at most ``window_s``: what `rate` compares with under ``--watch``."""
    out: dict[str, dict[str, Any]] = {}
    for wid, w in snap.get("workers", {}).items():
        t = num(w.get("t"))
        for old in history:
            b = old.get("workers", {}).get(wid)
            if b is not None and b.get("started") == w.get("started") \
                    and 0 < t - num(b.get("t"), t) <= window_s:
                out[wid] = b
                break
    return out
