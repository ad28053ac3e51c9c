"""A generator's check that its weights are still of use before it admits more work.

The trainer retires ``stale`` every group whose oldest token is more than
``trainer.max_staleness`` versions behind its weights (`trainer.reader.is_stale`). A
generator whose engine is that far behind the run's ``state.version`` (its weights fail
to load, or load slower than the trainer publishes) would keep admitting, decoding and
emitting groups that are all thrown away: the gate keeps turning, the run makes no
progress (a livelock). So such a generator stops admitting and keeps trying to load the
newest version; it admits again once it has one within ``max_staleness``. A batch already
admitted when it falls behind is still generated (its leases are held): at most
``generation.concurrent_batches`` batches are wasted, and nothing is ever stranded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("sluice.generator")

RETRY_MIN_S = 0.1
RETRY_MAX_S = 5.0
"""While behind, the newest version is tried again after RETRY_MIN_S, doubling up to
RETRY_MAX_S (a failure may be transient: a store still syncing), and at once when an
announcement arrives."""


class WeightsBehind:
    """What a generator knows of the run's version, and whether it is too far behind it.

    ``run_version`` only moves forward: it is fed the ``state.version`` of each admission
    reply and the version of each announcement the control watcher sees (an announcement
    is written before ``state.version`` moves, so it is never ahead of a real version)."""

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.run_version: int | None = None  # None: not read yet (`produce` reads it once)
        self.waiting = False  # the heartbeat's ``waiting_for_weights``
        self.wait_s = 0.0  # total time spent not admitting because of it
        self.pauses = 0
        self._logged = False

    def saw(self, version: int) -> None:
        self.run_version = max(self.run_version or 0, int(version))

    def behind(self, engine_version: int) -> int:
        """How many versions the engine is behind the run (0 when current or unknown)."""
        return max(0, (self.run_version or 0) - engine_version)

    def too_old(self, engine_version: int) -> bool:
        return self.behind(engine_version) > self.max_staleness

    async def wait_current(self, engine_version: Callable[[], int],
                           catch_up: Callable[[], Awaitable[None]], announced: asyncio.Event,
                           stop: asyncio.Event) -> None:
        """Return at once when the engine is recent enough; else, until it is (or ``stop``):
        ``catch_up()`` (load the newest announcement), then wait for the next
        announcement or the backoff. Logged once per process, so a generator that falls
        behind at every step does not flood its log; the heartbeat tells every time."""
        if not self.too_old(engine_version()):
            return
        self.waiting, self.pauses = True, self.pauses + 1
        if not self._logged:
            self._logged = True
            log.warning("weights v%d are %d versions behind the run's v%s (more than "
                        "max_staleness %d): not admitting until a newer version loads "
                        "(logged once; the heartbeat's waiting_for_weights tells)",
                        engine_version(), self.behind(engine_version()), self.run_version,
                        self.max_staleness)
        t0, delay_s = time.monotonic(), RETRY_MIN_S
        try:
            while not stop.is_set():
                await catch_up()
                if not self.too_old(engine_version()):
                    return
                announced.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(announced.wait(), delay_s)
                delay_s = RETRY_MIN_S if announced.is_set() else min(delay_s * 2, RETRY_MAX_S)
        finally:
            self.waiting = False
            self.wait_s += time.monotonic() - t0
