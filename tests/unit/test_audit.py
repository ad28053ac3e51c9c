"""The history checker finds each kind of violation in a synthetic ledger, and passes a
clean one: a checker that cannot fail would make every fault test meaningless."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from pipeline.bus.audit import LiveView, audit, pending_intents
from pipeline.bus.ledger import Ledger, read_ledgers


def ev(e: str, gid: str | None, role: str = "scorer", **kw: Any) -> dict[str, Any]:
    return {"ev": e, "gid": gid, "role": role, "consumer": "c", "t": 0.0, **kw}


def clean_history() -> list[dict[str, Any]]:
    """Two groups: 0:1 trained, 0:2 filtered; 0:3 admitted and handed off (in flight)."""
    rows = []
    for c, gid in enumerate(("0:1", "0:2", "0:3")):
        rows += [ev("admitted", gid, "generator", cursor=c),
                 ev("emitted", gid, "generator", cursor=c),
                 ev("scored", gid, n=4, adv_sum=0.0)]
    rows += [ev("handed_off", "0:1"), ev("filtered", "0:2"), ev("handed_off", "0:3"),
             ev("trained", "0:1", "trainer", version=3, min_version=2, max_staleness=1, n=4)]
    return rows


STATE = {"cursor": 3, "retired": 2, "retired:trained": 1, "retired:filtered": 1,
         "generating": 0}


def write(tmp: Path, rows: list[dict[str, Any]]) -> Path:
    (tmp / "ledger").mkdir()
    (tmp / "ledger" / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp


def test_clean_history_passes_with_counters_and_live_view(tmp_path: Path) -> None:
    live = LiveView(STATE, set(), {"0:3": ["scored 1-0 pending on trainer-0"]})
    rep = audit(write(tmp_path, clean_history()), live=live, num_generations=4)
    assert rep.ok, rep.summary()
    assert (rep.admitted, rep.in_flight, rep.trained) == (3, 1, 1)
    assert "OK" in rep.summary()


@pytest.mark.parametrize("extra, match", [
    ([ev("stale", "0:1", "trainer")], "0:1 retired 2 times"),
    ([ev("filtered", "9:9")], "9:9 retired .* never admitted"),
    ([ev("emitted", "0:1", "generator", cursor=0)], "0:1 emitted 2 times"),
    ([ev("handed_off", "0:1")], "0:1 handed off 2 times"),
    ([ev("scored", "0:3", n=3, adv_sum=0.0)], "0:3 scored with 3 completions, expected 4"),
    ([ev("scored", "0:3", n=4, adv_sum=0.5)], "advantages sum to 0.5"),
    ([ev("trained", "0:3", "trainer", version=5, min_version=3, max_staleness=1, n=4)],
     r"staleness 2 > 1"),
    ([{"ev": "torn", "gid": None}], "torn"),
])
def test_each_violation_is_found(tmp_path: Path, extra: list[dict[str, Any]],
                                 match: str) -> None:
    rep = audit(write(tmp_path, clean_history() + extra), num_generations=4)
    assert not rep.ok
    assert any(re.search(match, v) for v in rep.violations), rep.violations


def test_drained_run_must_have_nothing_in_flight(tmp_path: Path) -> None:
    run = write(tmp_path, clean_history())
    assert audit(run).ok
    rep = audit(run, drained=True)
    assert not rep.ok and "never retired (lost): ['0:3']" in rep.violations[0]


@pytest.mark.parametrize("key, value", [("cursor", 4), ("retired", 3),
                                        ("retired:trained", 0), ("generating", 1)])
def test_counter_drift_is_found(tmp_path: Path, key: str, value: int) -> None:
    rep = audit(write(tmp_path, clean_history()), {**STATE, key: value})
    assert [v for v in rep.violations if f"Redis state {key} = {value}" in v], rep.violations


def test_generating_counts_groups_admitted_but_not_yet_appended(tmp_path: Path) -> None:
    rows = [*clean_history(), ev("admitted", "0:4", "generator", cursor=3)]
    state = {**STATE, "cursor": 4, "generating": 1}
    assert audit(write(tmp_path, rows), state).ok


@pytest.mark.parametrize("live, match", [
    (LiveView(STATE, set(), {}), "0:3 .* neither leased nor in a stream: lost"),
    (LiveView(STATE, set(), {"0:3": ["a", "b"]}), "0:3 in flight 2 times"),
    (LiveView(STATE, set(), {"0:3": ["a"], "0:1": ["b"]}), "0:1 retired .* still in flight"),
    (LiveView(STATE, set(), {"0:3": ["a"], "7:7": ["b"]}), "7:7 in flight but never admitted"),
])
def test_live_view_finds_lost_and_duplicate_groups(tmp_path: Path, live: LiveView,
                                                   match: str) -> None:
    rep = audit(write(tmp_path, clean_history()), live=live)
    assert any(re.search(match, v) for v in rep.violations), rep.violations


def test_a_leased_group_is_not_lost(tmp_path: Path) -> None:
    rows = [*clean_history(), ev("admitted", "0:4", "generator", cursor=3)]
    live = LiveView({**STATE, "cursor": 4, "generating": 1}, {3}, {"0:3": ["x"]})
    assert audit(write(tmp_path, rows), live=live).ok


def test_takeover_counts_as_admission_when_the_admitted_line_died_with_its_writer(
        tmp_path: Path) -> None:
    rows = [r for r in clean_history() if not (r["ev"] == "admitted" and r["gid"] == "0:3")]
    rows.append(ev("takeover", "0:3", "generator", cursor=2))
    rep = audit(write(tmp_path, rows), STATE)
    assert rep.ok and rep.taken_over == 1


def test_ledger_writes_one_json_line_per_event_and_off_writes_nothing(tmp_path: Path) -> None:
    led = Ledger.for_role(tmp_path, "scorer", "host/1")
    led.write("scored", "0:1", n=4)
    led.write("filtered", "0:1")
    led.close()
    off = Ledger.for_role(tmp_path, "scorer", "x", enabled=False)
    off.write("scored", "0:2")
    rows = read_ledgers(tmp_path)
    assert [(r["ev"], r["gid"], r["consumer"]) for r in rows] == [
        ("scored", "0:1", "host/1"), ("filtered", "0:1", "host/1")]
    assert len(list((tmp_path / "ledger").iterdir())) == 1


def intent(op: str, planned: list[dict[str, Any]], role: str = "trainer") -> dict[str, Any]:
    return {**ev("intent", None, role), "op": op, "planned": planned}


TRAIN_03 = {"ev": "trained", "gid": "0:3", "id": "5-0", "version": 3, "min_version": 3,
            "max_staleness": 1, "n": 4}


def write_files(tmp: Path, files: dict[str, list[dict[str, Any]]]) -> Path:
    (tmp / "ledger").mkdir()
    for name, rows in files.items():
        (tmp / "ledger" / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp


def test_an_intent_cut_off_by_kill_is_resolved_from_the_stored_op_result(
        tmp_path: Path) -> None:
    """The trainer retired 0:3 in Redis and was killed before its ledger line: the
    stored op result (the ids it acted on) restores the event exactly."""
    run = write_files(tmp_path, {"a.jsonl": clean_history(),
                                 "trainer.jsonl": [intent("trained:t:9:5-0", [TRAIN_03])]})
    state = {**STATE, "retired": 3, "retired:trained": 2}
    op = ("trainer", "trained:t:9:5-0")  # its role's op namespace, the call's op id
    rep = audit(run, live=LiveView(state, set(), {}, {op: ["5-0"]}))
    assert rep.ok, rep.violations
    assert rep.trained == 2 and rep.from_redis == 1
    # the call never ran (no stored result): nothing happened, 0:3 is still in flight
    rep = audit(run, live=LiveView(STATE, set(), {"0:3": ["x"]}, {op: None}))
    assert rep.ok and rep.trained == 1, rep.violations
    # without Redis the outcome is unknown, and the audit says so
    rep = audit(run, STATE)
    assert any("died during op trained:t:9:5-0" in v for v in rep.violations)
    # another role's result under the same op id is not the trainer's (op keys per role)
    assert pending_intents(read_ledgers(run)) == [op]
    rep = audit(run, live=LiveView(state, set(), {}, {("scorer", op[1]): ["5-0"]}))
    assert any("died during op trained:t:9:5-0" in v for v in rep.violations)


def test_an_intent_followed_by_more_lines_did_nothing(tmp_path: Path) -> None:
    rows = [intent("trained:t:9:5-0", [TRAIN_03]), ev("duplicate", "0:1", "trainer")]
    assert audit(write_files(tmp_path, {"a.jsonl": clean_history(), "t.jsonl": rows}),
                 STATE).ok


def test_a_cursor_admitted_by_a_generator_killed_before_its_line_is_found_in_the_leases(
        tmp_path: Path) -> None:
    state = {**STATE, "cursor": 4, "generating": 1}
    run = write(tmp_path, clean_history())
    assert not audit(run, state).ok  # counters drift without knowing about cursor 3
    rep = audit(run, live=LiveView(state, {3}, {"0:3": ["x"]}))
    assert rep.ok and rep.admitted == 4, rep.violations


def test_settle_writes_intent_then_only_the_events_that_happened(tmp_path: Path) -> None:
    import asyncio

    led = Ledger.for_role(tmp_path, "trainer", "trainer-0")
    planned = [{"ev": "trained", "gid": "0:1", "id": "1-0"},
               {"ev": "trained", "gid": "0:2", "id": "2-0"}]

    async def retire() -> list[str]:
        return ["2-0"]  # only the second entry's ack took effect

    assert asyncio.run(led.settle("op1", planned, retire)) == ["2-0"]
    rows = read_ledgers(tmp_path)
    assert [r["ev"] for r in rows] == ["intent", "trained"]
    assert rows[0]["planned"] == planned and rows[1]["gid"] == "0:2"
    assert rows[1]["op"] == "op1"


def test_sluice_audit_exits_0_clean_1_on_violations_2_without_a_ledger(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.cli import main

    (tmp_path / "run").mkdir()
    run = write(tmp_path / "run", clean_history())
    (run / "state.json").write_text(json.dumps({"state": STATE, "num_generations": 4}))
    assert main(["audit", str(run)]) == 0
    assert capsys.readouterr().out.startswith("OK: ")
    (run / "state.json").write_text(json.dumps({"state": {**STATE, "cursor": 9}}))
    assert main(["audit", str(run)]) == 1
    assert "Redis state cursor = 9 but the ledger counts 3" in capsys.readouterr().out
    assert main(["audit", str(tmp_path / "nowhere")]) == 2
    assert "has no ledger/ directory" in capsys.readouterr().err
