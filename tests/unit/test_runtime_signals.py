"""A role's process obeys SIGTERM after its event loop has closed (`pipeline.runtime.run_role`).

uvloop leaves its own signal handler installed once its loop is closed, so a role that
stalled in teardown (a non-daemon thread, an atexit hook) ignored SIGTERM and could only
be SIGKILLed. Each test is a real role process under each event loop kind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT, wait_for

# A role whose work is done and whose loop has closed, stuck in teardown: a non-daemon
# thread that never ends keeps the interpreter from exiting.
STALLED_IN_TEARDOWN = """
import threading
import pipeline.runtime as rt
def never_ending_helper():
    threading.Event().wait()
async def main(stop):
    threading.Thread(target=never_ending_helper, name="helper").start()
rt.run_role(main, "scorer")
print("loop closed", flush=True)
"""


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_sigterm_ends_a_role_stalled_after_its_loop_closed(loop: str) -> None:
    env = {**os.environ, "SLUICE_EVENT_LOOP": loop}
    proc = subprocess.Popen([sys.executable, "-c", STALLED_IN_TEARDOWN], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        lines.append(proc.stdout.readline())  # blocks until the loop closed (or exit)
        assert lines == ["loop closed\n"], proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        # far below the role's exit bound (EXIT_BOUND_S, 120 s), which would also end it
        wait_for(lambda: proc.poll() is not None, 30,
                 f"the {loop} role to exit on SIGTERM after its loop closed")
        assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
