"""`sluice up` starts again a vLLM server it launched that exited (a crash, or the
trainer asking it to after a weight push cut short), on the same port, after killing
what its old process group left behind; never one it stopped itself; and gives up on
one that keeps exiting, naming it. Stand-in servers: a Python process (and a child of
it in its process group, as vLLM's engine core is) instead of vLLM."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from sluice.restarts import RestartPolicy
from sluice.server_watch import ServerWatch
from sluice.vllm_launch import LocalServer, ServerSpec

# the "API server" writes its pid and its child's, then sleeps; the child outlives it
STAND_IN = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "a").write(f"{os.getpid()} {child.pid}\\n")
time.sleep(120)
"""


@dataclass
class StandIn(ServerSpec):
    pids_file: str = ""

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-c", STAND_IN, self.pids_file]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _wait_for(cond, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def _pids(path: Path) -> list[tuple[int, int]]:
    if not path.exists():
        return []
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()
            if len(line.split()) == 2]  # type: ignore[misc]


def test_an_exited_server_starts_again_on_its_port_without_its_leftovers(
        tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    server = LocalServer(StandIn(python=sys.executable, model="m", pids_file=str(pids)),
                         tmp_path / "w").start()
    watch = ServerWatch([server], RestartPolicy(max_restarts=3, backoff_s=0.0))
    try:
        _wait_for(lambda: len(_pids(pids)) == 1)
        port, (api, engine) = server.port, _pids(pids)[0]
        assert watch.poll() is None and server.proc is not None
        os.kill(api, 9)  # the API server exits; its engine core lives on
        _wait_for(lambda: server.proc.poll() is not None)  # type: ignore[union-attr]
        assert _alive(engine)
        assert watch.poll() is None  # reaps the group, schedules the start (no backoff)
        _wait_for(lambda: not _alive(engine), 10)
        assert watch.poll() is None and watch.restarts == 1
        _wait_for(lambda: len(_pids(pids)) == 2)
        assert server.port == port and server.proc.pid == _pids(pids)[1][0]
        server.terminate()  # the run's end: stopped by sluice up, never started again
        _wait_for(lambda: server.proc.poll() is not None)  # type: ignore[union-attr]
        assert watch.poll() is None and watch.restarts == 1 and len(_pids(pids)) == 2
    finally:
        server.stop(grace_s=1)


def test_a_server_that_keeps_exiting_ends_the_run_named(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    server = LocalServer(StandIn(python=sys.executable, model="m", pids_file=str(pids)),
                         tmp_path / "w").start()
    watch = ServerWatch([server], RestartPolicy(max_restarts=1, backoff_s=0.0))
    try:
        reason = None
        for n in (1, 2):
            _wait_for(lambda n=n: len(_pids(pids)) == n)
            os.kill(_pids(pids)[-1][0], 9)
            _wait_for(lambda: server.proc.poll() is not None)  # type: ignore[union-attr]
            reason = watch.poll()
            if reason is None:
                assert watch.poll() is None  # started again
        assert reason is not None and server.url in reason and "2 exits" in reason
        assert str(server.log_path) in reason
    finally:
        server.stop(grace_s=1)
        for _, engine in _pids(pids):
            _wait_for(lambda engine=engine: not _alive(engine), 10)
