"""The trainer lock's races (`trainer.lock.TrainerLock`), on a real redis-server.

The two rules: a trainer never refuses its OWN writes because its lock expired and it
took it back (a Redis restart, a holder alive but slow, a Redis that lost its data), and
always refuses once another job took the lock. A "slow" holder is one whose refresh is
stopped (`_pause`): its lock expires while it lives, as it would under a long stall.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from pipeline.bus import control
from pipeline.bus.client import Bus
from pipeline.bus.codec import encode
from pipeline.bus.fencing import FencedOut
from pipeline.bus.schema import WeightsPublished
from pipeline.ports import free_port
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import wait_for_async
from trainer.lock import TrainerLock, TrainerLockHeld, TrainerLockLost

TTL_S = 1.0


def _w(version: int) -> bytes:
    return encode(WeightsPublished(version=version, step=version, uri="file:///w",
                                   format="safetensors", sha256="", nbytes=0, t=0.0))


async def _locked(url: str, run: str, holder: str) -> TrainerLock:
    lock = TrainerLock(Bus.connect(url, run, reconnect_max_s=0.2), TTL_S, holder=holder)
    await lock.acquire()
    return lock


def _pause(lock: TrainerLock) -> None:
    """The holder stalls: its refresh stops (its lock will expire while it lives)."""
    assert lock._task is not None
    lock._task.cancel()


def _resume(lock: TrainerLock) -> None:
    lock._task = asyncio.create_task(lock._refresh())


async def _expired(lock: TrainerLock) -> None:
    await wait_for_async(lambda: _gone(lock), 30, "the lock to expire")


async def _gone(lock: TrainerLock) -> bool:
    return not await lock.bus.r.exists(lock.bus.keys.trainer_lock)


async def _close(*locks: TrainerLock) -> None:
    for lock in locks:
        await lock.release()
        await lock.bus.close()


def test_a_slow_holder_whose_lock_expired_keeps_its_generation(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    """Nobody took the expired lock: the holder's next guard (a checkpoint about to be
    renamed) takes it back with its own generation, and its writes go on."""

    async def go() -> None:
        a = await _locked(redis_server.url, run_name, "a")
        try:
            gen = a.generation
            _pause(a)
            await _expired(a)
            await asyncio.to_thread(a.guard)  # raised TrainerLockLost before the fix
            assert not a.lost and a.generation == gen
            assert await a.bus.r.get(a.bus.keys.trainer_lock) == b"a"
            await a.bus.announce(_w(1), 1, maxlen=100)
        finally:
            await _close(a)

    arun(go())


def test_a_lost_holder_never_takes_the_lock_back(redis_server: EmbeddedRedis,
                                                 run_name: str) -> None:
    """A (paused) lost the lock to B; B is slow in turn and its lock expires. A waking up
    must see it lost and take nothing: not the lock, not a new generation that would
    fence out B, who takes its own lock back and goes on."""

    async def go() -> None:
        a = await _locked(redis_server.url, run_name, "a")
        _pause(a)
        await _expired(a)
        b = await _locked(redis_server.url, run_name, "b")
        try:
            assert b.generation is not None and b.generation > (a.generation or 0)
            _pause(b)
            await _expired(b)
            _resume(a)
            await wait_for_async(lambda: _now(a.lost), 30, "A to see its lock lost")
            assert await _gone(b), "A took the lock after losing it"
            fence = int(await b.bus.r.hget(b.bus.keys.state, "fence"))
            assert fence == b.generation, "A raised the fence past B's generation"
            await asyncio.to_thread(b.guard)
            assert not b.lost
            with pytest.raises(FencedOut):
                await a.bus.announce(_w(1), 1, maxlen=100)
            with pytest.raises(TrainerLockLost, match="lost the trainer lock to"):
                await asyncio.to_thread(a.guard)
        finally:
            await _close(a, b)

    arun(go())


def test_a_new_incarnation_of_the_same_job_fences_out_the_old_one(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    """torchrun restarts a job under the same id, which takes its live lock back at
    once: it must still get a new generation, so that a stalled process of the old
    incarnation writes nothing."""

    async def go() -> None:
        old = await _locked(redis_server.url, run_name, "torchrun:job")
        new = await _locked(redis_server.url, run_name, "torchrun:job")
        try:
            assert (new.generation or 0) > (old.generation or 0)
            with pytest.raises(FencedOut):
                await old.bus.announce(_w(1), 1, maxlen=100)
            await wait_for_async(lambda: _now(old.lost), 30, "the old one to see it lost")
            await new.bus.announce(_w(1), 1, maxlen=100)
            assert not new.lost
        finally:
            await _close(old, new)

    arun(go())


def test_two_trainers_starting_at_the_same_instant(redis_server: EmbeddedRedis,
                                                   run_name: str) -> None:
    """Exactly one takes the lock; the other waits out twice the TTL while the winner
    refreshes it, and is refused naming the holder."""

    async def go() -> None:
        locks = [TrainerLock(Bus.connect(redis_server.url, run_name), TTL_S, holder=h)
                 for h in ("x", "y")]
        got = await asyncio.gather(*(lock.acquire() for lock in locks),
                                   return_exceptions=True)
        try:
            held = [e for e in got if isinstance(e, TrainerLockHeld)]
            assert len(held) == 1 and got.count(None) == 1, got
            winner = locks[got.index(None)]
            assert f"({winner.holder})" in str(held[0])
            assert int(await winner.bus.r.hget(winner.bus.keys.state, "fence")) == \
                winner.generation
            await asyncio.to_thread(winner.guard)
        finally:
            await _close(*locks)

    arun(go())


def test_a_redis_restart_longer_than_the_ttl_keeps_the_generation(tmp_path: Path,
                                                                  run_name: str) -> None:
    """Redis (AOF) down for longer than the TTL: the lock expired meanwhile. The
    holder's refresh takes it back with its generation; no write of its own is refused."""
    srv = EmbeddedRedis(tmp_path / "redis", port=free_port(), appendonly=True)
    srv.start()

    async def go() -> None:
        a = await _locked(srv.url, run_name, "a")
        try:
            gen = a.generation
            await asyncio.to_thread(srv.stop)
            down = time.monotonic()
            await wait_for_async(lambda: _now(time.monotonic() - down > 2 * TTL_S), 30,
                                 "the lock's TTL to pass while Redis is down")
            await asyncio.to_thread(srv.start)
            await wait_for_async(
                lambda: _holds(a), 60, "the holder's refresh to take its lock back")
            assert not a.lost and a.generation == gen
            await asyncio.to_thread(a.guard)
            await a.bus.announce(_w(1), 1, maxlen=100)
            await control.finish(a.bus, "max_steps")
        finally:
            await _close(a)

    try:
        arun(go())
    finally:
        srv.stop()


