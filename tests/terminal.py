"""A real terminal for tests: a private tmux server (its own socket, ``tmux -L``) whose
sessions run one command in a pane of a given size, and the pane as a person sees it
(`Tmux.screen`, tmux's ``capture-pane``).

The server reads no user configuration (``-f`` a file of this module's own: no status
bar, so a session of 80x24 has a pane of 80x24 from its first output on) and
`Tmux.close` kills this server only (``kill-server`` on its own socket): its panes'
processes get SIGHUP with it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

from tests.helpers import wait_for

DONE = "[command exited "
"""What the pane prints once its command has exited (then it stays open, to be read)."""


def ensure_tmux(timeout_s: float = 600.0) -> str:
    """tmux's path, installing Debian's package first when it is missing (as root, with
    apt-get, as `tests.deploy.slurm_cluster` does for Slurm)."""
    path = shutil.which("tmux")
    if path:
        return path
    if os.geteuid() != 0:
        raise RuntimeError("tmux is not installed and this is not root: apt-get install tmux")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, timeout=timeout_s,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", "tmux"], check=True, env=env,
                   timeout=timeout_s, stdout=subprocess.DEVNULL)
    return shutil.which("tmux") or "tmux"


class Tmux:
    """One private tmux server; a context manager that kills it on exit."""

    def __init__(self, tmp: Path):
        self.exe = ensure_tmux()
        self.socket = f"sluice-test-{uuid.uuid4().hex[:10]}"
        self.conf = tmp / "tmux.conf"
        self.conf.write_text("set -g status off\nset -g history-limit 2000\n")
        self.sessions = 0

    def tmux(self, *args: str) -> str:
        return subprocess.run([self.exe, "-L", self.socket, "-f", str(self.conf), *args],
                              check=True, capture_output=True, text=True, timeout=30).stdout

    def start(self, argv: list[str], cols: int, rows: int, cwd: Path,
              env: dict[str, str] | None = None) -> str:
        """Run ``argv`` in a new detached session of ``cols`` x ``rows`` (the environment
        is tmux's plus ``env``; COLUMNS and LINES unset, so the program reads the pane's
        size from the terminal as it would in anyone's shell); returns the session name.
        After the command, the pane prints `DONE` and its exit code and stays open."""
        self.sessions += 1
        name = f"s{self.sessions}"
        cmd = " ".join(["env", "-u", "COLUMNS", "-u", "LINES",
                        *(shlex.quote(f"{k}={v}") for k, v in (env or {}).items()),
                        shlex.join(argv)])
        self.tmux("new-session", "-d", "-s", name, "-x", str(cols), "-y", str(rows),
                  "-c", str(cwd), f"{cmd}; echo \"{DONE}$?]\"; exec sleep 3600")
        size = self.tmux("display-message", "-p", "-t", name,
                         "#{pane_width}x#{pane_height}").strip()
        assert size == f"{cols}x{rows}", size
        return name

    def screen(self, name: str, joined: bool = False) -> list[str]:
        """The pane's visible lines (``rows`` of them, trailing spaces dropped); ``joined``:
        a line the terminal wrapped is given as one (``capture-pane -J``), so the two
        captures differ exactly when some line of the screen is a continuation."""
        return [x.rstrip() for x in self.tmux("capture-pane", "-p", *(["-J"] if joined else []),
                                              "-t", name).splitlines()]

    def wait_done(self, name: str, timeout_s: float) -> list[str]:
        """The screen once the session's command has exited (its `DONE` line shows)."""
        return wait_for(lambda: (s := self.screen(name)) and any(DONE in x for x in s) and s,
                        timeout_s, lambda: f"the command in tmux session {name} to exit:\n"
                        + "\n".join(self.screen(name)), interval_s=0.3)

    def close(self) -> None:
        subprocess.run([self.exe, "-L", self.socket, "kill-server"], capture_output=True,
                       timeout=30)

    def __enter__(self) -> Tmux:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
