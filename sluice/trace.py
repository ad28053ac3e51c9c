"""`sluice trace RUN GID`: the life of one group, from the ledgers and the archive.

Every hop a group took, in time order, each with the wait since the previous one:
admitted (the generator, its cursor and lease), taken over (a dead generator's lease),
emitted to ``rollouts`` (generation), scored (the scorer, its rewards and advantages),
handed off to ``scored``, and how it ended: trained (step, version, staleness), stale,
filtered, dead, or still in flight; archived (the file). With an archive the token version
span of each completion, the rewards per function and the advantages come from its row.
The ledger's times are each role's clock (``time.time()``): on one machine the waits are
exact, across machines they are off by the clocks' skew.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from pipeline.archive.history import Life, lives
from pipeline.archive.store import ArchiveReadError, ArchiveStore
from pipeline.bus.ledger import read_ledgers
from pipeline.rundir import read_run

HOPS = {"admitted": "", "takeover": "lease expired, taken over",
        "emitted": "generate", "scored": "queue in rollouts + score",
        "handed_off": "hand-off", "trained": "queue in scored + step",
        "stale": "queue in scored", "duplicate": "queue in scored",
        "filtered": "score", "dead": "", "archived": "queue in scored + archive file",
        "archive_skipped": ""}
"""Each event's hop: what the time since the previous event was spent on."""


def archive_row(run_dir: Path, record: dict[str, Any] | None, life: Life
                ) -> dict[str, Any] | None:
    """The group's archive row, if the run archived it and the file reads."""
    arch = life.first("archived")
    if arch is None or record is None:
        return None
    url = record["config"].get("archive", {}).get("path") or str(run_dir / "archive")
    try:
        table = ArchiveStore(url).read(arch["file"])
    except (ArchiveReadError, OSError, ValueError):
        return None
    hit = table.filter(pc.equal(table["gid"], life.gid)).to_pylist()
    return hit[0] if hit else None


def describe(ev: dict[str, Any], row: dict[str, Any] | None, lease_s: float | None) -> str:
    """What one event says, in words."""
    e, who = ev["ev"], f"{ev['role']}/{ev['consumer']}"
    if e in ("admitted", "takeover"):
        lease = f", lease {lease_s:g} s" if lease_s else ""
        gate = f", after {ev['gate_wait_s']:.3f} s at the gate" if "gate_wait_s" in ev else ""
        return f"{who}, cursor {ev.get('cursor')}{lease}{gate}"
    if e == "emitted":
        return f"{who}, appended to rollouts (batch admitted at version {ev.get('version')})"
    if e == "scored":
        text = (f"{who}, rollouts entry {ev.get('id')}: {ev.get('n')} completions, "
                f"advantages sum {ev.get('adv_sum')}")
        if row is not None:
            parts = ", ".join(f"{p['name']} {_floats(p['values'])}" for p in row["reward_parts"])
            pad = "\n" + " " * 66
            text += (f"{pad}rewards {_floats(row['rewards'])} ({parts})"
                     f"{pad}advantages {_floats(row['advantages'])}")
        return text
    if e == "handed_off":
        return f"{who}, scored entry {ev.get('id')}"
    if e in ("trained", "stale"):
        age = int(ev["version"]) - int(ev["min_version"])
        at = f"step {ev['step']} " if e == "trained" else ""
        return (f"{who}, {at}at version {ev['version']}, oldest token v{ev['min_version']}: "
                f"staleness {age} (max {ev.get('max_staleness')})")
    if e == "dead":
        return f"{who}: {ev.get('reason', '')}"
    if e == "archived":
        return f"{who}, {ev.get('file')}" + (" (after a restart)" if ev.get("recovered") else "")
    return who


def _floats(xs: list[float]) -> str:
    return "[" + " ".join(f"{x:.3g}" for x in xs) + "]"


def trace(run_dir: Path | str, gid: str) -> dict[str, Any] | None:
    """The group's life as a dict (`render` prints it); None if no ledger names ``gid``."""
    run_dir = Path(run_dir)
    life = lives(read_ledgers(run_dir)).get(gid)
    if life is None:
        return None
    record = read_run(run_dir) if (run_dir / "run.json").is_file() else None
    lease_s = record["config"].get("generation", {}).get("lease_s") if record else None
    row = archive_row(run_dir, record, life)
    hops, prev = [], None
    for ev in life.events:
        if ev["ev"] in ("resumed",):
            continue
        hops.append({"event": ev["ev"], "t": ev["t"],
                     "wait_s": None if prev is None else round(ev["t"] - prev, 4),
                     "hop": HOPS.get(ev["ev"], ""), "detail": describe(ev, row, lease_s)})
        prev = ev["t"]
    spans = None
    if row is not None:
        spans = [[min(v), max(v)] if v else None for v in row["versions"]]
    return {"gid": gid, "disposition": life.disposition, "step": life.step,
            "staleness": life.staleness, "survived": life.survived, "hops": hops,
            "version_spans": spans, "archived": row is not None}


def render(t: dict[str, Any]) -> str:
    """The trace as text, one hop per line."""
    t0 = t["hops"][0]["t"] if t["hops"] else 0.0
    start = datetime.datetime.fromtimestamp(t0, datetime.UTC).isoformat(timespec="milliseconds")
    end = t["disposition"] + (f" at step {t['step']}" if t["step"] is not None else "")
    if t["disposition"] == "trained" and not t["survived"]:
        end += " (a step lost to a trainer restart)"
    lines = [f"group {t['gid']}: {end}; admitted {start}"]
    for h in t["hops"]:
        wait = "" if h["wait_s"] is None else f"+{h['wait_s']:.3f}s {h['hop']}"
        lines.append(f"  {h['t'] - t0:9.3f}s  {h['event']:<10} {wait:<40} {h['detail']}")
    if t["version_spans"] is not None:
        spans = " ".join(f"v{a}-v{b}" if a != b else f"v{a}" for a, b in
                         (s or (0, 0) for s in t["version_spans"]))
        lines.append(f"  token versions per completion: {spans}")
    return "\n".join(lines)


def main(run_dir: str, gid: str, as_json: bool = False) -> int:
    """Print the trace; exit 2 (with a message) when no ledger of ``run_dir`` names
    ``gid`` or it has none."""
    import sys

    if not (Path(run_dir) / "ledger").is_dir():
        print(f"sluice: {run_dir} has no ledger/ (not a run directory, or run.ledger = "
              "false)", file=sys.stderr)
        return 2
    t = trace(run_dir, gid)
    if t is None:
        print(f"sluice: group {gid!r} is unknown in {run_dir} (no ledger names it)",
              file=sys.stderr)
        return 2
    print(json.dumps(t, indent=1) if as_json else render(t))
    return 0
