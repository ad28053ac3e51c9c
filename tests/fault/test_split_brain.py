"""Split brain: a trainer paused past its lock's TTL wakes up after another took over.

Trainer A is SIGSTOPped while it holds a step, past its lock's TTL (2.5 s with the
harness's ``bus.heartbeat_s = 0.5``); trainer B takes the lock (a new generation) and
trains; A is SIGCONTed. A must publish nothing, retire nothing, write and prune no
checkpoint, and exit non-zero naming the reason; B goes on; the audit is clean.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from pipeline.bus.codec import DecodeError, decode_entry
from pipeline.bus.keys import TRAINERS_GROUP
from pipeline.bus.schema import WeightsPublished
from tests.fault.harness import GROUPS_PER_STEP, Pipeline
from tests.helpers import wait_for

pytestmark = pytest.mark.fault

WAIT_S = 300.0
"""Every wait is for the condition it checks; this only bounds a hang. Generous: the
roles share a few busy cores, and machines differ 3x in speed."""


def _generation(log: str) -> int:
    found = re.findall(r"trainer lock taken: generation (\d+)", log)
    assert found, f"no generation in the log:\n{log[-2000:]}"
    return int(found[-1])


def _checkpoints(out: Path) -> dict[str, tuple[int, int]]:
    """step folder -> (writer's generation, meta.json mtime ns)."""
    got = {}
    for d in sorted((out / "checkpoints").glob("step-*")):
        try:
            meta = d / "meta.json"
            got[d.name] = (int(json.loads(meta.read_text()).get("generation", 0)),
                           meta.stat().st_mtime_ns)
        except (FileNotFoundError, ValueError):
            continue  # pruned by B while we listed
    return got


def _announced(p: Pipeline) -> list[tuple[bytes, int]]:
    out = []
    for entry_id, fields in p.r.xrange(p.keys.control):
        try:
            m = decode_entry(fields)
        except DecodeError:
            continue
        if isinstance(m, WeightsPublished):
            out.append((entry_id, m.version))
    return out


def _ledger_rows(out: Path, pid: int) -> list[dict[str, object]]:
    """The ledger rows of trainer process ``pid``, in the order it wrote them."""
    rows = []
    for path in (out / "ledger").glob(f"trainer-*-{pid}.jsonl"):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line]
    return rows


def test_paused_trainer_loses_its_lock_and_writes_nothing(pipeline: Pipeline) -> None:
    with pipeline as p:
        a = p.start("train", "trainer-a")  # consumer trainer-0, like B
        p.start("generate", "g0")
        p.start("score", "s0")
        p.wait_trained(24, WAIT_S)  # past a checkpoint (save_steps = 5)
        wait_for(lambda: p.pending_on("scored", TRAINERS_GROUP, "trainer-0") >= GROUPS_PER_STEP,
                 WAIT_S, lambda: f"trainer A to hold a step\n{p.logs()}", 0.005)
        os.kill(a.pid, signal.SIGSTOP)
        gen_a = _generation(p.text("trainer-a"))
        a_events = len(_ledger_rows(p.out, a.pid))
        try:
            p.start("train", "trainer-b")  # waits out A's TTL, then takes the lock
            wait_for(lambda: "trainer lock taken" in p.text("trainer-b"), WAIT_S,
                     lambda: f"trainer B to take the lock\n{p.logs()}")
            gen_b = _generation(p.text("trainer-b"))
            assert gen_b > gen_a
            before = p.trained()
            p.wait_trained(before + 16, WAIT_S)  # B trains (and passes a checkpoint)
            wait_for(lambda: any(g == gen_b for g, _ in _checkpoints(p.out).values()), WAIT_S,
                     lambda: f"a checkpoint by B\n{p.logs()}")
        finally:
            ckpts_before = _checkpoints(p.out)
            announced_before = _announced(p)
            version_before = p.state()["version"]
            t_cont = time.time()
            os.kill(a.pid, signal.SIGCONT)
        p.expect_exit("trainer-a")
        try:
            rc = a.wait(WAIT_S)
        except Exception as e:
            raise AssertionError(f"A did not exit after SIGCONT\n{p.logs()}") from e
        log_a = p.text("trainer-a")
        assert rc != 0, log_a[-3000:]
        assert "lost the trainer lock to" in log_a, log_a[-3000:]
        assert "another trainer is training this run" in log_a, log_a[-3000:]

        # A retired, acked, dead-lettered nothing after it woke: what its ledger gained
        # is intents the fence refused, its last line, and at most the outcome of a call
        # it had already sent when it was stopped (Redis ran it then, while A's
        # generation was the newest; sent later, the fence would have refused it). No
        # call A decided after it woke acted.
        rows = _ledger_rows(p.out, a.pid)
        sent_before = {r["op"] for r in rows[:a_events] if r["ev"] == "intent"}
        late = rows[a_events:]
        acted = [r for r in late if r["ev"] not in ("intent", "lock_lost")]
        assert all(r.get("op") in sent_before for r in acted), late
        # A announced nothing: every announcement after SIGCONT is B's, newer than all
        old_ids = {i for i, _ in announced_before}
        newest = max((v for _, v in announced_before), default=-1)
        late_versions = [v for i, v in _announced(p) if i not in old_ids]
        assert all(v > newest for v in late_versions), (newest, late_versions)
        assert late_versions == sorted(late_versions)
        # A wrote no checkpoint after it woke, and B's newest is still there
        for name, (gen, mtime) in _checkpoints(p.out).items():
            if gen != gen_b:
                assert ckpts_before.get(name) == (gen, mtime), (name, gen, mtime, t_cont)
        newest_b = max(n for n, (g, _) in ckpts_before.items() if g == gen_b)
        assert newest_b in _checkpoints(p.out) or len(
            [n for n, (g, _) in _checkpoints(p.out).items() if g == gen_b and n > newest_b]
        ) >= 2, "B's newest checkpoint was pruned by someone other than B"

        # B goes on training
        p.wait_trained(p.trained() + 8, WAIT_S)
        assert p.state()["version"] >= version_before
        p.stop_all()
        p.assert_clean(min_trained=before + 24)
