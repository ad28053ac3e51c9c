"""`sluice status`'s layout (`sluice.status_view`, `sluice.status_cells`) as pure functions of
a snapshot and a terminal size: printed through `sluice.monitor.render_status` on a rich
console of that size, as the command prints it. The snapshots are modelled on one taken
during a quick-start run (`sluice up examples/copy.toml`: its heartbeats' fields and
values)."""

from __future__ import annotations

import copy
import io
import re
from typing import Any

import pytest
from rich.cells import cell_len
from rich.console import Console

from sluice.monitor import render_status

ROLES = ("trainer", "generator", "scorer", "evaluator", "archiver")
WORKER_ID = re.compile(r"\b(?:trainer|generator|scorer|evaluator|archiver)/[^\s,()]+")


def beat(t: float, up_s: float, **info: Any) -> dict[str, Any]:
    return {"pid": 8700, "host": "vm", "t": t - 0.3, "healthy": True, "reconnects": 0,
            "started": t - 0.3 - up_s, "metrics": "http://127.0.0.1:37963/metrics", **info}


def quickstart(generators: int = 2, scorers: int = 2, archiver: bool = False,
               name: str = "{role}-{i}") -> dict[str, Any]:
    """A snapshot of a quick-start run 44 s in (trainer at step 367)."""
    t = 1796626170.0
    ws: dict[str, dict[str, Any]] = {
        "trainer/" + name.format(role="trainer", i=0): beat(
            t, 44.0, step=367, version=367, max_steps=6000, ranks=1, stale=0, duplicates=0,
            dead=0, trained_groups=2936, skipped_steps=0, failed_steps=0, archive_paused=0,
            weight_fallbacks=0, waits={"scored": {"p50": 0.0532, "p99": 0.1244, "n": 2048}},
            last={"step": 367, "groups": 8, "reward": 0.103, "loss": 0.0525,
                  "staleness_mean": 1.0, "staleness_max": 1.0}),
        "evaluator/vm-8740": beat(t, 30.0, version=351, reward_errors=0, reward_restarts=0,
                                  last={"version": 351, "n": 256, "reward": 0.176,
                                        "pass@1": 0.0}),
    }
    for i in range(generators):
        ws["generator/" + name.format(role="generator", i=i)] = beat(
            t, 30.0, version=366, groups=1472, completions=11776, tokens=88000,
            dead_groups=0, skipped_prompts=0, gate_wait_s=20.7, gate_closed=True,
            rejected_weights=0, taken_over=0, lost_leases=0, leases=8,
            engine={"healthy": True}, waiting_for_weights=False, weights_behind=0,
            weights_wait_s=0.0, waits={"admission": {"p50": 0.1531, "p99": 0.582, "n": 65}})
    for i in range(scorers):
        ws["scorer/" + name.format(role="scorer", i=i)] = beat(
            t, 39.0, scored=1507, filtered=0, dead=0, reward_errors=0, teacher_errors=0,
            reclaimed=0, trimmed=0, reward_sum=531.0, reward_n=12056,
            part_sums={"copy_reward": 531.0, "exact_match": 0.0}, busy=False,
            reward_restarts=0, waits={"rollouts": {"p50": 0.0056, "p99": 0.0098, "n": 576}})
    if archiver:
        ws["archiver/archiver-0"] = beat(t, 35.0, archived=2900, files=3, skipped=0,
                                         recovered=0, buffered=44, last_file="x.parquet")
    consumers = [{"name": ws_id.split("/", 1)[1], "pending": 0, "idle": 108}
                 for ws_id in ws if ws_id.startswith("scorer/")]
    return {
        "t": t, "state": {"version": 367, "cursor": 2952, "retired": 2936, "generating": 8},
        "lengths": {"rollouts": 2944, "scored": 2944, "dlq": 0, "control": 368},
        "groups": {"rollouts/scorers": {"lag": 0, "pending": 0, "consumers": consumers,
                                        "exists": True},
                   "scored/trainers": {"lag": 8, "pending": 8, "exists": True, "consumers": [
                       {"name": "trainer-0", "pending": 8, "idle": 212}]}},
        "workers": ws, "partitions": 1,
        "leases": {wid: {"count": 8, "oldest_deadline_s": 41.5} for wid in ws
                   if wid.startswith("generator/")},
        "conservation": {"cursor": 2952, "retired": 2936, "in_flight": 16, "generating": 8,
                         "undecodable": 0, "balanced": True,
                         "by_reason": {"trained": 2936, "filtered": 0, "stale": 0, "dead": 0}},
    }


def crowd(name: str = "{role}-{i}") -> dict[str, Any]:
    """Four generators, twenty scorers (the 14th unhealthy), an archiver."""
    snap = quickstart(generators=4, scorers=20, archiver=True, name=name)
    snap["workers"]["scorer/" + name.format(role="scorer", i=13)]["healthy"] = False
    return snap


def long_ids() -> dict[str, Any]:
    """Kubernetes-like names (host-pid of a pod): ids of 36-40 characters."""
    return quickstart(name="copy-{role}-7d9f8b6c4-x2x9z-12345")


