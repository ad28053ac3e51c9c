"""What is left of a process once its work is over is made quick, and stops run together.

- A role process (`pipeline.runtime.run_role`) freezes its objects once its loop has
  closed (`pipeline.runtime.freeze_for_exit`): the interpreter's teardown then no longer
  walks every object torch and transformers made, which took seconds per role at the end
  of every run on a loaded machine.
- `sluice up` stops its vLLM servers together (`sluice.vllm_launch.stop_all`):
  every server has its SIGTERM before the supervisor waits for any of them.
Each test runs real processes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sluice.vllm_launch import LocalServer, ServerSpec, stop_all
from tests.helpers import ROOT

ROLE_THEN_FREEZE_COUNT = """
import atexit, gc
import pipeline.runtime as rt
async def main(stop):
    return None
rt.run_role(main, "scorer")
print("frozen", gc.get_freeze_count(), flush=True)
"""


def test_a_role_process_freezes_its_objects_once_its_loop_has_closed() -> None:
    proc = subprocess.run([sys.executable, "-c", ROLE_THEN_FREEZE_COUNT], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert words[0] == "frozen" and int(words[1]) > 0, (proc.stdout, proc.stderr)


# A server that, once asked to stop, finishes only after its peer was asked too (both
# write a marker on SIGTERM): stopped one after another, the first one waits in vain
# until its grace period ends and is killed.
PEER_WAITING_SERVER = """
import os, signal, sys, time
mine, peer = sys.argv[1], sys.argv[2]
def on_term(*_):
    open(mine, "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(peer) and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(0 if os.path.exists(peer) else 3)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def test_servers_are_all_asked_to_stop_before_any_is_waited_for(tmp_path: Path) -> None:
    marks = [tmp_path / "a.term", tmp_path / "b.term"]
    servers = []
    try:
        for mine, peer in (marks, marks[::-1]):
            proc = subprocess.Popen([sys.executable, "-c", PEER_WAITING_SERVER, str(mine),
                                     str(peer)], stdout=subprocess.PIPE, text=True,
                                    start_new_session=True)
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            servers.append(LocalServer(ServerSpec(sys.executable, "none"), tmp_path,
                                       proc=proc))  # type: ignore[arg-type]
        # a grace well under each server's own 120 s wait: serial stops kill the first
        stop_all(servers, grace_s=20.0)
        codes = [s.proc.returncode for s in servers if s.proc is not None]
        assert codes == [0, 0], codes  # each saw its peer's SIGTERM: none was killed
    finally:
        for s in servers:
            if s.proc is not None:
                if s.proc.poll() is None:
                    s.proc.kill()
                s.proc.wait()
                if s.proc.stdout is not None:
                    s.proc.stdout.close()
