"""Which errors `Bus.retrying` waits out: lost connections and a cluster that is down, and
redis-py's own broken-socket error; never an error of sluice's own code."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import (
    ClusterDownError,
    ConnectionError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)

from pipeline.bus.client import transient


def test_lost_connections_and_a_down_cluster_are_waited_out() -> None:
    assert transient(ConnectionError("reset"))
    assert transient(ClusterDownError("CLUSTERDOWN The cluster is down"))
    assert transient(TryAgainError("TRYAGAIN"))
    assert transient(RedisClusterException("Redis Cluster cannot be connected. Please ..."))
    assert not transient(RedisClusterException("Calling pipelined function evalsha is "
                                                "blocked when running redis in cluster mode"))
    assert not transient(ResponseError("WRONGTYPE"))


def test_redis_pys_socketless_connection_is_a_lost_connection_but_our_bugs_are_not() -> None:
    conn = Connection()
    conn._writer = None  # what a failed reconnect leaves behind
    with pytest.raises(AttributeError) as got:
        asyncio.run(conn._send_packed_command([b"PING"]))
    assert transient(got.value)
    try:
        getattr(None, "writelines")()  # noqa: B009  # the same error, from our code
    except AttributeError as ours:
        assert not transient(ours)
