"""Wiring the trainer lock's fence into the trainer's writes (`trainer.lock`).

Kept out of `trainer.trainer` (already long): what a trainer does right after it takes
the lock, before it writes anything, and how a lost lock ends it. Invariant: every write
of the trainer either carries its generation (the bus: `pipeline.bus.fencing`) or calls
`TrainerLock.guard` right before its commit point (the checkpoint folder and the weight
store), so a trainer that lost its lock to a newer job writes nothing more.
"""

from __future__ import annotations

import logging
from typing import Any

from pipeline.bus.fencing import FencedOut
from pipeline.bus.ledger import Ledger
from pipeline.weights.store import WeightStore
from trainer.checkpoint import Checkpointer
from trainer.lock import TrainerLock, TrainerLockLost

log = logging.getLogger("sluice.trainer")


def arm(lock: TrainerLock, ckpt: Checkpointer, transport: Any) -> None:
    """After `TrainerLock.acquire`: every checkpoint and weight-store commit checks the
    fence first, and the temporary folders a crashed writer left (of any PID: only the
    lock's holder writes here) are removed."""
    ckpt.guard = lock.guard
    ckpt.generation = lock.generation or 0
    ckpt.clean_temp()
    store = getattr(transport, "store", None)
    if isinstance(store, WeightStore):
        store.guard = lock.guard
        store.clean_temp()


def lost(lock: TrainerLock, ledger: Ledger, err: BaseException) -> TrainerLockLost:
    """The error a trainer that lost its lock exits with (`FencedOut` from a refused bus
    write, or `TrainerLockLost` from a guard or the refresh). Writes a ledger line, so
    that an intent whose call the fence refused is not the ledger's last line: the audit
    then reads it as a call that did nothing (it stored no result in Redis)."""
    out = lock.refused(err) if isinstance(err, FencedOut) else (
        err if isinstance(err, TrainerLockLost) else lock.lost_error(err))
    ledger.write("lock_lost", None, reason=str(out))
    log.error("%s", out)
    return out
