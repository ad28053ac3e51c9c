"""A `sluice up` run ended by ``run.max_time_s`` ends in order: the trainer finishes its
step and announces the end, the evaluator evaluates that final version, the summary says
so. Real processes, an embedded Redis, the tiny model. A first Ctrl-C takes the same path
(asserted where the e2e and fault tests end their runs with one); the supervisor's side,
a second Ctrl-C, SIGTERM and the timeout: tests/unit/test_up_end.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, role_logs, up_args

pytestmark = pytest.mark.e2e

QUIET_EVAL = "1000000"  # --eval-every: the evaluator evaluates v0, then only the final version


def _args(tmp: Path, name: str, *sets: str) -> list[str]:
    args = up_args(ROOT / "examples" / "copy.toml", tmp / "run", tmp / "model", name,
                   "trainer.max_steps=1000000", "up.plot=false", "up.scorers=1", *sets)
    assert args[-2] == "--eval-every"
    return [*args[:-1], QUIET_EVAL]


def _evals(out: Path) -> list[dict[str, Any]]:
    path = out / "eval.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _start(tmp: Path, args: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    with open(tmp / "up.out", "w") as so, open(tmp / "up.err", "w") as se:
        return subprocess.Popen(args, cwd=tmp, env=env, stdout=so, stderr=se, text=True)


def _finish(up: subprocess.Popen[str], timeout_s: float) -> None:
    try:
        up.wait(timeout=timeout_s)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def _check_final_evaluated(tmp: Path, reason: str) -> None:
    out = tmp / "run"
    err = (tmp / "up.err").read_text()
    printed = (tmp / "up.out").read_text()  # the summary
    summary = json.loads((out / "summary.json").read_text())
    evals = _evals(out)
    state = f"{err[-3000:]}\n{role_logs(out)}"
    assert summary["reason"] == reason, state
    assert summary["final_version"] >= 1, state  # it trained
    assert evals[-1]["version"] == summary["final_version"], state
    assert summary["final_version_evaluated"], state
    assert f"v{summary['final_version']}, the final version)" in printed, printed
    assert [e["version"] for e in evals] == [0, summary["final_version"]], state
    assert "ledger audit" in err and ": OK:" in err, state
    assert "ending the run as asked" in (out / "logs" / "trainer-0.log").read_text(), state


def test_max_time_s_ends_in_order_and_the_final_version_is_evaluated(tmp_path: Path) -> None:
    # 60 s from the supervisor's start: the roles' start-up (seconds here, a minute on a
    # slow machine) and then training; any version > 0 makes the check meaningful
    up = _start(tmp_path, _args(tmp_path, "end-time", "run.max_time_s=60"))
    _finish(up, timeout_s=600)
    assert up.returncode == 0, (tmp_path / "up.err").read_text()[-3000:]
    _check_final_evaluated(tmp_path, "max_time_s")
