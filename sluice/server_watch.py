"""`sluice up` starts again each vLLM server it launched that exits while the run goes on.

A server exits when it crashes, and when the trainer asks it to (``POST /sluice/exit``,
`workers.engines.vllm_guard`: a weight push cut short left its workers blocked in NCCL
for good). Either way the run should cost a restart, not its generation: the server is
started again on the same port (the URL the generators know; they route around it
meanwhile, `workers.engines.vllm_pool`), and it loads the newest version from the store
when a generator next reloads it. What its old process group left behind (an engine core
whose API server exited) is killed first, so the GPU memory is free for the new one.

Restarts follow the roles' policy (`sluice.restarts.RestartPolicy`: backoff, and a
server that exits more than ``up.max_restarts`` times within ``up.restart_window_s``
ends the run, named). Invariants: a server stopped by `sluice up` itself (the run's end)
is never restarted; `poll` never blocks on a server's readiness (it only starts it).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from sluice.restarts import RestartPolicy
from sluice.vllm_launch import LocalServer, ServerError


@dataclass
class ServerWatch:
    servers: list[LocalServer]
    policy: RestartPolicy
    restart_at: dict[int, float] = field(default_factory=dict)  # index → when to start
    restarts: int = 0

    def name(self, i: int) -> str:
        return f"vllm server {self.servers[i].url}"

    def poll(self, now_s: float | None = None) -> str | None:
        """Restart what exited (after its backoff); the reason the run must end (a
        server given up on), or None."""
        now_s = time.time() if now_s is None else now_s
        for i, server in enumerate(self.servers):
            proc = server.proc
            if proc is None or server.terminated:
                continue
            if i in self.restart_at:
                if now_s >= self.restart_at[i]:
                    del self.restart_at[i]
                    try:
                        server.start()
                    except ServerError as e:
                        return f"{self.name(i)} could not be started again: {e}"
                    self.restarts += 1
                continue
            code = proc.poll()
            if code is None:
                continue
            server.stop(grace_s=0)  # its group's leftovers: the GPU memory they hold
            delay = self.policy.on_crash(self.name(i), now_s)
            if delay is None:
                return (f"{self.name(i)} exited with code {code} "
                        f"({self.policy.count(self.name(i))} exits in "
                        f"{self.policy.window_s:g} s); log: {server.log_path}")
            print(f"sluice: {self.name(i)} exited with code {code}; starting it again in "
                  f"{delay:g} s (log: {server.log_path})", file=sys.stderr, flush=True)
            self.restart_at[i] = now_s + delay
        return None