def view(snap: dict[str, Any], width: int, height: int | None = None,
         wide: bool = False) -> list[str]:
    """What `sluice status` prints on a terminal of ``width`` x ``height`` (None: output
    to a file, no height)."""
    console = Console(file=io.StringIO(), width=width, height=height or 10_000, record=True)
    console.print(render_status(snap, 16, heartbeat_s=2.0, run="copy", wide=wide,
                                fit_height=height is not None))
    return console.export_text().splitlines()


def row(lines: list[str], wid: str) -> str:
    got = [x for x in lines if x.startswith(wid + " ")]
    assert len(got) == 1, (wid, lines)
    return got[0]


def test_at_80_columns_each_worker_is_one_line_with_its_id_and_its_role_counters() -> None:
    snap = quickstart()
    lines = view(snap, 80, 24)
    assert len(lines) <= 23, "\n".join(lines)  # the 24th line is the shell's prompt
    r = {wid: row(lines, wid) for wid in snap["workers"]}
    gen, sc = r["generator/generator-0"], r["scorer/scorer-1"]
    assert "49.1 grp/s" in gen and "gate wait 69%" in gen  # 1472 / 30 s, 20.7 / 30 s
    assert "38.6 grp/s" in sc and "errors 0" in sc and "dead 0" in sc  # 1507 / 39 s
    trainer = r["trainer/trainer-0"]  # 2936 groups / 8 per step / 44 s
    assert "step 367" in trainer and "8.34 step/s" in trainer and "stale 1.00" in trainer
    assert "pass@1 0.000" in r["evaluator/vm-8740"]


@pytest.mark.parametrize("width", [40, 60, 80, 100, 120, 160, 240])
@pytest.mark.parametrize("make", [quickstart, crowd, long_ids])
@pytest.mark.parametrize("wide", [False, True])
def test_no_line_passes_the_width_and_no_worker_id_is_cut(width: int, make: Any,
                                                          wide: bool) -> None:
    snap = make()
    ids = set(snap["workers"])
    for height in (None, 24):
        lines = view(snap, width, height, wide)
        assert max(cell_len(x) for x in lines) <= width, "\n".join(lines)
        shown = set(WORKER_ID.findall("\n".join(lines)))
        if max(map(len, ids)) <= width:
            assert shown <= ids, f"cut: {shown - ids}\n" + "\n".join(lines)
        if height is None:  # nothing folded: every worker has its line(s)
            assert all(wid in "".join(lines) for wid in ids), "\n".join(lines)


@pytest.mark.parametrize("name", ["{role}-{i}", "copy-{role}-7d9f8b6c4-x2x9z-{i}"])
def test_every_role_is_on_the_first_screen_of_80x24_with_many_workers(name: str) -> None:
    snap = crowd(name)
    sick = "scorer/" + name.format(role="scorer", i=13)
    lines = view(snap, 80, 24)
    assert len(lines) <= 23, "\n".join(lines)
    for role in ROLES:
        assert any(x.startswith(role + "/") for x in lines), (role, "\n".join(lines))
    at = lines.index(sick) if sick in lines else lines.index(row(lines, sick))
    assert " NO " in lines[at] + lines[at + 1]  # the unhealthy one stays in view
    folded = next(x for x in lines if x.startswith("+ ") and "more scorers" in x)
    shown = sum(x.startswith("scorer/") for x in lines)
    assert f"+ {20 - shown} more scorers ({20 - shown} ok;" in folded and "--wide" in folded
    assert len(view(snap, 80, None)) > 24  # to a file: every worker
    assert sum(x.startswith("scorer/") for x in view(snap, 80, 24, wide=True)) == 20


def test_160_columns_show_more_than_80_on_the_same_lines() -> None:
    snap = quickstart(archiver=True)
    narrow, broad = view(snap, 80, 24), view(snap, 160, 48)
    assert len(broad) <= len(narrow)  # more on each line, never more lines
    for wid in snap["workers"]:
        a, b = row(narrow, wid), row(broad, wid)
        assert len(b.split("  ")) > len(a.split("  ")), (a, b)
    assert "tok/s" in row(broad, "generator/generator-0")
    assert "loss 0.0525" in row(broad, "trainer/trainer-0")
    assert "worst of 2" in "\n".join(broad) and "worst of 2" not in "\n".join(narrow)


def test_the_header_is_one_line_per_fact_at_80_columns() -> None:
    snap = quickstart()
    snap["conservation"]["by_reason"] = {"trained": 872, "filtered": 0, "stale": 0, "dead": 0}
    lines = view(snap, 80, 24)
    starts = [x.split()[0] for x in lines[:5]]
    assert starts == ["run", "gate", "books", "retired", "streams"], lines[:6]
    assert lines[3].split(None, 1)[1] == "trained 872  filtered 0  stale 0  dead 0"
    assert "cursor 2952 == retired 2936 + in_flight 16" in lines[2] and "balanced" in lines[2]
    assert lines[1].split(None, 1)[1] == "CLOSED  16 in flight of window 16"


