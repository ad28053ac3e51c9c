"""One trainer job per run: a Redis lock with a TTL, held by the job's rank 0.

Two optimizers publishing into the same version directories would corrupt a run, so the
trainer takes ``sluice:{run}:trainer`` (SET PX, refreshed every third of the TTL) before
it reads anything. The holder id names the job: torchrun's ``TORCHELASTIC_RUN_ID`` when
set (a job restarted by torchrun after a rank died keeps its id and takes the lock back at
once), else ``host:pid``.

A trainer finding the lock held waits up to ``2 x ttl`` for it to expire (the holder may
be a trainer that was just killed: a dead holder stops refreshing) and then refuses to
start with the holder named. A live second trainer keeps refreshing, so it is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time

from pipeline.bus.client import Bus
from pipeline.runtime import LEAVE_TIMEOUT_S

log = logging.getLogger("sluice.trainer")


class TrainerLockHeld(RuntimeError):
    """Another trainer job is training this run."""


def job_id() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun:{run_id}"
    return f"{socket.gethostname()}:{os.getpid()}"


class TrainerLock:
    def __init__(self, bus: Bus, ttl_s: float, holder: str | None = None):
        self.bus, self.ttl_s = bus, ttl_s
        self.holder = holder or job_id()
        self._task: asyncio.Task[None] | None = None
        self.lost = False

    async def acquire(self, stop: asyncio.Event | None = None) -> None:
        """Take the lock, waiting out a dead holder's TTL; raise `TrainerLockHeld` if
        another job keeps it for ``2 x ttl``."""
        deadline = time.monotonic() + 2 * self.ttl_s
        warned = False
        while True:
            got = await self.bus.retrying(lambda: self.bus.trainer_lock(
                self.holder, int(self.ttl_s * 1000)), "trainer lock", stop)
            if got == self.holder:
                self._task = asyncio.create_task(self._refresh())
                return
            if time.monotonic() > deadline:
                raise TrainerLockHeld(
                    f"another trainer job ({got}) is training run {self.bus.keys.run!r}: "
                    "stop it first (one trainer job per run; more ranks go in one torchrun "
                    "job, `up.trainer_ranks`)")
            if not warned:
                log.warning("trainer lock held by %s: waiting up to %.0f s for it to expire",
                            got, 2 * self.ttl_s)
                warned = True
            await asyncio.sleep(min(0.5, self.ttl_s / 4))

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                got = await self.bus.trainer_lock(self.holder, int(self.ttl_s * 1000))
            except Exception as e:  # an outage: the bus reconnects; try again next beat
                log.debug("trainer lock refresh failed: %s", e)
                continue
            if got != self.holder and not self.lost:
                self.lost = True
                log.error("trainer lock taken by %s while this job ran (a stall longer "
                          "than %.0f s?): stopping", got, self.ttl_s)

    async def release(self) -> None:
        """Stop refreshing and drop the lock; bounded (`LEAVE_TIMEOUT_S` per wait) so
        a trainer that is leaving never waits on Redis or its own refresh forever."""
        if self._task is not None:
            self._task.cancel()
            # `asyncio.wait`, not `wait_for`: on a timeout it neither cancels again nor
            # waits for the task to acknowledge, so the bound holds whatever the task does
            await asyncio.wait({self._task}, timeout=LEAVE_TIMEOUT_S)
        with contextlib.suppress(Exception):  # bounded: a crashed trainer must exit
            await asyncio.wait_for(self.bus.release_trainer_lock(self.holder),
                                   LEAVE_TIMEOUT_S)
