"""`sluice up` keeps the run alive: kill -9 each kind of role once under it; every one is
restarted and the run trains on after each, and when it is then stopped (Ctrl-C, as a
person would) `sluice up`'s own audit of the whole history is clean and no role is
reported failed.

The run is stopped by the test, not at a ``max_steps``: a step count large enough for
four kills and restarts on a fast machine took six minutes to train on a slow one (the
test waited on a count, not on the condition it checks); now it waits only for what it
checks, each role back and training going on after it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from sluice.supervisor import child_pids
from tests.helpers import ROOT, role_logs, up_args, wait_for

pytestmark = pytest.mark.fault

MAX_STEPS = 100_000  # never reached: the test stops the run itself


def role_pid(up_pid: int, name: str) -> int | None:
    """The PID of `sluice up`'s child running role ``name`` (its ``--name``), if alive."""
    for pid in child_pids(up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--name" in argv and argv[argv.index(b"--name") + 1].decode() == name:
            return pid
    return None


def max_step(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(x)["step"] for x in lines if x.strip().endswith("}")]
    return max(steps, default=0)


def test_kill_9_of_each_role_under_sluice_up_is_survived(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = up_args(ROOT / "examples" / "copy.toml", out, tmp_path / "model", "restarts",
                   f"trainer.max_steps={MAX_STEPS}", "trainer.save_steps=25",
                   "run.max_time_s=540", "up.plot=false", "up.restart_window_s=600")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "up.out", "w") as so, open(tmp_path / "up.err", "w") as se:
        up = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=so, stderr=se, text=True)
    try:
        def state() -> str:
            return f"{(tmp_path / 'up.err').read_text()[-3000:]}\n{role_logs(out)}"

        wait_for(lambda: max_step(out) >= 10, 240, lambda: f"10 steps\n{state()}")
        for name in ("scorer-0", "generator-0", "evaluator", "trainer-0"):
            pid = wait_for(lambda n=name: role_pid(up.pid, n), 60, f"{name} running")
            step = max_step(out)
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda n=name, p=pid: role_pid(up.pid, n) not in (None, p), 90,
                     lambda n=name: f"{n} restarted\n{state()}")
            wait_for(lambda s=step: max_step(out) >= s + 5, 180,
                     lambda n=name: f"training going on after {n} was killed\n{state()}")
        up.send_signal(signal.SIGINT)  # Ctrl-C: stop, summarise, audit
        assert up.wait(timeout=240) == 130, state()
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
    err = (tmp_path / "up.err").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reason"] == "interrupted" and summary["steps"] >= 30, summary
    assert summary["final_version_evaluated"], summary  # a first Ctrl-C ends in order
    assert summary["conservation"]["balanced"], summary
    assert "; last lines of" not in err, err[-3000:]  # no role left failed
    for name in ("scorer-0", "generator-0", "evaluator", "trainer-0"):
        assert f"{name} exited with code -9; restarting it in" in err, err[-3000:]
    assert "ledger audit" in err and ": OK:" in err, err[-3000:]