def test_wide_shows_every_heartbeat_field_each_workers_waits_and_the_consumers() -> None:
    snap = quickstart()
    lines = view(snap, 80, 24, wide=True)
    text = "\n".join(lines)
    assert max(map(len, lines)) <= 80
    for key in ("weights_wait_s=0.0", "gate_closed=True", "teacher_errors=0", "reconnects=0",
                "duplicates=0", "pid 8700@vm", "http://127.0.0.1:37963/metrics"):
        assert key in text, key
    assert sum("admission (gate)" in x for x in lines) == 2  # one per generator
    assert "consumers  rollouts/scorers  scorer-0 (0, 0.1s idle)" in text
    assert "generator/generator-1 8 (oldest expires in 41.5s)" in text


def test_an_id_longer_than_the_table_has_room_for_keeps_its_row_below_it() -> None:
    snap = quickstart(generators=1, scorers=1)
    wid = "scorer/" + "x" * 70  # longer than a 60-column line
    snap["workers"][wid] = snap["workers"].pop("scorer/scorer-0")
    lines = view(snap, 60, None)
    assert max(map(len, lines)) <= 60
    assert wid in "".join(lines)  # split over lines, every character shown
    at = next(i for i, x in enumerate(lines) if x.startswith("scorer/"))
    assert "grp/s" in lines[at + 2] and "errors 0" in lines[at + 2]


def test_alerts_show_at_any_width_and_health_says_late_exited_and_no() -> None:
    snap = quickstart()
    g = snap["workers"]["generator/generator-0"]
    g.update(waiting_for_weights=True, weights_behind=3,
             engine={"healthy": False, "servers_up": 1, "servers": 2})
    snap["workers"]["scorer/scorer-0"]["t"] = snap["t"] - 30  # 15 heartbeat periods ago
    snap["workers"]["scorer/scorer-1"]["exited"] = True
    lines = view(snap, 80, 24)
    assert max(map(len, lines)) <= 80
    r = row(lines, "generator/generator-0")
    assert "3 versions behind" in r and "servers 1/2" in r
    assert " late " in row(lines, "scorer/scorer-0") and "30s" in row(lines, "scorer/scorer-0")
    assert " exited " in row(lines, "scorer/scorer-1")


def test_rates_from_one_look_and_from_an_earlier_heartbeat_of_the_same_process() -> None:
    from sluice.status_cells import earlier_beats, rate

    def groups(b: dict[str, Any]) -> float:
        return float(b["groups"])

    now = {"t": 130.0, "started": 100.0, "groups": 600}
    assert rate(now, None, groups) == (20.0, 30.0)  # since it started
    before = {"t": 120.0, "started": 100.0, "groups": 500}
    assert rate(now, before, groups) == (10.0, 10.0)  # the last 10 s
    restarted = {"t": 120.0, "started": 50.0, "groups": 9000}  # another process
    assert rate(now, restarted, groups) == (20.0, 30.0)
    assert rate({"t": 1.0, "started": 1.0, "groups": 0}, None, groups) == (None, None)
    history = [{"workers": {"g": b}} for b in (
        {"t": 105.0, "started": 100.0}, {"t": 121.0, "started": 100.0},
        {"t": 125.0, "started": 100.0})]
    assert earlier_beats(history, {"workers": {"g": now}}, window_s=10) == {"g": history[1]
                                                                           ["workers"]["g"]}
    assert earlier_beats(history, {"workers": {"g": {**now, "started": 1.0}}}) == {}


def test_watch_rates_are_recent_and_say_so() -> None:
    snap = quickstart()
    before = copy.deepcopy(snap)
    for b in before["workers"].values():
        b["t"] -= 5.0
    before["workers"]["generator/generator-0"]["groups"] -= 50  # 10 groups/s lately
    console = Console(file=io.StringIO(), width=80, record=True)
    console.print(render_status(snap, 16, earlier=before["workers"]))
    lines = console.export_text().splitlines()
    assert "10.0 grp/s" in row(lines, "generator/generator-0")
    assert "rates over the last 10s" in next(x for x in lines if x.startswith("worker "))
    assert "rates since each worker started" in next(
        x for x in view(snap, 80) if x.startswith("worker "))


def test_flow_splits_a_part_wider_than_a_line_and_cuts_nothing() -> None:
    from sluice.status_view import fact, plain

    parts = [("a" * 30, ""), ("b" * 100, ""), ("c", "")]
    lines = plain(fact("label", parts, 50))
    assert max(map(len, lines)) <= 50
    assert "".join("".join(x.split()) for x in lines) == "label" + "a" * 30 + "b" * 100 + "c"


def test_the_readme_shows_a_quick_start_view_that_fits_80_columns() -> None:
    """The README's quick start shows `sluice status` of a quick-start run at 80 columns,
    as printed: it must stay a view that fits (every role, one line each, <= 80)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("\n```\nrun ", 1)[1].split("```")[0]
    lines = ("run " + block).rstrip("\n").splitlines()
    assert len(lines) <= 23 and max(map(len, lines)) <= 80, lines
    for role in ("trainer", "generator", "scorer", "evaluator"):
        assert any(x.startswith(role + "/") for x in lines), role
