"""Which errors `Bus.retrying` waits out (`pipeline.bus.transient`): lost connections
whatever their type and whichever event loop runs the role, and a cluster that is down;
never an error of sluice's own code, a reply redis-py classified, or a bad argument.

Each member of the lost-connection family is produced here by a real redis-py
connection over a real socket, under the default asyncio loop and under uvloop (the
loop the roles run on, `pipeline.runtime.run_role`). The cluster race that produced
them in the outage tests is reproduced on a real Redis Cluster in
tests/integration/test_lost_connection.py.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import uvloop
from redis.asyncio.connection import Connection
from redis.exceptions import (
    ClusterDownError,
    ConnectionError,
    DataError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)

from pipeline.bus.transient import in_connection_layer, lost_connection, transient

LOOPS = ["asyncio", "uvloop"]


def run_on(loop: str, main: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``main()`` on a fresh event loop of the named kind."""
    return uvloop.run(main()) if loop == "uvloop" else asyncio.run(main())


async def raised_by(coro: Awaitable[Any]) -> BaseException:
    try:
        await coro
    except Exception as e:
        return e
    raise AssertionError("expected the call to fail")


def test_errors_redis_py_classified_as_lost_or_down_are_waited_out() -> None:
    assert transient(ConnectionError("reset"))
    assert transient(ConnectionResetError(104, "reset"))
    assert transient(ClusterDownError("CLUSTERDOWN The cluster is down"))
    assert transient(TryAgainError("TRYAGAIN"))
    assert transient(RedisClusterException("Redis Cluster cannot be connected. Please ..."))
    assert not transient(RedisClusterException("Calling pipelined function evalsha is "
                                                "blocked when running redis in cluster mode"))
    assert not transient(ResponseError("WRONGTYPE"))
    assert transient(NoScriptError("No matching script. Please use EVAL."))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_whose_writer_is_gone_is_a_lost_connection(loop: str) -> None:
    """What redis-py's concurrent ``disconnect()`` leaves behind once it finished:
    ``'NoneType' object has no attribute 'writelines'``."""
    async def main() -> BaseException:
        conn = Connection()
        conn._writer = None
        return await raised_by(conn._send_packed_command([b"PING"]))

    e = run_on(loop, main)
    assert transient(e), repr(e)
    if isinstance(e, RedisError):  # redis-py >= 8 classifies it as a ConnectionError itself
        assert isinstance(e, ConnectionError), repr(e)
        return
    assert isinstance(e, AttributeError) and "writelines" in str(e)
    assert lost_connection(e)


@pytest.fixture
def socket_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_command_on_a_transport_closed_under_it_is_a_lost_connection(
        loop: str, socket_pair: tuple[socket.socket, socket.socket]) -> None:
    """What redis-py's concurrent ``disconnect()`` does while it waits for the close: the
    transport is closed, the writer still set. uvloop raises ``RuntimeError`` (the type
    the outage test's scorer died of); asyncio reports a reset connection."""
    mine, _peer = socket_pair

    async def main() -> BaseException:
        conn = Connection()
        conn._reader, conn._writer = await asyncio.open_connection(sock=mine)
        conn._writer.close()  # the concurrent disconnect, before its wait_closed()
        return await raised_by(conn.send_packed_command([b"*1\r\n$4\r\nPING\r\n"],
                                                        check_health=False))

    e = run_on(loop, main)
    if loop == "uvloop" and not isinstance(e, RedisError):  # redis-py < 8 leaves it raw
        assert isinstance(e, RuntimeError) and "closed" in str(e), repr(e)
    assert lost_connection(e) or isinstance(e, ConnectionError), repr(e)
    assert transient(e)


@pytest.mark.parametrize("loop", LOOPS)
def test_our_own_bugs_are_not_lost_connections(loop: str) -> None:
    """The same types raised by sluice's code, or by redis-py for a bad argument, are
    bugs: `Bus.retrying` must raise them, not wait forever."""
    async def main() -> list[BaseException]:
        conn = Connection()
        errors: list[BaseException] = []
        try:
            getattr(None, "writelines")()  # noqa: B009  # the family's message, from our code
        except AttributeError as ours:
            errors.append(ours)
        try:
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")
        except RuntimeError as ours:
            errors.append(ours)
        errors.append(await raised_by(_pack(conn)))  # packing nothing: IndexError in redis-py
        try:
            conn.pack_command("SET", "k", {"not": "encodable"})
        except DataError as bad_value:
            errors.append(bad_value)
        return errors

    for e in run_on(loop, main):
        assert not lost_connection(e) and not transient(e), repr(e)


async def _pack(conn: Connection) -> None:
    conn.pack_command()


def test_the_connection_layer_is_named_by_module_not_by_type() -> None:
    assert in_connection_layer("/x/site-packages/redis/asyncio/connection.py",
                               "_send_packed_command")
    assert in_connection_layer("uvloop/handles/handle.pyx", "uvloop.loop.UVHandle._ensure_alive")
    assert in_connection_layer(f"{asyncio.streams.__file__}", "drain")
    assert in_connection_layer("/x/site-packages/redis/_parsers/hiredis.py", "read_from_socket")
    assert not in_connection_layer("/x/site-packages/redis/asyncio/connection.py",
                                   "pack_command")
    assert not in_connection_layer("/x/site-packages/redis/connection.py", "pack")
    assert not in_connection_layer("/x/site-packages/redis/commands/core.py", "xadd")
    assert not in_connection_layer(f"{asyncio.tasks.__file__}", "wait_for")
    assert not in_connection_layer("/work/pipeline/bus/client.py", "retrying")
    assert not in_connection_layer("/work/uvloop/mine.py", "f")
