"""Read-only views of a run: `snapshot` (for `sluice status`) and `tail` (follow a stream),
and the two commands on them (`status_command`, `tail_command`).

The monitor never writes. `snapshot` reads state and both consumer groups of each lane in
one MULTI, so the conservation equation it reports is checked on one instant of the bus
(of each lane, with `bus.partitions` > 1: a group never leaves its lane):

    cursor == retired + in_flight,
    in_flight = generating + Σ_streams (undelivered lag + pending)

where ``generating`` counts groups admitted but not yet appended to ``rollouts``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
from redis.exceptions import ResponseError

from pipeline.bus.client import Bus
from pipeline.bus.codec import DecodeError, decode_entry
from pipeline.bus.keys import ARCHIVERS_GROUP, RETIRE_REASONS, SCORERS_GROUP, TRAINERS_GROUP, Keys
from pipeline.bus.lanes import add_states
from pipeline.bus.replies import decode_reply, group_view, merge_views
from pipeline.bus.schema import RolloutGroup, RunFinished, ScoredGroup, WeightsPublished
from pipeline.config import Config
from pipeline.runtime import connected

PIPELINE_GROUPS = (("rollouts", SCORERS_GROUP), ("scored", TRAINERS_GROUP))


_dec = decode_reply


def lease_summary(raw: dict[Any, Any], now_ms: int) -> dict[str, dict[str, Any]]:
    """The ``leases`` hash (cursor -> ``owner|deadline_ms``, Redis server time) per owner:
    how many cursors it holds and its oldest lease's deadline in seconds from ``now_ms``
    (negative: expired, waiting for a takeover). A malformed value counts under "?"."""
    out: dict[str, dict[str, Any]] = {}
    for value in raw.values():
        owner, _, deadline = _dec(value).rpartition("|")
        try:
            left_s = (int(deadline) - now_ms) / 1000
        except ValueError:
            owner, left_s = owner or "?", None
        row = out.setdefault(owner or "?", {"count": 0, "oldest_deadline_s": None})
        row["count"] += 1
        if left_s is not None and (row["oldest_deadline_s"] is None
                                   or left_s < row["oldest_deadline_s"]):
            row["oldest_deadline_s"] = left_s
    return dict(sorted(out.items()))


LANE_STREAMS = ("rollouts", "scored", "dlq")


async def _read_lane(bus: Bus, k: Keys) -> list[Any]:
    """One lane in one MULTI: state, stream lengths, both groups, leases, server time."""
    pipe = await bus.transaction(k.state)
    pipe.hgetall(k.state)
    for name in LANE_STREAMS:
        pipe.xlen(k.stream(name))
    for name, group in PIPELINE_GROUPS:
        pipe.xinfo_groups(k.stream(name))
        pipe.xinfo_consumers(k.stream(name), group)
    pipe.hgetall(k.leases)
    pipe.time()
    return list(await pipe.execute(raise_on_error=False))


def _merge_consumers(lists: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A consumer's rows of every lane as one: pending summed, the least idle time."""
    out: dict[str, dict[str, Any]] = {}
    for rows in lists:
        for c in rows:
            row = out.setdefault(str(c.get("name")), dict(c))
            if row is not c:
                row["pending"] = int(row.get("pending", 0)) + int(c.get("pending", 0))
                row["idle"] = min(int(row.get("idle", 0)), int(c.get("idle", 0)))
    return list(out.values())


