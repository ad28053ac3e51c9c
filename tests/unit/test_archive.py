"""The archive without Redis: its rows round-trip exactly, ``datasets`` loads its files, the
surviving step plan and dispositions come out of a ledger, a bad file is named with its
groups, a replay config that changes the data is refused by key, the audit counts
archived groups, and `sluice trace` reads a group's life (or says it does not know it)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.archive.format import row_of, scored_group, table_of
from pipeline.archive.history import disposition_table, lives, plan_from_dispositions, step_plan
from pipeline.archive.store import ArchiveReadError, ArchiveStore
from pipeline.bus.audit import LiveView, audit
from pipeline.bus.schema import ScoredGroup
from pipeline.config import ConfigError, load_config
from tests.helpers import make_group


def scored(gid: str, seed: int = 0) -> ScoredGroup:
    """A scored group with every optional part: candidate sets on one completion,
    per-token advantages, a reward function that gave None (NaN), and for odd seeds the
    sampler's top logprobs."""
    rng = np.random.default_rng(seed)
    g = make_group(gid).for_training()
    r = g.rollouts[1]
    r.candidate_counts = np.array([2] + [0] * (len(r.completion_ids) - 1), np.int32)
    r.candidate_ids = np.array([5, 9], np.int32)
    if seed % 2:  # the sampler's top 3 on every completion, with a token top-k cut short
        for x in g.rollouts:
            t = len(x.completion_ids)
            x.top_ids = rng.integers(0, 70, (t, 3)).astype(np.int32)
            x.top_logprobs = -rng.random((t, 3)).astype(np.float32)
            if t:
                x.top_ids[0, 2], x.top_logprobs[0, 2] = -1, -np.inf
    n = len(g.rollouts)
    return ScoredGroup(
        g, rng.random(n).astype(np.float32),
        {"copy": np.array([1, np.nan, 0.5, 0], np.float32), "len": np.zeros(n, np.float32)},
        rng.standard_normal(n).astype(np.float32), "scorer/s0", time.time(),
        [rng.standard_normal(len(x.completion_ids)).astype(np.float32) for x in g.rollouts])


def row(sg: ScoredGroup, entry_id: str = "1700000000123-0") -> dict[str, Any]:
    return row_of(sg, texts=[f"t{i}" for i in range(len(sg.group.rollouts))],
                  prompt={"text": "12=", "answer": "12"}, lane=0, entry_id=entry_id,
                  archiver="archiver-0", t_archived=time.time())


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dataclass_fields__"):
        return all(same(getattr(a, k), getattr(b, k)) for k in a.__dataclass_fields__)
    return bool(a == b)


def test_a_row_round_trips_every_field_bit_for_bit_through_a_parquet_file(tmp_path: Path
                                                                         ) -> None:
    groups = [scored(f"0:{i}", i) for i in range(5)]
    store = ArchiveStore(str(tmp_path / "archive"))
    name, size = store.write_groups("archiver-0", 1, table_of([row(g) for g in groups]))
    assert name == "part-archiver-0-00000001.parquet" and size > 0
    back = store.read(name).to_pylist()
    for g, r in zip(groups, back, strict=True):
        assert same(scored_group(r), g)  # float32 bytes, NaN, dtypes, candidate sets
        assert r["completions"] == ["t0", "t1", "t2", "t3"]
        assert json.loads(r["prompt"]) == {"text": "12=", "answer": "12"}
        assert (r["epoch"], r["t_handed_off"]) == (0, 1700000000.123)
    assert store.newest("archiver-0") == (name, 1) and store.newest("other") == (None, 0)


