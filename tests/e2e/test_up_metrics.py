"""`sluice up` serves /metrics for every role: listed by `sluice status`, and the values move;
and `sluice status` as a person sees it in a real terminal, on the same run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
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
from tests.terminal import DONE, Tmux

pytestmark = pytest.mark.e2e

MOVES = {  # role -> a counter that grows while the run goes on
    "trainer": "sluice_batch_steps_total",
    "scorer": "sluice_sample_completions_total",
    "generator": "sluice_rollout_groups_total",
    "evaluator": "sluice_eval_evaluations_total",
}


@dataclass
class LiveRun:
    """A `sluice up` of examples/copy.toml that runs until the module's tests are done,
    every role up and serving /metrics (`live_run`)."""

    out: Path
    up: subprocess.Popen[str]
    env: dict[str, str]
    bus: list[str]  # `--set`s that point a command at its Redis and run


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    """One run shared by this module's tests (each start of every role costs a minute of
    CPU on a 2-core machine); ended with Ctrl-C, which must end it in order (exit 130)."""
    tmp = tmp_path_factory.mktemp("live")
    out = tmp / "run"
    args = up_args(ROOT / "examples" / "copy.toml", out, tmp / "model", "metrics",
                   "trainer.max_steps=100000", "run.max_time_s=400", "up.scorers=1",
                   "up.generators=1", "task.heldout=16", "bus.heartbeat_s=0.5",
                   "up.plot=false")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    up = subprocess.Popen(args, cwd=tmp, env=env, stdout=subprocess.PIPE,
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
        yield LiveRun(out, up, env, ["--set", f"bus.redis_url=unix://{out}/redis/redis.sock",
                                     "--set", "run.name=metrics"])
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


def test_every_role_serves_metrics_that_move_during_a_run(live_run: LiveRun) -> None:
    status = subprocess.run([sys.executable, "-m", "sluice.cli", "status", "--json",
                             *live_run.bus], cwd=ROOT, env=live_run.env,
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

    wait_for(moved, 120, lambda: f"every role's counter to grow\n{role_logs(live_run.out)}",
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


WORKER_ID = re.compile(r"\b(?:trainer|generator|scorer|evaluator|archiver)/[^\s,()]+")
"""A worker id as the view prints it (``role/name``; a cut one would end in "…")."""


def check_screen(screen: list[str], joined: list[str], ids: set[str], cols: int) -> list[str]:
    """The view's lines on a terminal screen, checked as a person reads them: no line of
    the screen is a continuation of the one above (tmux's joined capture is the same),
    the top of the view is still on the screen (nothing scrolled away), every worker id
    shows whole and every role is there; returns the view's lines."""
    text = "\n".join(screen)
    assert screen == joined, f"a line wrapped:\n{text}"
    assert all(len(x) <= cols for x in screen)
    shown = set(WORKER_ID.findall(text))
    assert shown <= ids, f"ids cut or unknown: {shown - ids}\n{text}"
    rows = {wid for wid in ids if any(x.startswith(wid + " ") for x in screen)}
    assert rows == ids, f"worker lines not on the screen: {ids - rows}\n{text}"
    top = [i for i, x in enumerate(screen) if x.startswith("run ")]
    assert top and not any(screen[:top[0]]), f"the view's top is not on the screen:\n{text}"
    return screen[top[0]:]


def test_status_reads_whole_in_real_terminals_of_80x24_and_160x48(live_run: LiveRun,
                                                                   tmp_path: Path) -> None:
    """`sluice status` (once, and `--watch`) in real terminals (tmux panes) during the run:
    at 80x24 the whole view is on the first screen, one line per worker with its id whole
    and nothing wrapped; at 160x48 the same workers show more."""
    snap = json.loads(subprocess.run(
        [sys.executable, "-m", "sluice.cli", "status", "--json", *live_run.bus], cwd=ROOT,
        env=live_run.env, capture_output=True, text=True, timeout=60, check=True).stdout)
    ids = set(snap["workers"])
    assert {wid.split("/")[0] for wid in ids} == set(MOVES), ids
    env = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    status = [sys.executable, "-m", "sluice.cli", "status", *live_run.bus]
    with Tmux(tmp_path) as tmux:
        views = {}
        for cols, rows in ((80, 24), (160, 48)):
            name = tmux.start(status, cols, rows, ROOT, env)
            screen = tmux.wait_done(name, 90)
            done = next(i for i, x in enumerate(screen) if DONE in x)
            assert screen[done] == f"{DONE}0]", "\n".join(screen)
            views[cols] = check_screen(screen[:done], tmux.screen(name, joined=True)[:done],
                                       ids, cols)
        row = {cols: {wid: next(x for x in v if x.startswith(wid + " ")) for wid in ids}
               for cols, v in views.items()}
        cells = {cols: {wid: len(x.split("  ")) for wid, x in r.items()}
                 for cols, r in row.items()}
        assert all(cells[160][w] >= cells[80][w] for w in ids), row
        assert sum(cells[160].values()) > sum(cells[80].values()), row

        name = tmux.start([*status, "--watch", "0.5"], 80, 24, ROOT, env)

        def watched() -> list[str] | None:
            screen = tmux.screen(name)
            if not any(x.startswith("run ") for x in screen) or DONE in "".join(screen):
                return None
            return check_screen(screen, tmux.screen(name, joined=True), ids, 80)

        first = wait_for(watched, 90, lambda: "\n".join(tmux.screen(name)), interval_s=0.3)
        wait_for(lambda: (v := watched()) is not None and v != first, 60,
                 lambda: "the watched view to refresh:\n" + "\n".join(tmux.screen(name)),
                 interval_s=0.3)
        tmux.tmux("send-keys", "-t", name, "C-c")
        assert f"{DONE}0]" in tmux.wait_done(name, 30)