async def snapshot(bus: Bus) -> dict[str, Any]:
    """Streams, groups, consumers, workers, leases, state and the conservation check.

    Each lane (`bus.partitions`) is read in one MULTI. A group lives in one lane from
    admission to retirement, so the equation holds lane by lane on one instant of each,
    and their sum is the run's."""
    lanes = [await _read_lane(bus, k) for k in bus.lanes.keys]
    global_state = {_dec(a): int(b) for a, b in (await bus.r.hgetall(bus.keys.state)).items()}
    state = add_states(global_state, [{_dec(a): int(b) for a, b in (res[0] or {}).items()}
                                      for res in lanes])
    lengths: dict[str, Any] = {}
    for j, name in enumerate(LANE_STREAMS):
        got = [res[1 + j] for res in lanes]
        lengths[name] = None if any(isinstance(v, Exception) for v in got) else \
            sum(int(v) for v in got)
    try:
        lengths["control"] = int(await bus.r.xlen(bus.keys.control))
    except ResponseError as e:
        lengths["control"] = e
    groups: dict[str, Any] = {}
    in_streams: int | None = 0
    for i, (name, group) in enumerate(PIPELINE_GROUPS):
        views = [group_view(res[4 + 2 * i], group) for res in lanes]
        view = merge_views(views)
        cons = _merge_consumers([[] if isinstance(res[5 + 2 * i], ResponseError)
                                 else [_dec(c) for c in res[5 + 2 * i]] for res in lanes])
        lag = view.lag if view.exists else None
        if lag is None and view.exists:
            in_streams = None  # Redis cannot tell the lag (entries were deleted)
        elif in_streams is not None:
            in_streams += int(lag or 0) + view.pending
        groups[f"{name}/{group}"] = {"lag": lag, "pending": view.pending, "consumers": cons,
                                     "exists": view.exists}
    # the archive's group (archive.enabled): its lag is how far the archive is behind,
    # not work in flight, so it stays out of the conservation equation
    arch = merge_views([group_view(res[4 + 2 * PIPELINE_GROUPS.index(("scored", TRAINERS_GROUP))],
                                   ARCHIVERS_GROUP) for res in lanes])
    if arch.exists:
        groups[f"scored/{ARCHIVERS_GROUP}"] = {"lag": arch.lag, "pending": arch.pending,
                                               "consumers": [], "exists": True}
    leases_raw: dict[Any, Any] = {}
    for lane, res in enumerate(lanes):
        if not isinstance(res[-2], Exception):
            leases_raw.update({(lane, c): v for c, v in res[-2].items()})
    now = lanes[0][-1]
    now_ms = int(now[0]) * 1000 + int(now[1]) // 1000 if isinstance(now, tuple | list) \
        else int(time.time() * 1000)  # TIME refused: this machine's clock
    cursor, retired = state.get("cursor", 0), state.get("retired", 0)
    generating = state.get("generating", 0)
    in_flight = None if in_streams is None else generating + in_streams
    workers = await bus.workers()
    return {
        "t": time.time(), "state": state, "lengths": lengths, "groups": groups,
        "workers": workers, "partitions": bus.lanes.partitions,
        "leases": {} if any(isinstance(res[-2], Exception) for res in lanes)
        else lease_summary(leases_raw, now_ms),
        "conservation": {
            "cursor": cursor, "retired": retired, "in_flight": in_flight,
            "generating": generating,
            # dead-lettered entries that did not decode: apart from the books, never
            # retirements (the group id they may claim is not believed)
            "undecodable": state.get("undecodable", 0),
            "by_reason": {r: state.get(f"retired:{r}", 0) for r in RETIRE_REASONS},
            "balanced": in_flight is not None and cursor == retired + in_flight
            and retired == sum(state.get(f"retired:{r}", 0) for r in RETIRE_REASONS),
        },
    }


def render_status(snap: dict[str, Any], window: int | None = None, **view: Any) -> Any:
    """A rich renderable of a snapshot that fits the console it is printed on
    (`sluice.status_view.StatusView`; ``view``: its other fields)."""
    from sluice.status_view import StatusView

    return StatusView(snap, window, **view)


def describe(stream: str, msg: Any) -> str:
    """One line for `sluice tail`: version, lengths; the prompt and texts for `rollouts`,
    rewards, advantages and the clipped count for `scored` (whose entries carry no text:
    `sluice tail rollouts` shows it)."""
    if isinstance(msg, ScoredGroup | RolloutGroup):
        g = msg.group if isinstance(msg, ScoredGroup) else msg
        vers = np.concatenate([r.versions for r in g.rollouts]) if g.rollouts else np.zeros(1)
        lens = [len(r.completion_ids) for r in g.rollouts]
        line = (f"{g.group_id:>12}  v{int(vers.min())}-{int(vers.max())}  "
                f"len {min(lens)}-{max(lens)}")
        if isinstance(msg, ScoredGroup):
            line += (f"  clipped {sum(r.clipped for r in msg.group.rollouts)}"
                     "  rewards [" + " ".join(f"{x:.2f}" for x in msg.rewards) + "]"
                     "  adv [" + " ".join(f"{x:+.2f}" for x in msg.advantages) + "]")
        else:
            line += (f"  prompt {str(msg.prompt.get('text', ''))!r}  texts "
                     + " ".join(repr(r.text) for r in msg.rollouts[:4]))
        return line
    if isinstance(msg, WeightsPublished):
        return f"weights v{msg.version} step {msg.step} {msg.format} {msg.nbytes} B {msg.uri}"
    if isinstance(msg, RunFinished):
        return f"run finished: {msg.reason}"
    return repr(msg)


