"""One trainer job per run: a Redis lock with a TTL, held by the job's rank 0.

Two optimizers publishing into the same version directories would corrupt a run, so the
trainer takes ``sluice:{run}:trainer`` (SET PX, refreshed every third of the TTL) before
it reads anything. The holder id names the job: torchrun's ``TORCHELASTIC_RUN_ID`` when
set (a job restarted by torchrun after a rank died keeps its id and takes the lock back at
once, with a new generation: no process of the old incarnation can write any more), else
``host:pid``.

A trainer finding the lock held waits up to ``2 x ttl`` for it to expire (the holder may
be a trainer that was just killed: a dead holder stops refreshing) and then refuses to
start with the holder named. A live second trainer keeps refreshing, so it is refused.

The lock is a fence, not only a mutex: a holder paused past the TTL (GC, swap, a stopped
container) wakes with writes already decided. Taking the lock gives a generation
(`pipeline.bus.fencing`) that every bus write of the trainer carries and that Redis
checks inside the write's script; the filesystem writes (checkpoints, their pruning, the
weight store) call `TrainerLock.guard` right before their rename or delete, which
refuses if the fence file of the checkpoint folder (``FENCE``, written by each new
holder) or the live lock in Redis names a newer generation. A refused write raises
`TrainerLockLost`, and the trainer stops at once without writing anything more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from pathlib import Path

from pipeline.bus.client import Bus
from pipeline.bus.fencing import FencedOut
from pipeline.runtime import LEAVE_TIMEOUT_S

log = logging.getLogger("sluice.trainer")


class TrainerLockHeld(RuntimeError):
    """Another trainer job is training this run."""


class TrainerLockLost(RuntimeError):
    """This job's lock (its generation) was taken by a newer trainer job: stop at once."""


GUARD_TIMEOUT_S = 120.0
"""How long a filesystem write waits (a Redis outage) to confirm the lock before failing."""

FENCE_FILE = "FENCE"
"""In the checkpoint folder: the newest holder's generation (the filesystem's fence)."""


def read_fence(folder: Path) -> int:
    """The generation in ``folder/FENCE`` (0 when there is none)."""
    try:
        return int((folder / FENCE_FILE).read_text().strip() or 0)
    except FileNotFoundError:
        return 0


def write_fence(folder: Path, generation: int) -> None:
    """Write ``generation`` to ``folder/FENCE`` durably (temp file, fsync, rename, fsync
    the folder). Only the job that just took the lock calls it, so it is the newest."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{FENCE_FILE}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{generation}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / FENCE_FILE)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def job_id() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"torchrun:{run_id}"
    return f"{socket.gethostname()}:{os.getpid()}"


class TrainerLock:
    def __init__(self, bus: Bus, ttl_s: float, holder: str | None = None,
                 fence_dir: Path | None = None):
        """``fence_dir``: the checkpoint folder, where the holder writes ``FENCE``."""
        self.bus, self.ttl_s = bus, ttl_s
        self.holder = holder or job_id()
        self.fence_dir = fence_dir
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.generation: int | None = None
        self.lost = False
        self.taken_by = ""
        self._lanes_raised = False  # the lanes' fences hold this generation

    async def acquire(self, stop: asyncio.Event | None = None) -> None:
        """Take the lock, waiting out a dead holder's TTL; raise `TrainerLockHeld` if
        another job keeps it for ``2 x ttl``."""
        deadline = time.monotonic() + 2 * self.ttl_s
        warned = False
        while True:
            got, gen, _ = await self.bus.retrying(lambda: self.bus.trainer_lock(
                self.holder, int(self.ttl_s * 1000)), "trainer lock", stop)
            if got == self.holder:
                # the fence first: from here on no write of an earlier holder succeeds
                self.generation = self.bus.fence = gen
                await self.bus.retrying(lambda g=gen: self.bus.raise_lane_fences(g), "fence", stop)
                self._lanes_raised = True
                if self.fence_dir is not None:
                    await asyncio.to_thread(write_fence, self.fence_dir, gen)
                self._loop = asyncio.get_running_loop()
                self._task = asyncio.create_task(self._refresh())
                log.info("trainer lock taken: generation %d", gen)
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
                await self.refresh()
            except Exception as e:  # an outage: the bus reconnects; try again next beat
                log.debug("trainer lock refresh failed: %s", e)

    async def refresh(self) -> bool:
        """One refresh with this job's generation (`pipeline.bus.scripts.TRAINER_LOCK`):
        True while the lock is ours, taking it back with the SAME generation if it
        expired and nobody took it since (a stall or a Redis outage longer than the TTL
        is not a loss); False, marking it lost, once a newer generation exists or
        another job holds it. A lock taken back after it expired re-raises the lanes'
        fences: the outage may have been a restart that lost them."""
        got, gen, taken = await self.bus.trainer_lock(self.holder, int(self.ttl_s * 1000),
                                                      self.generation)
        if got != self.holder or gen != self.generation:
            if not self.lost:
                self.mark_lost(got if got and got != self.holder else f"generation {gen}")
            return False
        self._lanes_raised = self._lanes_raised and not taken
        if not self._lanes_raised:
            await self.bus.raise_lane_fences(gen)
            self._lanes_raised = True
        return True

    def mark_lost(self, taken_by: str) -> None:
        self.lost, self.taken_by = True, taken_by
        log.error("trainer lock taken by %s while this job ran (a stall longer than "
                  "%.0f s?): stopping", taken_by, self.ttl_s)

    def lost_error(self, cause: BaseException | None = None) -> TrainerLockLost:
        """The error the trainer exits with, naming who took the lock."""
        return TrainerLockLost(
            f"lost the trainer lock to {self.taken_by or 'a newer trainer job'} (this job's "
            f"generation {self.generation}): another trainer is training this run "
            f"{self.bus.keys.run!r}; stopped without publishing, retiring or checkpointing"
            + (f" ({cause})" if cause else ""))

    async def check(self) -> None:
        """Raise `TrainerLockLost` unless this job still holds the lock with its
        generation, asked live of Redis (not the refresh loop's last answer) by a
        refresh: a lock that merely expired (nobody took it) is taken back, not lost."""
        if self.lost or not await self.bus.retrying(self.refresh, "trainer lock"):
            raise self.lost_error()

    def guard(self) -> None:
        """For a filesystem write, from a worker thread, right before its commit point
        (rename) or a delete: refuse (`TrainerLockLost`) if the fence file names a newer
        generation or the live lock is no longer ours. Blocking (one Redis round trip
        on the lock's event loop, bounded)."""
        if self.lost:
            raise self.lost_error()
        if self.fence_dir is not None and read_fence(self.fence_dir) > (self.generation or 0):
            self.mark_lost(f"generation {read_fence(self.fence_dir)} (the fence file)")
            raise self.lost_error()
        if self._loop is not None:
            # bounded: a write that cannot prove the lock is ours within this fails
            asyncio.run_coroutine_threadsafe(self.check(), self._loop).result(GUARD_TIMEOUT_S)

    def refused(self, e: FencedOut) -> TrainerLockLost:
        """A bus write refused by the fence: the lock is lost."""
        if not self.lost:
            self.mark_lost("a newer trainer job")
        return self.lost_error(e)

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