def test_datasets_loads_the_archive(tmp_path: Path) -> None:
    import datasets

    store = ArchiveStore(str(tmp_path / "archive"))
    for seq in (1, 2):
        store.write_groups("archiver-0", seq, table_of([row(scored(f"{seq}:{i}", i))
                                                         for i in range(3)]))
    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "archive/groups/*.parquet"),
                               split="train", cache_dir=str(tmp_path / "hf"))
    assert ds.num_rows == 6
    first = ds[0]
    assert first["gid"] == "1:0" and len(first["completion_ids"]) == 4
    assert first["reward_parts"][0]["name"] == "copy"
    assert np.array(first["logprobs"][0], np.float32).tobytes() == \
        scored("1:0").group.rollouts[0].logprobs.tobytes()


def test_an_fsspec_url_works_like_a_folder() -> None:
    store = ArchiveStore("memory://sluice-test-archive")
    store.write_groups("a", 1, table_of([row(scored("0:1"))]))
    assert store.files() == ["part-a-00000001.parquet"]
    assert store.read("part-a-00000001.parquet").num_rows == 1
    assert store.display(store.path("groups")).startswith("memory://")


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    store = ArchiveStore(str(tmp_path))
    name, _ = store.write_groups("a", 1, table_of([row(scored("0:1"))]))
    path = Path(store.path("groups", name))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ArchiveReadError) as e:
        store.read(name)
    assert e.value.path == str(path)


def ev(e: str, gid: str | None, role: str, t: float, **kw: Any) -> dict[str, Any]:
    return {"ev": e, "gid": gid, "role": role, "consumer": "c", "t": t, **kw}


def step_intent(step: int, version: int, gids: list[str], t: float) -> dict[str, Any]:
    return ev("intent", None, "trainer", t, op=f"trained:trainer-0:{step}:x",
              planned=[{"ev": "trained", "gid": g, "step": step, "version": version,
                        "min_version": version, "max_staleness": 1, "n": 4} for g in gids])


def test_the_plan_is_the_surviving_history_of_the_trainer() -> None:
    """Steps 1-3 trained, the trainer killed and resumed from step 2's checkpoint: step 3
    was lost and the new steps 3-4 replace it."""
    rows = [ev("resumed", None, "trainer", 0.0, step=0, version=0),
            step_intent(1, 0, ["0:1", "0:2"], 1), step_intent(2, 1, ["0:3", "0:4"], 2),
            step_intent(3, 2, ["0:5", "0:6"], 3),
            ev("resumed", None, "trainer", 4, step=2, version=4),
            step_intent(3, 4, ["0:6", "0:7"], 5), step_intent(4, 5, ["0:8", "0:9"], 6)]
    rows += [ev("trained", g, "trainer", 3.1, step=3, version=2, min_version=2,
                max_staleness=1, n=4) for g in ("0:5", "0:6")]
    plan = step_plan(rows)
    assert [(s.step, s.version, s.gids) for s in plan] == [
        (1, 0, ["0:1", "0:2"]), (2, 1, ["0:3", "0:4"]), (3, 4, ["0:6", "0:7"]),
        (4, 5, ["0:8", "0:9"])]
    life = lives(rows)
    assert life["0:5"].disposition == "trained" and not life["0:5"].survived
    assert (life["0:6"].step, life["0:6"].slot) == (3, 0)
    table = disposition_table(life)
    assert [(s.step, s.gids) for s in plan_from_dispositions(table)] == \
        [(3, ["0:6"])]  # only groups with a `trained` event count as trained


def test_replay_refuses_a_config_that_changes_the_data(tiny_model_dir: Path) -> None:
    from trainer.replay import check_config

    cfg = load_config(None, [f"model.path={tiny_model_dir}"])
    record = {"config": cfg.model_dump(mode="json"),
              "model": {"source": str(tiny_model_dir), "local_dir": str(tiny_model_dir),
                        "revision": None}}
    check_config(record, load_config(None, [f"model.path={tiny_model_dir}",
                                            "trainer.loss_type=grpo", "trainer.lr=1"]))
    with pytest.raises(ConfigError) as e:
        check_config(record, load_config(None, ["model.path=/elsewhere", "task.name=add",
                                                "scoring.scale_rewards=batch"]))
    msg = str(e.value)
    assert "model.path" in msg and "task.name" in msg and "scoring.scale_rewards" in msg
    assert "trainer." not in msg


