"""Check a run's whole delivery history from its ledgers (`pipeline.bus.ledger`).

`audit` verifies, over every event every process wrote:
1. every admitted group retires at most once, with one reason (exactly once when the run
   is drained), and nothing retires that was never admitted;
2. no group is appended, handed off or trained twice, and no trained group was older than
   ``max_staleness`` versions when it was trained;
3. advantages were computed over complete groups: every scored (and trained) group has
   ``num_generations`` completions, and its reward advantages sum to zero (centred on the
   group). With on-policy distillation a teacher's per-token term is added on top; it is
   not centred (no baseline: its mean is minus the reverse KL), so ``adv_sum`` is the
   reward part alone and the audit checks that part (`workers.scorer`);
4. the gate's counters in Redis equal the ledger's counts (``cursor`` = admitted,
   ``retired`` and ``retired:<reason>`` = retirements, ``generating`` = admitted and not
   yet appended or abandoned, ``undecodable`` = entries dead-lettered that did not
   decode: never retirements, whatever group id they named);
5. (with a live view of Redis, `live_view`) every admitted group not yet retired is
   somewhere: leased to a generator, or an unacknowledged entry of ``rollouts`` or
   ``scored``; and no group is in flight twice, or in flight after it retired. This is
   "nothing lost" without having to drain the pipeline first;
6. (with ``archive``: the run archived from its start, ``archive.enabled``) no group is
   archived twice or archived without having been handed off, and, with a live view,
   every group handed off to ``scored`` is archived, skipped by the archiver as
   undecodable, or still unacknowledged by the ``archivers`` group: nothing is lost from
   the archive.
The ledger of a process killed by ``kill -9`` ends where it died. A state change it had
started (an ``intent`` line with no events after it) is resolved from the op's result
stored in Redis (`live_view` reads it): present and truthy = it happened, absent = it
never ran. Without a live view such an intent is reported as unresolved. A cursor it had
admitted without writing the line is found in the leases (or as another generator's
``takeover``).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.bus.client import Bus
from pipeline.bus.codec import peek_group_id
from pipeline.bus.keys import (
    ARCHIVERS_GROUP,
    RETIRE_REASONS,
    SCORERS_GROUP,
    TRAINERS_GROUP,
    Keys,
)
from pipeline.bus.ledger import acted, read_ledgers

ADV_SUM_TOL = 1e-3  # per completion: float32 advantages of a centred group sum to ~1e-7


@dataclass
class AuditReport:
    events: int = 0
    admitted: int = 0
    retired: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0
    taken_over: int = 0
    trained: int = 0
    from_redis: int = 0  # events of killed processes recovered from stored op results
    archived: int = 0  # groups the archiver wrote (rule 6)
    archive_skipped: int = 0  # undecodable `scored` entries the archiver acked unwritten
    undecodable: int = 0  # entries dead-lettered that did not decode (not retirements)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        head = (f"{self.events} events, {self.admitted} groups admitted, "
                f"{sum(self.retired.values())} retired ({dict(self.retired)}), "
                f"{self.in_flight} in flight, "
                + (f"{self.undecodable} undecodable entries dead-lettered, "
                   if self.undecodable else "")
                + f"{self.taken_over} taken over after a "
                f"generator died, {self.trained} trained, {self.from_redis} events recovered "
                "from Redis"
                + (f", {self.archived} archived" if self.archived else "")
                + (f" ({self.archive_skipped} undecodable skipped)"
                   if self.archive_skipped else ""))
        if self.ok:
            return f"OK: {head}"
        shown = "\n  ".join(self.violations[:50])
        more = f"\n  ... and {len(self.violations) - 50} more" if len(self.violations) > 50 else ""
        return f"FAILED ({len(self.violations)} violations): {head}\n  {shown}{more}"


@dataclass
class LiveView:
    """Where the run's unfinished groups are in Redis right now."""

    state: dict[str, int]
    leased: set[int]  # admitted cursors not yet appended
    entries: dict[str, list[str]]  # group id -> unacknowledged stream entries holding it
    # (role, op id) -> stored result (None: absent); op keys are per role (`Keys.op`)
    ops: dict[tuple[str, str], Any] = field(default_factory=dict)
    # group ids of `scored` entries the `archivers` group has not acknowledged (never
    # delivered to it, or pending on an archiver); None: no lane has that group
    unarchived: set[str] | None = None


