"""What the ledgers say about groups: the trainer's steps, and each group's life.

`step_plan` is the composition of every step of the *surviving* history: what the
trainer's final weights were trained on, in order. The trainer writes, before it acks
a step's groups, an ``intent`` line whose planned ``trained`` events are the step's groups
in the order they were trained (`trainer.reader.Reader.retire_trained`), after the step
was taken and published: that line, not the ``trained`` events (which list only the
groups whose ack took effect), is the step. A restarted trainer writes ``resumed`` with
the step of the checkpoint it loaded; the steps it had taken after that checkpoint were
lost with the process (their groups count as trained, their updates are gone,
docs/guarantees.md), so they leave the plan, and the steps taken again after the resume
replace them.

`lives` gathers each group's events across every role's ledger into one `Life`: who
admitted it and when, each hop, how it retired; the dispositions table and `sluice
trace` read it. Disposition: ``trained`` (step N; ``survived`` False when that step was
lost to a trainer restart), ``stale``, ``filtered``, ``dead``, or ``in_flight`` (not
retired when the ledgers were read).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pipeline.bus.ledger import RETIRING


@dataclass
class Step:
    """One optimizer step of the surviving history."""

    step: int
    version: int  # the version the step trained at (its published one is version + 1)
    gids: list[str]


def step_plan(rows: list[dict[str, Any]]) -> list[Step]:
    """The surviving steps, in order, from `pipeline.bus.ledger.read_ledgers` rows (module
    docstring)."""
    steps: dict[int, Step] = {}
    for r in rows:
        if r.get("role") != "trainer":
            continue
        if r["ev"] == "resumed":
            for s in [s for s in steps if s > int(r["step"])]:
                del steps[s]
        elif r["ev"] == "intent" and str(r.get("op", "")).startswith("trained:"):
            planned = r["planned"]
            s = int(planned[0]["step"])
            steps[s] = Step(s, int(planned[0]["version"]), [p["gid"] for p in planned])
    return [steps[s] for s in sorted(steps)]


@dataclass
class Life:
    """One group's events, by role (each a ledger row), and how it ended."""

    gid: str
    events: list[dict[str, Any]] = field(default_factory=list)
    disposition: str = "in_flight"
    step: int | None = None
    slot: int | None = None  # its place in the step's composition
    version: int | None = None  # the version it was trained at
    staleness: int | None = None
    survived: bool = True

    def first(self, ev: str) -> dict[str, Any] | None:
        return next((r for r in self.events if r["ev"] == ev), None)

    def t(self, ev: str) -> float | None:
        r = self.first(ev)
        return None if r is None else float(r["t"])


def lives(rows: list[dict[str, Any]]) -> dict[str, Life]:
    """Every group the ledgers name, with its events in time order and its disposition."""
    out: dict[str, Life] = {}
    for r in rows:
        gid = r.get("gid")
        if not gid or r["ev"] in ("intent", "torn"):
            continue
        out.setdefault(gid, Life(gid)).events.append(r)
    for life in out.values():
        for r in life.events:
            if r["ev"] in RETIRING and (r["ev"] != "dead" or r.get("retired", True)):
                life.disposition = r["ev"]
                if r["ev"] in ("trained", "stale"):
                    life.version = int(r["version"])
                    life.staleness = int(r["version"]) - int(r["min_version"])
                if r["ev"] == "trained":
                    life.step = int(r["step"])
                break
    plan = step_plan(rows)
    kept = {g: (s, i) for s in plan for i, g in enumerate(s.gids)}
    for gid, (st, slot) in kept.items():  # where it was trained in the surviving history
        if gid in out:
            out[gid].step, out[gid].slot, out[gid].version = st.step, slot, st.version
    for life in out.values():
        if life.disposition == "trained" and life.gid not in kept:
            life.survived = False
    return out


DISPOSITION_SCHEMA = pa.schema([
    ("gid", pa.string()), ("disposition", pa.string()), ("step", pa.int64()),
    ("slot", pa.int64()), ("version", pa.int64()), ("staleness", pa.int64()),
    ("survived", pa.bool_()), ("retired_by", pa.string()), ("generator", pa.string()),
    ("scorer", pa.string()), ("t_admitted", pa.float64()), ("t_emitted", pa.float64()),
    ("t_scored", pa.float64()), ("t_handed_off", pa.float64()), ("t_retired", pa.float64()),
    ("t_archived", pa.float64()), ("archived", pa.bool_()), ("file", pa.string()),
])
"""``dispositions.parquet``: one row per group the ledgers name (module docstring)."""


def disposition_table(all_lives: dict[str, Life]) -> pa.Table:
    """The dispositions table of `lives` (groups in admission order, by time)."""
    rows = []
    for life in sorted(all_lives.values(), key=lambda x: (x.events[0]["t"], x.gid)):
        retired = next((r for r in life.events if r["ev"] == life.disposition), None)
        adm = life.first("admitted") or life.first("takeover")
        arch = life.first("archived")
        scored = life.first("scored")
        rows.append({
            "gid": life.gid, "disposition": life.disposition, "step": life.step,
            "slot": life.slot, "version": life.version, "staleness": life.staleness,
            "survived": life.survived,
            "retired_by": None if retired is None else f"{retired['role']}/{retired['consumer']}",
            "generator": None if adm is None else adm["consumer"],
            "scorer": None if scored is None else scored["consumer"],
            "t_admitted": None if adm is None else adm["t"], "t_emitted": life.t("emitted"),
            "t_scored": life.t("scored"), "t_handed_off": life.t("handed_off"),
            "t_retired": None if retired is None else retired["t"],
            "t_archived": None if arch is None else arch["t"], "archived": arch is not None,
            "file": None if arch is None else arch.get("file")})
    return pa.Table.from_pylist(rows, schema=DISPOSITION_SCHEMA)


def plan_from_dispositions(table: pa.Table) -> list[Step]:
    """The surviving steps as a dispositions table records them (an archive without its
    run directory)."""
    by_step: dict[int, list[tuple[int, str, int]]] = defaultdict(list)
    for r in table.to_pylist():
        if r["disposition"] == "trained" and r["survived"] and r["step"] is not None:
            by_step[int(r["step"])].append((int(r["slot"]), r["gid"], int(r["version"])))
    return [Step(s, sorted(v)[0][2], [g for _, g, _ in sorted(v)])
            for s, v in sorted(by_step.items())]
