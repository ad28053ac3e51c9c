"""How sluice opens Redis connections: one factory for a plain server and for a Redis
Cluster (`bus.cluster`), and the start check of a cluster. The `Bus` (pipeline.bus.client)
and the operator's tools (the `sluice` package) build their clients here and nowhere else.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError


class ClusterModeError(RuntimeError):
    """The server is a Redis Cluster node but the client was not told (`bus.cluster`)."""


CLIENT_OPTIONS: dict[str, Any] = {
    "decode_responses": False,
    "socket_connect_timeout": 5,
    # no command may hang forever; blocking reads use block_ms (<= 60 s) below this
    "socket_timeout": 90,
}


def async_client(url: str, *, cluster: bool = False, **opts: Any) -> Any:
    """The one way sluice opens an asyncio Redis client: a plain client, or with
    ``cluster`` a RedisCluster that discovers the masters from ``url`` and routes each
    key (every key of a run carries one hash tag, so a script lands on one master)."""
    if cluster:
        return aioredis.RedisCluster.from_url(url, **CLIENT_OPTIONS, **opts)
    return aioredis.from_url(url, **CLIENT_OPTIONS, health_check_interval=15, **opts)


def sync_client(url: str, *, cluster: bool = False, **opts: Any) -> Any:
    """`async_client`'s blocking twin, for the supervisor and the tools."""
    import redis

    if cluster:
        return redis.RedisCluster.from_url(url, **CLIENT_OPTIONS, **opts)
    return redis.Redis.from_url(url, **CLIENT_OPTIONS, **opts)


def check_cluster(url: str, **opts: Any) -> int:
    """Fail fast, naming the key, unless ``url`` is a node of a healthy Redis Cluster
    whose masters cover all 16384 slots; returns the number of masters. A role started
    against a broken cluster would otherwise retry ``CLUSTERDOWN`` forever."""
    import redis

    client = redis.Redis.from_url(url, **CLIENT_OPTIONS, **opts)
    try:
        try:
            info = client.execute_command("CLUSTER", "INFO")
        except ResponseError as e:
            raise ClusterModeError(f"bus.cluster = true but the Redis at bus.redis_url is not "
                                   f"a cluster node ({e}); set bus.cluster = false") from e
        if isinstance(info, bytes):
            info = info.decode()
        fields = dict(line.split(":", 1) for line in str(info).split() if ":" in line)
        assigned = int(fields.get("cluster_slots_assigned", 0))
        if fields.get("cluster_state") != "ok" or assigned != 16384:
            raise ClusterModeError(
                f"bus.redis_url: the Redis Cluster is not usable (cluster_state "
                f"{fields.get('cluster_state')}, {assigned} of 16384 slots assigned); every "
                "slot must have a master (redis-cli --cluster check / fix)")
        return int(fields.get("cluster_size", 0))
    finally:
        client.close()


class PartitionsError(ValueError):
    """`bus.partitions` differs from the value the run was created with."""


def check_partitions(client: Any, state_key: str, partitions: int, *, record: bool) -> None:
    """Refuse a `bus.partitions` other than the run's: the lanes hold the run's groups,
    counters and leases, so reading another number of them would strand work and break
    conservation. ``state_key`` is the run's global state hash (a sync client's key);
    the roles that write (``record``: the trainer, generators) set the value on a new run
    before their first write, first writer wins, so no group is admitted before it is
    set. A run from before partitions existed (a ``cursor`` and no ``partitions``) has
    one."""
    raw = client.hget(state_key, "partitions")
    if raw is None:
        if client.hexists(state_key, "cursor"):
            raw = b"1"
        elif record:
            client.hsetnx(state_key, "partitions", partitions)
            raw = client.hget(state_key, "partitions")
    if raw is not None and int(raw) != partitions:
        raise PartitionsError(
            f"bus.partitions = {partitions}, but this run was created with {int(raw)}: its "
            "groups, counters and leases live in that many lanes. Resume with "
            f"bus.partitions = {int(raw)}, or start a new run (another run.name).")
