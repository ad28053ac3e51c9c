"""`sluice.up.supervise`'s end of a run, against a real Redis with stand-in roles (plain
processes that take or ignore the end signal the way a trainer would): which reasons
ask for an orderly end (`pipeline.runtime.END_SIGNAL` to the trainer), that the end
completes when the trainer exits, and what stops it at once (a second Ctrl-C, SIGTERM,
``up.end_timeout_s``). The whole pipeline's orderly end: tests/e2e/test_up_end.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.runtime import END_SIGNAL
from sluice.embedded import EmbeddedRedis
from sluice.restarts import RestartPolicy
from sluice.supervisor import Child, Supervisor
from sluice.up import supervise

# a trainer that ends when asked: exit 0 on END_SIGNAL (as the real one does after its
# step and RunFinished); one that never hears it (busy, or not started yet)
ENDS_WHEN_ASKED = ("import signal, sys, time\n"
                   "signal.signal(signal.SIGUSR2, lambda *_: sys.exit(0))\n"
                   "time.sleep(600)\n")
NEVER_ENDS = "import signal, time\nsignal.signal(signal.SIGUSR2, signal.SIG_IGN)\ntime.sleep(600)\n"


class StandIn(Supervisor):
    """A supervisor whose roles are stand-in processes: nothing to restart."""

    def handle_crashes(self, policy: RestartPolicy) -> Child | None:
        return None


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def _sup(redis_server: EmbeddedRedis, tmp_path: Path, procs: list[subprocess.Popen[bytes]],
         trainer: str, *sets: str) -> StandIn:
    cfg = load_config(None, [f"bus.redis_url={redis_server.url}",
                             f"run.output_dir={tmp_path}", *sets])
    proc = subprocess.Popen([sys.executable, "-c", trainer])
    procs.append(proc)
    time.sleep(0.5)  # its handler installed (a fresh interpreter: well under this)
    sup = StandIn(cfg, "-", [])
    sup.children.append(Child("train", "trainer-0", proc, tmp_path / "trainer-0.log"))
    return sup


async def _run(sup: StandIn, stop: asyncio.Event, hard: asyncio.Event | None = None,
               at: dict[float, str] | None = None) -> tuple[str, float | None, float]:
    """supervise(), with ``stop``/``hard`` set after the given delays; returns its answer
    and how long it took."""
    t0 = time.monotonic()

    async def poke() -> None:
        for delay, what in sorted((at or {}).items()):
            await asyncio.sleep(max(0.0, delay - (time.monotonic() - t0)))
            if what == "hard" and hard is not None:
                hard.set()
            stop.set()

    task = asyncio.create_task(poke())
    reason, end_by = await asyncio.wait_for(supervise(sup, stop, hard), 60)
    task.cancel()
    return reason, end_by, time.monotonic() - t0


def test_a_first_ctrl_c_asks_the_trainer_to_end_and_waits_for_it(
        redis_server: EmbeddedRedis, tmp_path: Path, procs: list[subprocess.Popen[bytes]],
        capsys: pytest.CaptureFixture[str]) -> None:
    assert END_SIGNAL is not None
    sup = _sup(redis_server, tmp_path, procs, ENDS_WHEN_ASKED)
    reason, end_by, _ = asyncio.run(_run(sup, asyncio.Event(), at={0.5: "stop"}))
    assert reason == "interrupted" and end_by is not None  # in order: roles get time
    assert sup.children[0].proc.wait(5) == 0  # it heard the request and ended
    assert "ending the run in order" in capsys.readouterr().err


def test_max_time_s_ends_in_order(redis_server: EmbeddedRedis, tmp_path: Path,
                                  procs: list[subprocess.Popen[bytes]]) -> None:
    sup = _sup(redis_server, tmp_path, procs, ENDS_WHEN_ASKED, "run.max_time_s=1",
               "up.end_timeout_s=300")
    reason, end_by, _ = asyncio.run(_run(sup, asyncio.Event()))
    assert reason == "max_time_s" and end_by is not None
    assert end_by == pytest.approx(time.time() + 300, abs=30)  # bounded by end_timeout_s


def test_a_second_ctrl_c_stops_at_once(redis_server: EmbeddedRedis, tmp_path: Path,
                                       procs: list[subprocess.Popen[bytes]],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    sup = _sup(redis_server, tmp_path, procs, NEVER_ENDS, "up.end_timeout_s=600")
    reason, end_by, took_s = asyncio.run(_run(sup, asyncio.Event(),
                                              at={0.5: "stop", 2.0: "stop"}))
    assert (reason, end_by) == ("interrupted", None)  # stop every role as it stands
    assert took_s < 20, took_s  # not the 600 s of up.end_timeout_s
    err = capsys.readouterr().err
    assert "ending the run in order" in err and "stopping every role now" in err


def test_sigterm_and_a_zero_end_timeout_stop_at_once_and_a_stuck_end_is_bounded(
        redis_server: EmbeddedRedis, tmp_path: Path, procs: list[subprocess.Popen[bytes]],
        capsys: pytest.CaptureFixture[str]) -> None:
    sup = _sup(redis_server, tmp_path, procs, ENDS_WHEN_ASKED)
    reason, end_by, _ = asyncio.run(_run(sup, asyncio.Event(), asyncio.Event(),
                                         at={0.5: "hard"}))
    assert (reason, end_by) == ("interrupted", None)
    assert sup.children[0].proc.poll() is None  # never asked to end: stopped as it stands
    assert "ending the run in order" not in capsys.readouterr().err

    sup = _sup(redis_server, tmp_path, procs, ENDS_WHEN_ASKED, "run.max_time_s=1",
               "up.end_timeout_s=0")
    assert asyncio.run(_run(sup, asyncio.Event()))[:2] == ("max_time_s", None)

    sup = _sup(redis_server, tmp_path, procs, NEVER_ENDS, "run.max_time_s=1",
               "up.end_timeout_s=2")
    reason, end_by, took_s = asyncio.run(_run(sup, asyncio.Event()))
    assert (reason, end_by) == ("max_time_s", None) and took_s < 20
    assert "took more than up.end_timeout_s" in capsys.readouterr().err