def pending_intents(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(role, op id) of intents (in `read_ledgers` rows) with no event after them: calls
    whose process may have died between the call and its ledger line (or that did
    nothing). A ledger's role is the role whose op namespace holds the call's result."""
    return [(r["role"], r["op"]) for r in _unresolved(rows)]


def _unresolved(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    recorded = {r["op"] for r in rows if r["ev"] != "intent" and "op" in r}
    return [r for r in rows if r["ev"] == "intent" and r["op"] not in recorded]


async def live_view(bus: Bus, ops: list[tuple[str, str]] | None = None) -> LiveView:
    """Read the state hash, the leases, every unacknowledged (pending or not yet
    delivered) entry of ``rollouts`` and ``scored``, and the stored results of ``ops``
    (`pending_intents`). Take it with the roles stopped or paused: a moving pipeline can
    show a group between two places."""
    entries: dict[str, list[str]] = defaultdict(list)
    unarchived: set[str] | None = None
    for k in bus.lanes.keys:
        await _unacked(bus, k, entries)
        if await bus.r.exists(k.scored) and any(
                g["name"].decode() == ARCHIVERS_GROUP for g in await bus.r.xinfo_groups(k.scored)):
            held: dict[str, list[str]] = defaultdict(list)
            await _unacked_by(bus, k.scored, ARCHIVERS_GROUP, held)
            unarchived = (unarchived or set()) | set(held)
    leased: set[int] = set()
    for lane, k in enumerate(bus.lanes.keys):
        leased |= {bus.lanes.join(lane, int(c)) for c in await bus.r.hkeys(k.leases)}
    results: dict[tuple[str, str], Any] = {}
    for role, op in ops or []:
        # a lane's scripts store their results in that lane; a trainer step's retire is
        # one script per lane under one op, each returning the ids it retired
        found = [json.loads(raw) for k in bus.lanes.keys
                 if (raw := await bus.r.get(k.op(role, op))) is not None]
        if len(found) > 1 and all(isinstance(f, list) for f in found):
            results[(role, op)] = [i for f in found for i in f]
        else:
            results[(role, op)] = found[0] if found else None
    return LiveView(await bus.state(), leased, dict(entries), results, unarchived)


async def _unacked(bus: Bus, k: Keys, entries: dict[str, list[str]]) -> None:
    """Every entry of lane ``k``'s ``rollouts`` and ``scored`` not yet acknowledged by the
    group that consumes it, by group id (undelivered or pending, and on whom)."""
    for stream, group in ((k.rollouts, SCORERS_GROUP), (k.scored, TRAINERS_GROUP)):
        if await bus.r.exists(stream):
            await _unacked_by(bus, stream, group, entries)


async def _unacked_by(bus: Bus, stream: str, group: str, entries: dict[str, list[str]]
                      ) -> None:
    """The entries of ``stream`` that ``group`` has not acknowledged, by group id."""
    info = {g["name"].decode(): g for g in await bus.r.xinfo_groups(stream)}
    last = info[group]["last-delivered-id"].decode() if group in info else "0-0"
    short = stream.rsplit(":", 1)[-1]
    rows = await bus.r.xrange(stream, min=f"({last}", max="+") if last != "0-0" else \
        await bus.r.xrange(stream)
    for entry_id, fields in rows:
        entries[peek_group_id(fields) or "?"].append(f"{short} {entry_id.decode()} undelivered")
    if group in info:
        for p in await bus.r.xpending_range(stream, group, min="-", max="+", count=1 << 20):
            for entry_id, fields in await bus.r.xrange(stream, p["message_id"],
                                                       p["message_id"]):
                entries[peek_group_id(fields) or "?"].append(
                    f"{short} {entry_id.decode()} pending on {p['consumer'].decode()}")


_Events = dict[str, list[dict[str, Any]]]  # ledger rows by event name


@dataclass
class _Groups:
    """What the ledgers say became of each group (rule 1), for the later rules."""

    admitted: dict[str, int]  # group id -> cursor, from ``admitted`` or ``takeover``
    retirements: dict[str, list[str]]  # group id -> "<reason> by <role>/<consumer>" each time
    unlogged: set[int]  # leased cursors no ledger admitted (its generator was killed)

    @property
    def lost(self) -> list[str]:
        """Admitted groups not (yet) retired, in order of admission."""
        return [g for g in self.admitted if g not in self.retirements]


def audit(run_dir: Path | str, state: dict[str, int] | None = None, *,
          num_generations: int | None = None, drained: bool = False,
          live: LiveView | None = None,
          rows: list[dict[str, Any]] | None = None, archive: bool = False) -> AuditReport:
    """Audit ``run_dir``'s ledgers; ``state`` is the run's Redis ``state`` hash (rule 4 is
    skipped without it; ``live`` supplies it too, and enables rule 5); ``drained`` demands
    that nothing is left in flight; ``archive``: the run archived every group from its
    start (rule 6). ``rows`` are the ledgers if already read (a long run's ledgers are
    large: read them once for `pending_intents` and the audit)."""
    if live is not None:
        state = live.state
    rows = read_ledgers(run_dir) if rows is None else rows
    rep = AuditReport(events=len(rows))
    rows = [*rows, *_resolve_intents(rows, live, rep)]
    by_ev: _Events = defaultdict(list)
    for r in rows:
        by_ev[r["ev"]].append(r)

    rep.undecodable = sum(1 for r in by_ev["dead"] if r.get("undecodable"))
    groups = _check_retired_once(by_ev, live, drained, rep)
    _check_nothing_twice(by_ev, rep)
    _check_complete_groups(by_ev, num_generations, rep)
    if state is not None:
        _check_gate_counters(by_ev, groups, state, rep)
    if live is not None:
        _check_in_flight(groups, live, rep, _claimed(by_ev))
    _check_archived(by_ev, live if archive else None, rep)
    if by_ev["torn"]:
        rep.violations.append(
            f"{len(by_ev['torn'])} torn ledger lines (a process killed mid-write)")
    return rep


def _check_retired_once(by_ev: _Events, live: LiveView | None, drained: bool,
                        rep: AuditReport) -> _Groups:
    """Rule 1: every admitted group retires at most once, with one reason (exactly once
    when ``drained``), and nothing retires that was never admitted. Fills ``rep``'s counts
    of groups admitted, taken over, retired and in flight."""
    bad = rep.violations.append
    admitted: dict[str, int] = {}
    for r in by_ev["admitted"] + by_ev["takeover"]:
        admitted.setdefault(r["gid"], r["cursor"])
    known = set(admitted.values())
    # cursors admitted by a generator killed before it wrote the line: still leased
    unlogged = {c for c in (live.leased if live else set()) if c not in known}
    rep.admitted = len(admitted) + len(unlogged)
    rep.taken_over = len(by_ev["takeover"])
    retirements: dict[str, list[str]] = defaultdict(list)
    for ev in RETIRE_REASONS:
        for r in by_ev[ev]:
            if ev == "dead" and not r.get("retired", True):
                continue  # an entry with no group id (never admitted) dead-lettered
            retirements[r["gid"]].append(f"{ev} by {r['role']}/{r['consumer']}")
            rep.retired[ev] += 1
    for gid, how in retirements.items():
        if len(how) > 1:
            bad(f"group {gid} retired {len(how)} times: {how}")
        if gid not in admitted:
            bad(f"group {gid} retired ({how[0]}) but never admitted")
    groups = _Groups(admitted, retirements, unlogged)
    lost = groups.lost
    rep.in_flight = len(lost)
    if drained and lost:
        bad(f"{len(lost)} admitted groups never retired (lost): {sorted(lost)[:10]}")
    return groups


def _check_nothing_twice(by_ev: _Events, rep: AuditReport) -> None:
    """Rule 2: no group is appended (``emitted``), handed off or trained twice, and no
    trained group was older than ``max_staleness`` versions when it was trained."""
    bad = rep.violations.append
    for ev in ("emitted", "handed_off", "trained"):
        for gid, n in Counter(r["gid"] for r in by_ev[ev]).items():
            if n > 1:
                bad(f"group {gid} {ev.replace('_', ' ')} {n} times")
    rep.trained = len(by_ev["trained"])
    for r in by_ev["trained"]:
        age = r["version"] - r["min_version"]
        if age > r["max_staleness"]:
            bad(f"group {r['gid']} trained at version {r['version']} with a token of version "
                f"{r['min_version']} (staleness {age} > {r['max_staleness']})")


def _check_complete_groups(by_ev: _Events, num_generations: int | None,
                           rep: AuditReport) -> None:
    """Rule 3: advantages were computed over complete groups: every scored and trained
    group has ``num_generations`` completions (default: the most common size), and each
    scored group's reward advantages (``adv_sum``) sum to zero."""
    bad = rep.violations.append
    sizes = Counter(r["n"] for r in by_ev["scored"] + by_ev["trained"])
    expected = num_generations or (sizes.most_common(1)[0][0] if sizes else None)
    for r in by_ev["scored"] + by_ev["trained"]:
        if r["n"] != expected:
            bad(f"group {r['gid']} {r['ev']} with {r['n']} completions, expected {expected}")
    for r in by_ev["scored"]:
        if abs(r["adv_sum"]) > ADV_SUM_TOL * r["n"]:
            bad(f"group {r['gid']}: reward advantages sum to {r['adv_sum']}, not 0 (not "
                "centred on the group)")


def _check_gate_counters(by_ev: _Events, groups: _Groups, state: dict[str, int],
                         rep: AuditReport) -> None:
    """Rule 4: the gate's counters in Redis ``state`` equal the ledger's counts: ``cursor``
    = admitted, ``retired`` and ``retired:<reason>`` = retirements (as rule 1 counted them),
    ``generating`` = admitted and not yet appended or abandoned."""
    appended = {r["gid"] for r in by_ev["emitted"]}
    appended |= {r["gid"] for ev in ("scored", "handed_off", "filtered") for r in by_ev[ev]}
    appended |= {r["gid"] for r in by_ev["dead"] if r["role"] == "scorer" and r["gid"]}
    abandoned = {r["gid"] for r in by_ev["dead"] if r["role"] == "generator"}
    generating = len(set(groups.admitted) - appended - abandoned)
    expect = {"cursor": rep.admitted, "retired": sum(rep.retired.values()),
              "generating": generating + len(groups.unlogged),
              "undecodable": rep.undecodable,
              **{f"retired:{k}": rep.retired[k] for k in RETIRE_REASONS}}
    for k, v in expect.items():
        if state.get(k, 0) != v:
            rep.violations.append(
                f"Redis state {k} = {state.get(k, 0)} but the ledger counts {v}")


def _claimed(by_ev: _Events) -> dict[str, str]:
    """Group id -> the id of an undecodable dead-lettered entry that claimed it."""
    return {r["claimed"]: str(r.get("id")) for r in by_ev["dead"]
            if r.get("undecodable") and isinstance(r.get("claimed"), str)}


def _check_in_flight(groups: _Groups, live: LiveView, rep: AuditReport,
                     claimed: dict[str, str]) -> None:
    """Rule 5: every admitted group not yet retired is somewhere in ``live``: leased to a
    generator, or an unacknowledged entry of ``rollouts`` or ``scored``; and no group is in
    flight twice, after it retired, or without ever being admitted. A lost group that an
    undecodable entry claimed (``claimed``) is named with it: its producer wrote what its
    consumer rejects, and the group holds a slot of the window for good."""
    bad = rep.violations.append
    admitted, retirements = groups.admitted, groups.retirements
    for gid in groups.lost:
        if not live.entries.get(gid, []) and admitted[gid] not in live.leased:
            why = (f" (an undecodable entry {claimed[gid]} claiming it was dead-lettered: "
                   "its writer appended what its reader rejects)" if gid in claimed else "")
            bad(f"group {gid} (cursor {admitted[gid]}) admitted, never retired, and "
                f"neither leased nor in a stream: lost{why}")
    for gid, where in live.entries.items():
        if gid == "?":
            continue
        if len(where) > 1:
            bad(f"group {gid} in flight {len(where)} times: {where}")
        if gid in retirements:
            bad(f"group {gid} retired ({retirements[gid][0]}) but still in flight: {where}")
        if gid not in admitted:
            bad(f"group {gid} in flight but never admitted: {where}")


def _check_archived(by_ev: _Events, live: LiveView | None, rep: AuditReport) -> None:
    """Rule 6: no group archived twice or archived without a hand-off; with ``live`` (the
    run archived from its start) every handed-off group is archived, skipped as
    undecodable, or still unacknowledged by the ``archivers`` group in Redis."""
    bad = rep.violations.append
    archived = Counter(r["gid"] for r in by_ev["archived"])
    rep.archived = len(archived)
    rep.archive_skipped = len(by_ev["archive_skipped"])
    handed = {r["gid"] for r in by_ev["handed_off"]}
    for gid, n in archived.items():
        if n > 1:
            bad(f"group {gid} archived {n} times")
        if gid not in handed:
            bad(f"group {gid} archived but never handed off to scored")
    if live is None or live.unarchived is None:
        return
    skipped = {r["gid"] for r in by_ev["archive_skipped"]}
    lost = sorted(handed - set(archived) - skipped - live.unarchived)
    if lost:
        bad(f"{len(lost)} groups handed off to scored are neither archived nor waiting for "
            f"the archiver in Redis (lost from the archive): {lost[:10]}")


def _resolve_intents(rows: list[dict[str, Any]], live: LiveView | None,
                     rep: AuditReport) -> list[dict[str, Any]]:
    """Events of intents that have none recorded: from Redis's stored op results when
    ``live`` has them; else none if the process wrote later lines (it survived the call,
    which therefore did nothing), else a violation (it died during the call)."""
    last_line = {}
    for r in rows:
        last_line[r.get("_file")] = max(last_line.get(r.get("_file"), 0), r.get("_n", 0))
    out: list[dict[str, Any]] = []
    for r in _unresolved(rows):
        if live is not None and (r["role"], r["op"]) in live.ops:
            for p in acted(r["planned"], live.ops[(r["role"], r["op"])]):
                out.append({**p, "role": r["role"], "consumer": r["consumer"], "t": r["t"],
                            "op": r["op"], "from_redis": True})
                rep.from_redis += 1
        elif r.get("_n", 0) == last_line.get(r.get("_file")):
            rep.violations.append(
                f"{r['role']}/{r['consumer']} died during op {r['op']} and its outcome is "
                "unknown: audit with a live Redis (sluice audit --config)")
    return out
