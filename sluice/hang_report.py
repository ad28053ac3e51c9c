"""What a hung role's threads were doing in the kernel, read before it is SIGKILLed.

`sluice up` asks a straggler for its Python stacks first (`pipeline.runtime.STACKS_SIGNAL`,
written by `faulthandler`), but a thread blocked in C (a collective, a driver call, a
lock taken in native code) shows only its last Python frame there. This report adds,
per thread (``/proc/PID/task/TID``): its name (``comm``: what native libraries name
their threads), its state (``stat``), where it sleeps in the kernel (``wchan``), the
system call it is in (``syscall``), its kernel stack where readable (``stack``: root
only, may be empty; shown for threads in uninterruptible sleep, where wchan is not
enough), and once per process a native stack of every thread from py-spy or
gdb when one is installed and may attach, each bounded by a timeout. Nothing in it is
required: whatever cannot be read is left out, and the report never raises. Linux only
(elsewhere the report says so).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipeline.runtime import HANG_REPORT_MARK

NATIVE_TIMEOUT_S = 5.0
"""The most one native-stack tool may take (attaching to a big process loads symbols);
it is then killed and the report goes on without it."""
NATIVE_MAX_LINES = 200  # of a tool's output: a report must not bury the log
KERNEL_STACK_LINES = 8

STATES = {"R": "running", "S": "sleeping", "D": "disk sleep (uninterruptible)",
          "T": "stopped", "t": "traced", "Z": "zombie", "X": "dead", "I": "idle"}

# the system calls a hung thread is usually in, by number, per machine (others: the number)
SYSCALLS = {
    "x86_64": {0: "read", 1: "write", 7: "poll", 23: "select", 35: "nanosleep",
               43: "accept", 45: "recvfrom", 47: "recvmsg", 61: "wait4", 202: "futex",
               230: "clock_nanosleep", 232: "epoll_wait", 270: "pselect6", 271: "ppoll",
               281: "epoll_pwait", 288: "accept4", 441: "epoll_pwait2"},
    "aarch64": {63: "read", 64: "write", 73: "ppoll", 72: "pselect6", 98: "futex",
                101: "nanosleep", 115: "clock_nanosleep", 22: "epoll_pwait", 202: "accept",
                207: "recvfrom", 212: "recvmsg", 242: "accept4", 260: "wait4",
                441: "epoll_pwait2"},
}


@dataclass
class ThreadState:
    """One thread of a process as ``/proc`` shows it; "" where it could not be read."""

    tid: int
    name: str
    state: str  # one letter of `STATES`
    wchan: str  # kernel function it sleeps in ("" when running or unreadable)
    syscall: str  # name (or number) of the system call it is blocked in; "" when none
    kernel_stack: list[str]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:  # gone, or not ours to read (wchan, syscall, stack need privileges)
        return ""


def syscall_name(raw: str, machine: str | None = None) -> str:
    """The system call in a ``/proc/.../syscall`` line: its name when known, else its
    number; "" when the thread is in none ("running") or the file was unreadable."""
    head = raw.split(" ", 1)[0] if raw else ""
    if not head.lstrip("-").isdigit() or int(head) < 0:
        return ""
    number = int(head)
    return SYSCALLS.get(machine or platform.machine(), {}).get(number, f"#{number}")


def thread_states(pid: int) -> list[ThreadState]:
    """Every thread of ``pid`` that still exists, in ``tid`` order (empty when the
    process is gone or there is no ``/proc``)."""
    task = Path(f"/proc/{pid}/task")
    try:
        tids = sorted(int(d.name) for d in task.iterdir() if d.name.isdigit())
    except OSError:
        return []
    out = []
    for tid in tids:
        d = task / str(tid)
        stat = _read(d / "stat")
        if not stat:
            continue  # the thread ended meanwhile
        # "tid (comm) S ...": comm may hold spaces and parentheses, so split at the last ")"
        name = stat[stat.find("(") + 1:stat.rfind(")")]
        state = stat[stat.rfind(")") + 1:].split()[0]
        wchan = _read(d / "wchan")
        stack = [ln.split("] ", 1)[-1] for ln in _read(d / "stack").splitlines()]
        out.append(ThreadState(tid, _read(d / "comm") or name, state,
                               "" if wchan == "0" else wchan, syscall_name(_read(d / "syscall")),
                               stack[:KERNEL_STACK_LINES]))
    return out


def native_stacks(pid: int, timeout_s: float = NATIVE_TIMEOUT_S) -> tuple[str, str] | None:
    """(tool, output) of the first of py-spy / gdb that is installed and dumps every
    thread's native stack of ``pid`` within ``timeout_s``; None when neither could.
    The tool runs in its own session and is killed with it at the timeout."""
    tools = [("py-spy", ["py-spy", "dump", "--native", "--pid", str(pid)]),
             # no init files, scripts or symbol downloads: only the attached process's stacks
             ("gdb", ["gdb", "-batch", "-nx", "-iex", "set auto-load off",
                      "-iex", "set debuginfod enabled off", "-p", str(pid),
                      "-ex", "thread apply all bt"])]
    for name, argv in tools:
        if shutil.which(argv[0]) is None:
            continue
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the tool's own session
            proc.communicate()
            continue
        if proc.returncode == 0 and out.strip():
            lines = out.strip().splitlines()
            if name == "gdb":  # its thread headings and frames, not its chatter
                lines = [ln for ln in lines if ln.startswith(("Thread ", "#"))] or lines
            if len(lines) > NATIVE_MAX_LINES:
                lines = [*lines[:NATIVE_MAX_LINES], f"... ({len(lines)} lines in all)"]
            return name, "\n".join(lines)
    return None


def hang_report(pid: int, *, native_timeout_s: float = NATIVE_TIMEOUT_S) -> str:
    """The report of ``pid`` as text, starting with a `HANG_REPORT_MARK` line (so
    `pipeline.runtime.log_tail` reaches back to it); ``native_timeout_s`` <= 0: no
    native-stack tool is tried."""
    threads = thread_states(pid)
    rows = [f"{HANG_REPORT_MARK} of pid {pid}: {len(threads)} threads "
            "(name, state, kernel wait, system call)"]
    if not threads:
        rows.append("  (no /proc entry: the process is gone, or not Linux)")
    for t in threads:
        rows.append(f"  {t.tid} {t.name!r} {t.state} ({STATES.get(t.state, '?')})"
                    + (f" wchan={t.wchan}" if t.wchan else "")
                    + (f" syscall={t.syscall}" if t.syscall else ""))
        if t.state == "D":  # stuck in the kernel (a driver, a file system): show where
            rows += [f"      {frame}" for frame in t.kernel_stack]
    tool = native_stacks(pid, native_timeout_s) if threads and native_timeout_s > 0 else None
    if tool is not None:
        rows += [f"native stacks ({tool[0]}):", tool[1]]
    elif threads and native_timeout_s > 0:
        rows.append("native stacks: none (no py-spy or gdb installed that could attach "
                    f"within {native_timeout_s:g} s)")
    rows.append("=== end of hang report")
    return "\n".join(rows)
