"""`sluice up` stops a role that ignores SIGTERM: it first asks it for its threads'
stacks (`pipeline.runtime.STACKS_SIGNAL`), which land in the role's log, writes what
`/proc` says of each thread there (`sluice.hang_report`), then kills it."""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from pathlib import Path

from pipeline.config import load_config
from sluice.supervisor import Child, Supervisor
from tests.helpers import ROOT, wait_for

# A role stuck at exit: SIGTERM ignored, the main thread joining a thread that never ends
STUCK = """
import signal, threading, time, sys
from pipeline.runtime import STACKS_SIGNAL, dump_stacks_on
dump_stacks_on(STACKS_SIGNAL)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
def wait_forever_in_a_helper():
    import ctypes
    ctypes.CDLL(None).prctl(15, b"stuck-helper", 0, 0, 0)  # PR_SET_NAME: its OS name
    threading.Event().wait()
t = threading.Thread(target=wait_forever_in_a_helper, name="helper")
t.start()
print("ready", flush=True)
t.join()
"""


def test_a_role_that_ignores_sigterm_leaves_its_stacks_in_its_log_and_is_killed(
        tmp_path: Path) -> None:
    log = tmp_path / "stuck.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=f,
                                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    try:
        wait_for(lambda: "ready" in log.read_text(), 60, "the stuck role to start")
        sup = Supervisor(load_config(None), "run.toml", [])
        sup.children.append(Child("train", "trainer-0", proc, log))
        t0 = time.time()
        sup.terminate(grace_s=1.0)
        assert proc.returncode == -9
        assert time.time() - t0 < 30
        text = log.read_text()
        # faulthandler's dump: both threads, the helper inside its wait, the main in join
        assert "most recent call first" in text, text
        assert "wait_forever_in_a_helper" in text and "in join" in text, text
        # the failure report's tail reaches back to the start of the dump
        tail = sup.children[0].tail(3)
        assert tail.splitlines()[0].endswith("(most recent call first):"), tail
        assert "wait_forever_in_a_helper" in tail and "in join" in tail, tail
        # and, written before the kill, each thread as /proc saw it: the helper asleep
        # in a futex (a Python lock), named as the OS knows it
        assert f"=== hang report of pid {proc.pid}" in text, text
        helper = next((ln for ln in text.splitlines() if "'stuck-helper' S" in ln), None)
        assert helper is not None, text
        if platform.machine() in ("x86_64", "aarch64"):
            assert "syscall=futex" in helper, helper
        assert "=== hang report" in sup.children[0].tail(3), sup.children[0].tail(3)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# A role whose work is done but whose process cannot exit: a non-daemon thread never ends
HUNG_AT_EXIT = """
import threading
import pipeline.runtime as rt
rt.EXIT_BOUND_S = 1.0
def never_ending_helper():
    threading.Event().wait()
async def main(stop):
    threading.Thread(target=never_ending_helper, name="helper").start()
    print("work done", flush=True)
rt.run_role(main, "scorer")
"""


def test_a_role_hung_after_its_work_dumps_its_stacks_and_exits_within_the_bound() -> None:
    proc = subprocess.run([sys.executable, "-c", HUNG_AT_EXIT], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert "work done" in proc.stdout
    assert proc.returncode == 1, proc.stderr
    assert "most recent call first" in proc.stderr and "never_ending_helper" in proc.stderr, \
        proc.stderr
