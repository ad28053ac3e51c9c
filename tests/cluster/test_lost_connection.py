"""`Bus.retrying` rides out the connection failures a Redis Cluster client produces, on
both event loops, and still raises a bug at once.

The race reproduced here is the cause of the outage tests' crash: redis-py's cluster
client answers ``CLUSTERDOWN`` by closing every node connection (``aclose()``) while
other coroutines of the same role are in the middle of commands on them. Those
coroutines then see the connection vanish under them: a ``ConnectionError`` when
redis-py notices, an ``AttributeError`` (writer gone) or, under uvloop, a
``RuntimeError`` (transport closed) when it does not (`pipeline.bus.transient`). The
first test closes the client itself, as redis-py does, on the session's real cluster;
which member of the family a close produces depends on timing (one machine shows the
uvloop ``RuntimeError`` within the first few closes, another not in 200), so a second
test produces that member deterministically: it closes the socket under an idle pooled
connection behind redis-py's back, and the next command on it fails in uvloop's
transport.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, RedisError

from pipeline.bus.client import Bus
from pipeline.bus.transient import lost_connection, transient
from sluice.embedded import EmbeddedCluster, EmbeddedRedis

REDIS_PY_MAJOR = int(redis.__version__.split(".")[0])


def _hash(bus: Bus) -> str:
    """A hash key of the run (the trainer's heartbeats) these tests write and read."""
    return bus.keys.heartbeats("trainer")


LOOPS = ["asyncio", "uvloop"]
WORKERS = 8
RACE_BOUND_S = 90.0  # generous: the race ends far sooner once failures were seen
# closes under commands enough to have exercised the retry path many times over
ENOUGH_FAILURES = 200
# ... or, once at least one failure was seen, this long racing: redis-py 8 notices most
# closes itself and reconnects before the command, so 200 failures may never come
MIN_RACE_S = 10.0


def run_on(loop: str, main: Callable[[], Awaitable[Any]]) -> Any:
    return uvloop.run(main()) if loop == "uvloop" else asyncio.run(main())


@pytest.mark.parametrize("loop", LOOPS)
def test_bus_retries_ride_out_the_cluster_client_closing_connections_in_use(
        loop: str, redis_cluster: EmbeddedCluster, run_name: str) -> None:
    """Eight coroutines write through `Bus.retrying` while the client's connections are
    closed under them every few milliseconds, until enough failures of any kind have
    been seen; none of the coroutines may fail, and every write lands."""
    async def main() -> tuple[Counter[str], dict[int, int], dict[bytes, bytes]]:
        bus = Bus.connect(redis_cluster.url, run_name, cluster=True, reconnect_max_s=0.05)
        seen: Counter[str] = Counter()
        done = asyncio.Event()
        written = dict.fromkeys(range(WORKERS), 0)

        async def write(i: int, n: int) -> None:
            try:
                await bus.r.hset(_hash(bus), f"w{i}", n)
            except Exception as e:
                seen["unclassified" if lost_connection(e) else type(e).__name__] += 1
                raise

        async def worker(i: int) -> None:
            while not done.is_set():
                n = written[i] + 1
                await bus.retrying(lambda n=n: write(i, n), "a test write")
                written[i] = n

        async def closer() -> None:
            start = time.monotonic()

            def racing() -> bool:
                failures, elapsed = sum(seen.values()), time.monotonic() - start
                return failures < ENOUGH_FAILURES and elapsed < RACE_BOUND_S and not (
                    failures >= 1 and elapsed >= MIN_RACE_S)

            while racing():
                await asyncio.sleep(0.003)
                await bus.r.aclose()  # what redis-py does on CLUSTERDOWN
            done.set()

        try:
            await asyncio.gather(closer(), *(worker(i) for i in range(WORKERS)))
            final = await bus.retrying(lambda: bus.r.hgetall(_hash(bus)), "read back")
        finally:
            await bus.close()
        return seen, written, final

    seen, written, final = run_on(loop, main)
    print(f"[{loop}] connection failures seen and waited out: {dict(seen)}")
    assert sum(seen.values()) >= 1, "no connection was closed under a command"
    assert final == {f"w{i}".encode(): str(n).encode() for i, n in written.items()}


@pytest.mark.parametrize("loop", LOOPS)
def test_bus_retries_ride_out_a_socket_closed_under_an_idle_connection(
        loop: str, redis_cluster: EmbeddedCluster, run_name: str) -> None:
    """The socket of every idle connection of the cluster client is closed behind
    redis-py's back (it still believes them connected). Under uvloop the next write
    through `Bus.retrying` fails in the connection layer with the ``RuntimeError``
    redis-py does not classify (its transport is closed); the bus waits it out and the
    write lands. (The default loop reports the lost connection to redis-py before the
    write, which then reconnects; whatever it raises must be transient. redis-py 8 notices
    the closed transport itself under both loops and reconnects before the write.)"""
    async def main() -> tuple[int, list[BaseException], dict[bytes, bytes]]:
        bus = Bus.connect(redis_cluster.url, run_name, cluster=True, reconnect_max_s=0.05)
        failures: list[BaseException] = []

        async def write() -> None:
            try:
                await bus.r.hset(_hash(bus), "w", 1)
            except Exception as e:
                failures.append(e)
                raise

        try:
            await bus.retrying(lambda: bus.r.hset(_hash(bus), "w", 0), "warm up")
            closed = 0
            for node in bus.r.get_nodes():
                for conn in node._free:  # idle, and connected as far as redis-py knows
                    if conn.is_connected:
                        conn._writer.transport.close()
                        closed += 1
            await bus.retrying(write, "a test write")
            final = await bus.retrying(lambda: bus.r.hgetall(_hash(bus)), "read back")
        finally:
            await bus.close()
        return closed, failures, final

    closed, failures, final = run_on(loop, main)
    assert closed >= 1, "the cluster client held no idle connection to close"
    assert final == {b"w": b"1"}
    assert all(transient(e) for e in failures), failures
    if loop == "uvloop" and REDIS_PY_MAJOR < 8:  # redis-py 8 reconnects before the write
        assert failures, "the write did not meet the closed socket"
    if loop == "uvloop" and failures:
        first = failures[0]
        if isinstance(first, RedisError):  # redis-py >= 8 classifies it itself
            assert isinstance(first, RedisConnectionError), repr(first)
        else:
            assert isinstance(first, RuntimeError) and lost_connection(first), repr(first)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_bug_in_sluices_code_or_arguments_is_raised_not_waited_out(
        loop: str, redis_server: EmbeddedRedis, run_name: str) -> None:
    """Through `Bus.retrying` on a healthy Redis: our own AttributeError and RuntimeError
    (the lost-connection family's types), and a command redis-py refuses to build, are
    raised on the first attempt."""
    async def main() -> list[tuple[BaseException, int]]:
        bus = Bus.connect(redis_server.url, run_name)
        out = []
        try:
            for op in (_our_attribute_error, _our_runtime_error,
                       lambda: bus.r.hset(_hash(bus))):  # no field: redis-py refuses
                calls = 0

                async def counted(op: Callable[[], Awaitable[Any]] = op) -> Any:
                    nonlocal calls
                    calls += 1
                    return await op()

                try:
                    await asyncio.wait_for(bus.retrying(counted, "a buggy call"), 30)
                except (AttributeError, RuntimeError, DataError) as e:
                    out.append((e, calls))
        finally:
            await bus.close()
        return out

    raised = run_on(loop, main)
    assert [type(e) for e, _ in raised] == [AttributeError, RuntimeError, DataError]
    assert all(calls == 1 and not transient(e) for e, calls in raised), raised


async def _our_attribute_error() -> None:
    writer = None
    writer.writelines([b"PING"])  # type: ignore[attr-defined]


async def _our_runtime_error() -> None:
    raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")