async def tail(bus: Bus, stream: str, *, from_start: bool = False, count: int | None = None,
               out: Any = print, stop: asyncio.Event | None = None) -> int:
    """Follow ``stream`` and print one decoded line per entry; returns entries printed.
    With `bus.partitions` > 1 every lane of the stream is followed (in turn: a blocking read
    cannot span the slots of a cluster); entries of different lanes interleave."""
    keys = [bus.keys.control] if stream == "control" else bus.lanes.streams(stream)
    last: dict[str, str] = {}
    for key in keys:
        last[key] = "0"
        if not from_start:
            rows = await bus.r.xrevrange(key, count=1)
            last[key] = rows[0][0].decode() if rows else "0"
    block_ms = 500 if len(keys) == 1 else None
    n = 0
    while (stop is None or not stop.is_set()) and (count is None or n < count):
        got = 0
        for key in keys:
            resp = await bus.retrying(lambda key=key: bus.r.xread(
                {key: last[key]}, block=block_ms, count=50), "tail", stop)
            for _s, items in resp or []:
                for entry_id, fields in items:
                    last[key] = entry_id.decode()
                    got += 1
                    if stream == "dlq":
                        f = _dec({k: v for k, v in fields.items() if not k.startswith(b"orig:")})
                        out(f"{last[key]}  dlq  {f.get('role')}  {f.get('reason')}")
                    else:
                        try:
                            out(f"{last[key]}  {describe(stream, decode_entry(fields))}")
                        except DecodeError as e:
                            out(f"{last[key]}  <undecodable: {e}>")
                    n += 1
                    if count is not None and n >= count:
                        return n
        if not got and block_ms is None:
            await asyncio.sleep(0.2)
    return n


def status_command(cfg: Config, as_json: bool, watch_s: float, wide: bool = False) -> int:
    """`sluice status`: one `snapshot` (as JSON, or rendered), or with ``watch_s`` a
    rendered one refreshed every ``watch_s`` seconds until Ctrl-C. Each look runs in an
    event loop of its own and so connects afresh (a bus belongs to the loop it was made
    in). The view fits the terminal (`sluice.status_view`: its width, and on a terminal
    its height; ``COLUMNS`` / ``LINES`` override them); ``--watch`` keeps the looks of
    the last `RATE_WINDOW_S` so rates are recent (`sluice.status_cells`)."""
    from collections import deque

    from rich.console import Console
    from rich.live import Live

    from sluice.status_cells import RATE_WINDOW_S, earlier_beats

    async def once() -> dict[str, Any]:
        async with connected(cfg, role="monitor") as bus:
            return await snapshot(bus)

    if as_json:
        print(json.dumps(asyncio.run(once()), default=str, indent=1))
        return 0
    console = Console()
    view = {"heartbeat_s": cfg.bus.heartbeat_s, "run": cfg.run.name, "wide": wide,
            "fit_height": console.is_terminal and not wide}
    if not watch_s:
        console.print(render_status(asyncio.run(once()), cfg.trainer.window, **view))
        return 0
    history: deque[dict[str, Any]] = deque()
    with Live(console=console, auto_refresh=False) as live:
        try:
            while True:
                snap = asyncio.run(once())
                while history and snap["t"] - history[0]["t"] > RATE_WINDOW_S + watch_s:
                    history.popleft()
                live.update(render_status(snap, cfg.trainer.window, **view,
                                          earlier=earlier_beats(history, snap)), refresh=True)
                history.append(snap)
                time.sleep(watch_s)
        except KeyboardInterrupt:
            return 0


def tail_command(cfg: Config, stream: str, from_start: bool, count: int | None) -> int:
    """`sluice tail`: `tail` to stdout, one flushed line per entry, until ``count``
    entries or Ctrl-C (exit 0 either way)."""
    async def go() -> None:
        async with connected(cfg, role="monitor") as bus:
            await tail(bus, stream, from_start=from_start, count=count,
                       out=lambda s: print(s, flush=True))

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        pass
    return 0
