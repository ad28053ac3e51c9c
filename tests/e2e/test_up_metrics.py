"""`sluice up` serves /metrics for every role: listed by `sluice status`, and the values move."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.bus.keys import HEARTBEAT_ROLES, Keys
from tests.helpers import (
    ROOT,
    metric_value,
    role_logs,
    scrape_metrics,
    up_args,
    wait_for,
)

pytestmark = pytest.mark.e2e

MOVES = {  # role -> a counter that grows while the run goes on
    "trainer": "sluice_batch_steps_total",
    "scorer": "sluice_sample_completions_total",
    "generator": "sluice_rollout_groups_total",
    "evaluator": "sluice_eval_evaluations_total",
}


def test_every_role_serves_metrics_that_move_during_a_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = up_args(ROOT / "examples" / "copy.toml", out, tmp_path / "model", "metrics",
                   "trainer.max_steps=100000", "run.max_time_s=240", "up.scorers=1",
                   "up.generators=1", "task.heldout=16", "bus.heartbeat_s=0.5",
                   "up.plot=false")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    up = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    workers_keys = [Keys("metrics").heartbeats(r) for r in HEARTBEAT_ROLES]
    client = None
    try:
        def served() -> dict[str, Any] | None:
            nonlocal client
            assert up.poll() is None, f"sluice up exited {up.returncode}\n{role_logs(out)}"
            sock = out / "redis" / "redis.sock"
            if client is None and sock.exists():
                client = redis.Redis(unix_socket_path=str(sock))
            if client is None:
                return None
            try:
                raw = {k: v for key in workers_keys for k, v in client.hgetall(key).items()}
            except redis.ConnectionError:
                return None
            live = {k.decode(): json.loads(v) for k, v in raw.items()}
            roles = {wid.split("/")[0] for wid, w in live.items()
                     if w.get("metrics") and not w.get("exited")}
            return live if roles >= set(MOVES) else None

        wait_for(served, 150, lambda: f"every role serving /metrics\n{role_logs(out)}",
                 interval_s=0.5)
        status = subprocess.run([sys.executable, "-m", "sluice.cli", "status", "--json",
                                 "--set", f"bus.redis_url=unix://{out}/redis/redis.sock",
                                 "--set", "run.name=metrics"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        snap = json.loads(status.stdout)
        urls = {wid: w["metrics"] for wid, w in snap["workers"].items()
                if w.get("metrics") and not w.get("exited")}
        assert {wid.split("/")[0] for wid in urls} == set(MOVES), urls
        assert all(u.startswith("http://127.0.0.1:") for u in urls.values()), urls
        assert "leases" in snap

        first = {wid: scrape_metrics(u) for wid, u in urls.items()}

        def moved() -> bool:
            now = {wid: scrape_metrics(u) for wid, u in urls.items()}
            return all(metric_value(now[wid], MOVES[wid.split("/")[0]])
                       > metric_value(first[wid], MOVES[wid.split("/")[0]]) for wid in urls)

        wait_for(moved, 120, lambda: f"every role's counter to grow\n{role_logs(out)}",
                 interval_s=1.0)
        last = {wid.split("/")[0]: scrape_metrics(u) for wid, u in urls.items()}
        tr, gen, sc = last["trainer"], last["generator"], last["scorer"]
        assert metric_value(tr, "sluice_batch_staleness_count") > 0
        assert metric_value(tr, "sluice_perf_weight_publish_seconds_count") > 0
        assert metric_value(tr, "sluice_bus_gate_window") == 16  # (1 + 1) x 8
        assert metric_value(tr, "sluice_bus_group_pending", stream="scored") >= 0
        assert metric_value(tr, "sluice_bus_stream_length", stream="dlq") == 0
        assert metric_value(sc, "sluice_bus_stream_length", stream="rollouts") > 0
        assert metric_value(gen, "sluice_rollout_tokens_total") > 0
        assert metric_value(gen, "sluice_bus_leases_held") >= 0
        assert metric_value(gen, "sluice_bus_healthy") == 1
    finally:
        if client is not None:
            client.close()
        if up.poll() is None:
            up.send_signal(signal.SIGINT)  # Ctrl-C: every role stops, then the summary
        try:
            output, _ = up.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
            output, _ = up.communicate()
    assert up.returncode == 130, f"{output[-3000:]}\n{role_logs(out)}"  # interrupted
