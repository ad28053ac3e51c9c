"""When `sluice up` restarts a role that crashed: a process supervisor's policy, pure.

The pipeline survives any role dying — leases hand a dead generator's groups to another,
scorers reclaim a dead scorer's entries, the trainer resumes from its checkpoint — so a
crash (a non-zero exit, ``kill -9``) should cost a restart, not the run. Each crash of a
role is restarted after a backoff (``backoff_s`` doubling per crash still inside the
window, at most ``backoff_max_s``); a role that crashed more than ``max_restarts`` times
within ``window_s`` is given up on, and the run stops naming it. ``max_restarts = 0``
stops the run at the first crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    max_restarts: int = 3
    window_s: float = 300.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    crashes: dict[str, list[float]] = field(default_factory=dict)

    def on_crash(self, name: str, now_s: float) -> float | None:
        """Record a crash of ``name`` at ``now_s``: the delay before restarting it, or None
        when it has now crashed more than ``max_restarts`` times within ``window_s``."""
        recent = [t for t in self.crashes.get(name, []) if now_s - t < self.window_s]
        recent.append(now_s)
        self.crashes[name] = recent
        if len(recent) > self.max_restarts:
            return None
        return min(self.backoff_max_s, self.backoff_s * 2 ** (len(recent) - 1))

    def count(self, name: str) -> int:
        """Crashes of ``name`` recorded within the window of its latest one."""
        return len(self.crashes.get(name, []))