def test_the_audit_counts_archived_groups_and_finds_what_the_archive_lost(tmp_path: Path
                                                                         ) -> None:
    rows = []
    for c, gid in enumerate(("0:1", "0:2", "0:3")):
        rows += [ev("admitted", gid, "generator", c, cursor=c),
                 ev("emitted", gid, "generator", c, cursor=c),
                 ev("scored", gid, "scorer", c, n=4, adv_sum=0.0),
                 ev("handed_off", gid, "scorer", c)]
    rows += [ev("archived", "0:1", "archiver", 9, id="1-0", file="f"),
             ev("archived", "0:1", "archiver", 9, id="1-0", file="g"),
             ev("archived", "9:9", "archiver", 9, id="2-0", file="g")]
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    live = LiveView({}, set(), {g: ["scored"] for g in ("0:1", "0:2", "0:3")},
                    unarchived={"0:2"})
    rep = audit(tmp_path, live=live, archive=True)
    assert rep.archived == 2 and "2 archived" in rep.summary()
    text = "\n".join(rep.violations)
    assert "0:1 archived 2 times" in text and "9:9 archived but never handed off" in text
    assert "lost from the archive): ['0:3']" in text  # 0:2 still waits in Redis
    assert not [v for v in audit(tmp_path, live=live).violations if "lost" in v]


def test_trace_tells_a_groups_life_and_refuses_an_unknown_one(tmp_path: Path, capsys) -> None:
    from sluice.trace import main

    rows = [ev("admitted", "0:7", "generator", 10.0, cursor=3, gate_wait_s=0.25),
            ev("emitted", "0:7", "generator", 10.5, cursor=3, version=2),
            ev("scored", "0:7", "scorer", 10.6, id="5-0", n=4, adv_sum=0.0),
            ev("handed_off", "0:7", "scorer", 10.7, id="6-0"),
            ev("trained", "0:7", "trainer", 11.0, step=4, version=3, min_version=2,
               max_staleness=1, n=4)]
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(str(tmp_path), "0:7") == 0
    out = capsys.readouterr().out
    assert "group 0:7: trained at step 4" in out
    assert "after 0.250 s at the gate" in out and "+0.500s generate" in out
    assert "staleness 1" in out and "+0.300s queue in scored + step" in out
    assert main(str(tmp_path), "0:8") == 2
    assert "'0:8' is unknown" in capsys.readouterr().err


def test_status_shows_the_archive_backlog_and_the_waits_per_hop() -> None:
    from rich.console import Console

    from pipeline.metrics import RoleMetrics
    from sluice.monitor import render_status

    m = RoleMetrics("scorer", "scorer/s0")
    for x in range(100):
        m.wait("rollouts", x / 100)
    waits = m.wait_summary()
    assert waits["rollouts"]["n"] == 100 and waits["rollouts"]["p50"] == pytest.approx(0.495)
    snap = {"t": 100.0, "state": {"version": 1},
            "conservation": {"cursor": 2, "retired": 0, "in_flight": 2, "generating": 0,
                             "balanced": True, "by_reason": {}},
            "lengths": {"scored": 40},
            "groups": {"scored/trainers": {"lag": 0, "pending": 2, "consumers": []},
                       "scored/archivers": {"lag": 31, "pending": 7, "consumers": []}},
            "workers": {"scorer/s0": {"pid": 2, "t": 99.5, "healthy": True, "waits": waits}}}
    console = Console(record=True, width=240)
    console.print(render_status(snap, window=16))
    text = console.export_text()
    assert "archive    backlog 38 (lag 31, pending 7: the archivers group)" in text
    assert "rollouts -> scorer" in text and "0.495s" in text
