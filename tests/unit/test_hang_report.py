"""`sluice.hang_report`: what `/proc` says of each thread of a real hung process.

The child names one thread (``PR_SET_NAME``, as native libraries name theirs) and blocks
it in a known system call: ``read`` on a pipe nobody writes to.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from pipeline.runtime import HANG_REPORT_MARK, log_tail
from sluice.hang_report import hang_report, native_stacks, syscall_name, thread_states

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc is Linux's")

BLOCKED_IN_READ = """
import ctypes, os, threading
r, w = os.pipe()
def blocked_in_read():
    ctypes.CDLL(None).prctl(15, b"reader-thread", 0, 0, 0)  # PR_SET_NAME
    print("ready", flush=True)
    os.read(r, 1)
t = threading.Thread(target=blocked_in_read)
t.start()
t.join()
"""


@pytest.fixture
def hung() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED_IN_READ], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _reader_in_read(pid: int) -> bool:
    """The named thread has entered ``read`` (it printed "ready" just before)."""
    return any(t.name == "reader-thread" and t.state == "S" for t in thread_states(pid))


def test_each_thread_of_a_hung_process_with_its_name_state_and_system_call(
        hung: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while not _reader_in_read(hung.pid):
        assert time.monotonic() < deadline, thread_states(hung.pid)
        time.sleep(0.05)
    threads = {t.name: t for t in thread_states(hung.pid)}
    reader = threads["reader-thread"]
    assert reader.tid != hung.pid and len(threads) >= 2, threads
    if platform.machine() in ("x86_64", "aarch64"):
        assert reader.syscall == "read", reader
    assert reader.wchan == "" or "pipe" in reader.wchan, reader  # "" if not ours to read
    main = next(t for t in thread_states(hung.pid) if t.tid == hung.pid)
    assert main.state == "S" and main.syscall in ("futex", "#202", "#98", ""), main  # join
    text = hang_report(hung.pid, native_timeout_s=0)
    assert text.startswith(f"{HANG_REPORT_MARK} of pid {hung.pid}"), text
    line = next(ln for ln in text.splitlines() if "'reader-thread'" in ln)
    assert f"{reader.tid} 'reader-thread' S (sleeping)" in line, line
    # the failure report's tail (`Child.tail`) reaches back to the report's first line
    assert log_tail("role log\n" * 50 + text, 1).startswith(HANG_REPORT_MARK)


def test_a_process_that_is_gone_gives_a_report_that_says_so() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert thread_states(proc.pid) == []
    assert "no /proc entry" in hang_report(proc.pid)


def test_system_call_names() -> None:
    assert syscall_name("0 0x3 0x7f 0x1", "x86_64") == "read"
    assert syscall_name("98 0x1", "aarch64") == "futex"
    assert syscall_name("999 0x1", "x86_64") == "#999"
    assert syscall_name("running") == "" and syscall_name("-1 0x0") == ""
    assert syscall_name("") == ""


def test_native_stacks_when_a_tool_is_installed_are_bounded(
        hung: subprocess.Popen[str]) -> None:
    """py-spy or gdb, where installed and allowed to attach; never longer than its
    timeout (plus the kill), and None rather than an error when it cannot."""
    t0 = time.monotonic()
    got = native_stacks(hung.pid, timeout_s=20)
    assert time.monotonic() - t0 < 30
    if got is None:
        pytest.skip("no py-spy or gdb here that may attach")
    tool, text = got
    assert tool in ("py-spy", "gdb") and "read" in text, text
    assert hung.poll() is None  # the tool detached; the process lives on until killed