def test_a_redis_that_lost_its_data_does_not_lose_the_holder(redis_server: EmbeddedRedis,
                                                             run_name: str) -> None:
    """Redis restarted empty (no persistence, a failover to a replica that lacked the
    newest writes): the lock and ``state.fence`` are gone. The holder takes the lock
    back with its own generation and the fence moves back up to it (it only moves
    forward), so an older generation is still refused."""

    async def go() -> None:
        older = await _locked(redis_server.url, run_name, "older")
        _pause(older)
        await _expired(older)
        a = await _locked(redis_server.url, run_name, "a")
        try:
            gen = a.generation
            await a.bus.r.delete(a.bus.keys.trainer_lock, a.bus.keys.state)
            await wait_for_async(lambda: _holds(a), 30, "the holder to take its lock back")
            assert not a.lost and a.generation == gen
            assert int(await a.bus.r.hget(a.bus.keys.state, "fence")) == gen
            await a.bus.announce(_w(1), 1, maxlen=100)
            with pytest.raises(FencedOut):
                await older.bus.announce(_w(2), 2, maxlen=100)
        finally:
            await _close(older, a)

    arun(go())


async def _holds(lock: TrainerLock) -> bool:
    try:
        return await lock.bus.r.get(lock.bus.keys.trainer_lock) == lock.holder.encode()
    except Exception:  # Redis still starting
        return False


async def _now(value: bool) -> bool:
    return value


@pytest.mark.parametrize("writer", ["weights", "checkpoint"])
def test_a_write_whose_folder_the_new_holder_removed_says_the_lock_is_lost(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, writer: str) -> None:
    """A stalls inside a weight publish or a checkpoint write; B takes over and, like
    every new holder (`trainer.fenced.arm`), removes the temporary folders it finds,
    A's among them. A's write then fails: it must fail as `TrainerLockLost` (the trainer
    exits naming the reason), not as a raw FileNotFoundError, and leave nothing."""
    import torch

    from pipeline.durable import TEST_PAUSE_ENV
    from pipeline.weights.store import WeightStore
    from trainer.checkpoint import Checkpointer, TrainerState

    monkeypatch.setenv(TEST_PAUSE_ENV, "2")  # after each file: A is inside its write
    ckpt_dir = tmp_path / "checkpoints"

    def store() -> WeightStore | Checkpointer:
        return (WeightStore(tmp_path / "weights") if writer == "weights"
                else Checkpointer(ckpt_dir, keep=2))

    def write(target: WeightStore | Checkpointer) -> object:
        if isinstance(target, WeightStore):
            return target.commit([(f"f{i}.bin", b"x" * 64) for i in range(4)], fmt="raw",
                                 version=1, step=1)
        model = torch.nn.Linear(4, 4)
        return target.save(model, torch.optim.AdamW(model.parameters()), TrainerState(step=1))

    async def go() -> None:
        a = TrainerLock(Bus.connect(redis_server.url, run_name), TTL_S, holder="a",
                        fence_dir=ckpt_dir)
        await a.acquire()
        a_store = store()
        a_store.guard = a.guard
        job = asyncio.ensure_future(asyncio.to_thread(write, a_store))
        await wait_for_async(lambda: _now(any(tmp_path.glob("*/.tmp-*")) or job.done()),
                             60, "A to be inside its write")
        _pause(a)  # A stalls
        await _expired(a)
        b = TrainerLock(Bus.connect(redis_server.url, run_name), TTL_S, holder="b",
                        fence_dir=ckpt_dir)
        try:
            await b.acquire()
            store().clean_temp()  # what B does right after it took the lock
            with pytest.raises(TrainerLockLost, match="lost the trainer lock to"):
                await asyncio.wait_for(job, 120)  # was FileNotFoundError
            assert not [p for p in tmp_path.glob("*/*") if p.name != "FENCE"]
        finally:
            await _close(a, b)

    arun(go())
