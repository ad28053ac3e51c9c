"""Processes of the GPU check: running one stage in a child process under a timeout,
killing everything a stage started, and the hang a CI run injects.

Standard library only: the parent imports this without torch, so a ``--cpu`` check
starts at once and the parent never touches a GPU itself.

Invariants (`run_stage_process`):
- a stage runs as ``python -m benchmarks.gpu_check --stage NAME --row-out FILE`` in a
  process group of its own (``start_new_session``), ``HF_HUB_OFFLINE=1`` in its
  environment, its output in its own log file (never a pipe the parent must drain);
- the parent waits for it at most ``timeout_s``; then it SIGKILLs the whole group (a
  stage stuck in a collective ignores everything gentler, and its spawned ranks are in
  that group) and records ``StageHung`` naming the stage and the timeout. It does not
  join a child that survives SIGKILL (one stuck in the driver): it waits a few seconds,
  says so in the row, and goes on;
- whatever way the stage ended, its group and every group it registered
  (`register_process_group`: a vLLM server runs in a session of its own) are killed, so
  no process a stage started outlives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout: stages run from here
PGID_FILE_ENV = "SLUICE_GPU_CHECK_PGID_FILE"  # where a stage lists the groups it started
REAP_WAIT_S = 10.0  # after SIGKILL: how long to wait for the child before moving on
HELPER_LIFETIME_S = 600  # the injected hang's helpers end by themselves after this
LOG_TAIL_LINES = 25


def vllm_python() -> Path | None:
    """The vLLM servers' interpreter (``$SLUICE_VLLM_PYTHON``, else ``.venv-vllm``), or
    None where there is none (as `tests.vllm.conftest` finds it)."""
    p = Path(os.environ.get("SLUICE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    return p if p.exists() else None


def register_process_group(pgid: int) -> None:
    """Tell the parent that this stage started process group ``pgid`` outside its own
    (a server in a session of its own): the parent kills it when the stage ends or
    hangs. A no-op outside the check (no ``PGID_FILE_ENV``)."""
    path = os.environ.get(PGID_FILE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{pgid}\n")


def registered_groups(path: Path) -> list[int]:
    try:
        return [int(x) for x in path.read_text().split()]
    except (OSError, ValueError):
        return []


def kill_groups(pgids: list[int]) -> None:
    """SIGKILL every process of each group (gone already: nothing to do)."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def live_group_members(pgid: int) -> list[int]:
    """PIDs of processes in group ``pgid`` that still run (zombies, which hold nothing,
    excluded: a killed grandchild waits for its reaper). Linux (``/proc``) only."""
    alive = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            alive.append(int(d.name))
    return alive


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def run_stage_process(name: str, cmd: list[str], row_out: Path, log_path: Path,
                      timeout_s: float, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """Run stage ``name``'s process (``cmd``, which writes its row to ``row_out``) and
    return its report row: the child's own, or one saying how it failed or hung; with
    ``seconds``, ``pid`` and ``exit_code`` added."""
    pgid_file = row_out.with_name(row_out.name + ".pgids")
    for p in (row_out, pgid_file):
        p.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**env, PGID_FILE_ENV: str(pgid_file)}, cwd=cwd,
                                start_new_session=True)
    row: dict[str, Any]
    try:
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            row = _hung(name, proc, timeout_s, pgid_file)
        else:
            row = _finished(name, code, row_out, log_path)
    finally:  # a finished stage's leftovers, or the parent interrupted mid-stage
        groups = [proc.pid, *registered_groups(pgid_file)]
        kill_groups(groups)
        if proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=REAP_WAIT_S)
    row.update(seconds=round(time.monotonic() - t0, 2), pid=proc.pid,
               exit_code=proc.returncode, log=str(log_path), process_groups=groups)
    if not row.get("ok"):
        row.setdefault("log_tail", log_tail(log_path))
    return row


def _hung(name: str, proc: subprocess.Popen[bytes], timeout_s: float,
          pgid_file: Path) -> dict[str, Any]:
    kill_groups([proc.pid, *registered_groups(pgid_file)])
    error = (f"StageHung: stage {name!r} did not finish within its {timeout_s:g} s "
             f"timeout; its process group (pid {proc.pid}) and the groups it started "
             "were killed")
    try:
        proc.wait(timeout=REAP_WAIT_S)
    except subprocess.TimeoutExpired:
        error += (f"; pid {proc.pid} was still there {REAP_WAIT_S:g} s after SIGKILL "
                  "(stuck in the kernel or the driver?) and was left behind")
    return {"ok": False, "error": error}


def _finished(name: str, code: int, row_out: Path, log_path: Path) -> dict[str, Any]:
    try:
        row = json.loads(row_out.read_text())
    except (OSError, ValueError):
        return {"ok": False, "error": f"stage {name!r} exited {code} without a report "
                                      f"row (crashed? see {log_path})"}
    if code != 0 and row.get("ok"):
        row = {**row, "ok": False, "error": f"stage {name!r} wrote ok but exited {code}"}
    return row


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``data`` as JSON at ``path``, replaced atomically: a reader (or a later crash)
    sees the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def hang_forever() -> None:
    """The hang CI injects (``--hang-stage``): block forever as a stage stuck in a
    collective does, ignoring SIGTERM, with one helper process in this process group (as
    a spawned rank is) and one in a session of its own, registered with the parent (as a
    vLLM server is). The parent must kill all three; the helpers also end by themselves
    after ``HELPER_LIFETIME_S``, so a broken parent leaves nothing for long."""
    helper = [sys.executable, "-c", f"import time; time.sleep({HELPER_LIFETIME_S})"]
    in_group = subprocess.Popen(helper)
    own_session = subprocess.Popen(helper, start_new_session=True)
    register_process_group(own_session.pid)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"gpu_check: hanging on purpose (helpers {in_group.pid}, {own_session.pid})",
          flush=True)
    threading.Event().wait()
