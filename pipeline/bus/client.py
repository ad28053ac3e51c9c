"""The one Redis client wrapper (redis-py asyncio + hiredis).

Every stream operation of sluice goes through `Bus`. Delivery rules enforced here:

- A consumer reads its own pending entries first (id ``0``), then new ones (``>``), so
  a restarted consumer with the same name finishes what it had before taking more.
- Acknowledging and retiring are one Lua script: ``XACK`` returns 1 only for the call
  that removed the entry from the pending list, and only that call counts the group as
  retired. So a group retires at most once even if two consumers race on a reclaimed
  entry, and ``cursor == retired + in_flight`` holds.
- The scorer hand-off is atomic and conditional (`Bus.handoff`): ``XACK`` on the input,
  and ``XADD`` to the output only if that ack removed a pending entry. This is the
  ``MULTI {XADD; XACK}`` hand-off written as a script, so that a scorer whose entry
  was reclaimed meanwhile cannot emit the group a second time.
- Admission leases: each admitted cursor is leased to its generator (``leases`` hash,
  ``owner|deadline_ms``); appending or abandoning the group requires the lease and
  releases it in the same script, and expired leases (a dead generator) are taken over.
  So an admitted group is appended at most once and never stranded.
- State-changing scripts are idempotent per op id (`pipeline.bus.scripts.OP_TTL_S`): a call
  retried after a lost reply returns the first call's result instead of acting again.
  The result is stored under the op namespace of the role that owns the call
  (`pipeline.bus.keys.Keys.op`): ``generator`` for emit/abandon, and for retire, hand-off
  and dead-letter the role consuming the group acked (`pipeline.bus.keys.GROUP_ROLE`:
  ``scorers`` -> scorer, ``trainers`` -> trainer). The ACL grants each role only its own.
- Batches: one ADMIT call admits up to N cursors (`admit_many`, with ``state.version``);
  several EMITs or HANDOFFs go in one non-transactional pipeline (`emit_many`,
  `handoff_many`): one round trip, each script still atomic and idempotent on its own.
- Nothing here trims unconsumed entries; streams are bounded by admission, and
  `trim_acked` frees only entries every consumer group has acknowledged, by id.

`Bus` is written in four modules: this one (connection, retries, consumer groups, state,
heartbeats), `pipeline.bus.admission` (the generator's admission and lease writes),
`pipeline.bus.trainer_writes` (the trainer's lock, fences and announcement) and
`pipeline.bus.replies` (the reply types, such as `Entry`, and their parsing).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, MovedError, ResponseError

from pipeline.bus import scripts as lua
from pipeline.bus.admission import AdmissionWrites
from pipeline.bus.codec import FIELD
from pipeline.bus.connection import CLIENT_OPTIONS, ClusterModeError, async_client
from pipeline.bus.dlq import record as dlq_record
from pipeline.bus.fencing import call_fenced
from pipeline.bus.keys import GROUP_ROLE, HEARTBEAT_ROLES, RETIRE_REASONS, Keys
from pipeline.bus.lanes import Lanes, add_states
from pipeline.bus.loop_state import LoopStateIO
from pipeline.bus.replies import (
    Entry,
    GroupView,
    as_str,
    entry_id_order,
    group_view,
    merge_views,
    read_entries,
)
from pipeline.bus.security import TLSFiles, client_options
from pipeline.bus.trainer_writes import TrainerWrites
from pipeline.bus.transient import transient

log = logging.getLogger("sluice.bus")

T = TypeVar("T")


def worker_id(role: str, name: str | None = None) -> str:
    """``role/host-pid`` unless a stable name is given (trainer ranks resume by name)."""
    return f"{role}/{name or f'{socket.gethostname()}-{os.getpid()}'}"


class Bus(AdmissionWrites, TrainerWrites, LoopStateIO):
    """Async access to one run's streams and state. Create with `Bus.connect`.

    The one wrapper every role uses; its generator writes (`AdmissionWrites`), trainer
    writes (`TrainerWrites`) and the rollout loop's shared state (`LoopStateIO`) are
    written in their own modules and mixed in here, sharing this client, its keys, its
    lanes and ``fence``."""

    def __init__(self, client: aioredis.Redis, keys: Keys, *, reconnect_max_s: float = 10.0,
                 partitions: int = 1):
        self.r = client
        self.lanes = Lanes(keys, partitions)
        self._next_read: dict[tuple[str, str], int] = {}  # where each read_lanes starts
        self.cluster = isinstance(client, aioredis.RedisCluster)
        self._node_opts: dict[str, Any] = {}  # login/TLS options for `slot_client`
        self._slot_clients: dict[tuple[str, int], aioredis.Redis] = {}
        self.keys = keys
        self.reconnect_max_s = reconnect_max_s
        self.healthy = True
        self.reconnects = 0
        self._backlog: dict[tuple[str, str, str], str | None] = {}
        self.fence: int | None = None  # the trainer lock's generation (`pipeline.bus.fencing`)
        self._retire = client.register_script(lua.fenced(lua.RETIRE))
        self._handoff = client.register_script(lua.HANDOFF)
        self._dead = client.register_script(lua.fenced(lua.DEAD_LETTER))
        self._ack = client.register_script(lua.fenced(lua.ACK))
        self._trim = client.register_script(lua.TRIM_ACKED)
        self._retire_consumer = client.register_script(lua.RETIRE_CONSUMER)
        self._prune = client.register_script(lua.PRUNE_CONSUMERS)
        self._init_admission(client)
        self._init_trainer_writes(client)

    @classmethod
    def connect(cls, url: str, run: str, *, reconnect_max_s: float = 10.0,
                username: str | None = None, password: str | None = None,
                role: str | None = None, credentials_file: str | None = None,
                tls: TLSFiles | None = None, cluster: bool = False,
                partitions: int = 1) -> Bus:
        """Connect lazily (the first command opens the socket).

        Credentials come from arguments, else those of ``role`` from the environment or
        the credentials file (`pipeline.bus.security.resolve_credentials`), never from argv.
        ``tls`` names the CA / client certificate files of a ``rediss://`` URL.
        ``cluster``: ``url`` is one node of a Redis Cluster (`bus.cluster`);
        ``partitions``: the run's lanes (`bus.partitions`, `pipeline.bus.lanes`).
        """
        opts = client_options(url, role=role, credentials_file=credentials_file, tls=tls,
                              username=username, password=password)
        client = async_client(url, cluster=cluster, **opts)
        bus = cls(client, Keys(run), reconnect_max_s=reconnect_max_s, partitions=partitions)
        bus._node_opts = {**opts, **({"ssl": True} if url.startswith("rediss:") else {})}
        return bus

    async def close(self) -> None:
        for c in self._slot_clients.values():
            await c.aclose()
        await self.r.aclose()

    async def transaction(self, key: str) -> Any:
        """A MULTI/EXEC pipeline for keys that share ``key``'s hash tag: on a plain Redis
        the bus's own client; on a cluster a plain client of the master serving that
        slot (redis-py's cluster transactions run each command on a throwaway event
        loop in a thread, whose connections cannot be closed from ours)."""
        if not self.cluster:
            return self.r.pipeline(transaction=True)
        await self.r.initialize()
        node = self.r.get_node_from_key(key)
        addr = (node.host, int(node.port))
        if addr not in self._slot_clients:
            self._slot_clients[addr] = aioredis.Redis(host=addr[0], port=addr[1],
                                                      **CLIENT_OPTIONS, **self._node_opts)
        return self._slot_clients[addr].pipeline(transaction=True)

    # ------------------------------------------------------------ resilience

    async def retrying(self, op: Callable[[], Awaitable[T]], what: str,
                       stop: asyncio.Event | None = None) -> T:
        """Run ``op`` until it succeeds, backing off exponentially (capped) on transient
        errors (`pipeline.bus.transient`: lost connections, whatever their type, and a
        cluster that is down) and marking the bus unhealthy meanwhile; any other error is
        raised at once. Raises `asyncio.CancelledError`
        if ``stop`` is set while waiting. A refused login (wrong or missing credentials:
        redis-py's AuthenticationError is a ConnectionError) is raised at once: waiting
        cannot fix it, and a role retrying it forever would only look slow."""
        delay = 0.05
        while True:
            try:
                result = await op()
            except AuthenticationError:
                raise
            except Exception as e:
                if isinstance(e, MovedError) or (isinstance(e, ResponseError)
                                                 and str(e).startswith("MOVED")):
                    raise ClusterModeError(
                        f"the Redis at the bus URL is a Redis Cluster node ({e}); set "
                        "bus.cluster = true so the client routes keys to their masters"
                    ) from e
                if not transient(e):
                    raise
                self.unavailable(what, e, "retrying")
                if stop is not None and stop.is_set():
                    raise asyncio.CancelledError from e
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.reconnect_max_s)
                continue
            if not self.healthy:
                log.warning("redis reachable again (%s)", what)
                self.reconnects += 1
            self.healthy = True
            return result

    def unavailable(self, what: str, e: BaseException, then: str) -> None:
        """Mark the bus unhealthy after a failed ``what``; the first failure of an outage
        is logged (whichever call met it: a retried op or a heartbeat), and the next
        success of `retrying` logs the recovery and counts a reconnect."""
        if self.healthy:
            log.warning("redis unavailable during %s: %s: %s; %s", what, type(e).__name__,
                        e, then)
        self.healthy = False

    # ------------------------------------------------------------ consumer groups

    async def ensure_group(self, stream: str, group: str) -> None:
        """Create the consumer group (and stream) if missing, starting at the beginning."""
        try:
            await self.r.xgroup_create(stream, group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def read_group(self, stream: str, group: str, consumer: str, *, count: int,
                         block_ms: int | None) -> list[Entry]:
        """Own pending entries first (once, after a (re)start), then new ones.

        The backlog of a consumer name is what it read before a crash or restart; it is
        replayed from id ``0`` until exhausted, then the consumer only reads ``>`` (new
        entries), blocking up to ``block_ms``. Entries it leaves pending later (e.g. a
        failing reward function) come back through `reclaim` after ``claim_idle_ms``.
        """
        backlog_key = (stream, group, consumer)
        start = self._backlog.get(backlog_key, "0")
        if start is not None:
            resp = await self.r.xreadgroup(group, consumer, {stream: start}, count=count)
            entries = read_entries(resp, stream)
            if entries:
                self._backlog[backlog_key] = entries[-1].id
                counts = await self.delivery_counts(stream, group, [e.id for e in entries])
                for e in entries:
                    e.deliveries = counts.get(e.id, 1)
                return entries
            self._backlog[backlog_key] = None
        resp = await self.r.xreadgroup(group, consumer, {stream: ">"}, count=count,
                                       block=block_ms)
        return read_entries(resp, stream)

    async def read_lanes(self, name: str, group: str, consumer: str, *, count: int,
                         block_ms: int) -> list[Entry]:
        """`read_group` over every lane of stream ``name``: one lane's entries per call,
        the lanes taken in turn so none starves. With one partition this is `read_group`
        itself. With several, a lane with nothing to read is passed without waiting, and
        only when every lane is empty does the call block, on the next lane and for at
        most 50 ms (a blocked read cannot wait on several slots of a cluster at once), so
        an entry in any lane waits at most that long."""
        streams = self.lanes.streams(name)
        if len(streams) == 1:
            return await self.read_group(streams[0], group, consumer, count=count,
                                         block_ms=block_ms)
        start = self._next_read.get((name, group), 0)
        for i in range(len(streams)):
            lane = (start + i) % len(streams)
            got = await self.read_group(streams[lane], group, consumer, count=count,
                                        block_ms=None)  # type: ignore[arg-type]
            if got:
                self._next_read[(name, group)] = lane + 1
                return got
        self._next_read[(name, group)] = start + 1
        return await self.read_group(streams[start % len(streams)], group, consumer,
                                     count=count, block_ms=min(block_ms, 50))

    def replay_pending(self, stream: str, group: str, consumer: str) -> None:
        """Make the next `read_group` of ``consumer`` replay its pending entries from the
        start (as after a restart; their delivery counts rise)."""
        self._backlog[(stream, group, consumer)] = "0"

    async def delivery_counts(self, stream: str, group: str, ids: list[str]) -> dict[str, int]:
        if not ids:
            return {}
        lo, hi = min(ids, key=entry_id_order), max(ids, key=entry_id_order)
        rows = await self.r.xpending_range(stream, group, min=lo, max=hi, count=len(ids) + 1000)
        return {as_str(r["message_id"]): int(r["times_delivered"]) for r in rows}

    async def reclaim(self, stream: str, group: str, consumer: str, *, min_idle_ms: int,
                      count: int) -> list[Entry]:
        """XAUTOCLAIM entries idle longer than ``min_idle_ms`` (their owner is presumed
        dead) into ``consumer``; returns them with their delivery counts."""
        resp = await self.r.xautoclaim(stream, group, consumer, min_idle_time=min_idle_ms,
                                       start_id="0-0", count=count)
        claimed = resp[1] if len(resp) > 1 else []
        entries = [Entry(as_str(i), f, stream=stream) for i, f in claimed if i is not None]
        counts = await self.delivery_counts(stream, group, [e.id for e in entries])
        for e in entries:
            e.deliveries = counts.get(e.id, 1)
        deleted = resp[2] if len(resp) > 2 else []
        entries += [Entry(as_str(i), None, stream=stream) for i in deleted]
        return entries

    def _op(self, group: str, op: str, stream: str) -> str:
        """The op key of a script that acks ``group``'s entries of ``stream``: in the lane
        of that stream and the namespace of the role consuming that group (the only role
        whose ACL user may ack them)."""
        if group not in GROUP_ROLE:
            raise ValueError(f"unknown consumer group {group!r}; expected one of "
                             f"{sorted(GROUP_ROLE)}")
        return self.lanes.of_stream(stream).op(GROUP_ROLE[group], op)

    async def ack(self, stream: str, group: str, *ids: str) -> int:
        """XACK; a trainer's (``fence`` set) is fenced like its retire."""
        if not ids:
            return 0
        if self.fence is None:
            return int(await self.r.xack(stream, group, *ids))
        return int(await call_fenced(self._ack, self.lanes.of_stream(stream).state,
                                     self.fence, [stream], [group, *ids]))

    async def retire(self, stream: str, group: str, ids: list[str], reason: str,
                     op: str) -> list[str]:
        """Ack ``ids`` and count each one whose ack took effect as retired for ``reason``;
        returns those ids. ``op`` names this logical call (`pipeline.bus.scripts.OP_TTL_S`): a
        retry with the same op returns the first call's answer."""
        if reason not in RETIRE_REASONS:
            raise ValueError(f"unknown retire reason {reason!r}")
        if not ids:
            return []
        lane = self.lanes.of_stream(stream)
        done = await call_fenced(self._retire, lane.state, self.fence,
                                 [stream, lane.state, self._op(group, op, stream)],
                                 [group, reason, *ids])
        return [as_str(i) for i in done or []]

    async def handoff(self, src: str, group: str, entry_id: str, dst: str,
                      payload: bytes, op: str) -> str | None:
        """Ack ``entry_id`` on ``src`` and append ``payload`` to ``dst``, atomically; the
        append happens only if this ack removed a pending entry. Returns the new id."""
        return (await self.handoff_many(src, group, dst, [(entry_id, payload, op)]))[0]

    async def handoff_many(self, src: str, group: str, dst: str,
                           items: list[tuple[str, bytes, str]]) -> list[str | None]:
        """`handoff` of several ``(entry_id, payload, op)`` in one round trip
        (`pipeline.bus.scripts.pipelined`); the new ids (None where the entry was no
        longer pending), in order."""
        got = await lua.pipelined(self.r, self._handoff, [
            ([src, dst, self._op(group, op, src)], [group, entry_id, FIELD, payload])
            for entry_id, payload, op in items])
        return [as_str(i) if i else None for i in got]

    async def dead_letter(self, src: str, group: str, entry: Entry, *, reason: str, role: str,
                          retire: bool, op: str) -> bool:
        """Move an entry to the dlq with the reason, ack it, and count it; all in one
        script, at most once. ``retire``: the entry decoded to a group (the caller read
        its id from the decoded message), which retires ``dead``; otherwise it did not
        decode, and whatever group id it claims is not believed (a forged one would make
        ``retired`` drift): it is counted in the lane's ``state.undecodable``, apart
        from the books (``cursor == retired + in_flight``). The dlq record is a bounded
        summary of the entry (`pipeline.bus.dlq.record`: at most ``DLQ_MAX_BYTES`` of its
        fields), whatever its number of fields or size."""
        fields = dlq_record(entry.fields, reason=reason, role=role, src=src,
                            src_id=entry.id)
        lane = self.lanes.of_stream(src)
        done = await call_fenced(self._dead, lane.state, self.fence,
                                 [src, lane.state, lane.dlq, self._op(group, op, src)],
                                 [group, entry.id, "1" if retire else "0", *fields])
        return bool(done)

    async def trim_acked(self, stream: str, *, keep_ms: int) -> int:
        """The janitor: delete the entries of ``stream`` that every consumer group has
        acknowledged and that are older than ``keep_ms`` (the acknowledged tail `sluice tail`
        can still show); returns how many. By id only (`pipeline.bus.scripts.TRIM_ACKED`):
        no payload is read, so a stream of large groups costs Redis no more than a small
        one. Streams are bounded by admission; this only frees what is already done."""
        return int(await self._trim(keys=[stream], args=[max(0, int(keep_ms))]))

    async def retire_consumer(self, stream: str, group: str, consumer: str) -> bool:
        """Leave the group if nothing is pending on ``consumer`` (a clean scale-down)."""
        return bool(await self._retire_consumer(keys=[stream], args=[group, consumer]))

    async def prune_consumers(self, stream: str, group: str, idle_ms: int) -> int:
        """Remove consumers idle longer than ``idle_ms`` with nothing pending."""
        return int(await self._prune(keys=[stream], args=[group, idle_ms]))

    # ------------------------------------------------------------ state, workers

    async def state(self) -> dict[str, int]:
        """The run's ``state``: with lanes, their counters summed (`add_states`)."""
        hashes = []
        for key in self.lanes.state_keys():
            raw = await self.r.hgetall(key)
            hashes.append({as_str(k): int(v) for k, v in raw.items()})
        lane_keys = {k.state for k in self.lanes.keys}
        return add_states(hashes[0], [h for key, h in zip(self.lanes.state_keys(), hashes,
                                                           strict=True) if key in lane_keys])

    async def xadd(self, stream: str, payload: bytes, *, maxlen: int | None = None) -> str:
        return as_str(await self.r.xadd(stream, {FIELD: payload}, maxlen=maxlen, approximate=True))

    async def stream_stats(self, streams: Sequence[str], groups: Sequence[tuple[str, str]]
                           ) -> tuple[dict[str, int | None], dict[tuple[str, str], GroupView]]:
        """XLEN of each stream in ``streams`` and the `GroupView` of each (stream, group)
        in ``groups`` (short stream names: ``rollouts``, ``dlq``), in one round trip, summed
        over the lanes. A length Redis refused (a missing permission) is None; a missing
        stream has 0."""
        pipe = self.r.pipeline(transaction=False)
        for name in streams:
            for key in self.lanes.streams(name):
                pipe.xlen(key)
        for name, _ in groups:
            for key in self.lanes.streams(name):
                pipe.xinfo_groups(key)
        res = iter(await pipe.execute(raise_on_error=False))
        n = self.lanes.partitions
        lengths: dict[str, int | None] = {}
        for name in streams:
            got = [next(res) for _ in range(n)]
            lengths[name] = None if any(isinstance(v, Exception) for v in got) else \
                sum(int(v) for v in got)
        views = {g: merge_views([group_view(next(res), g[1]) for _ in range(n)])
                 for g in groups}
        return lengths, views

    async def heartbeat(self, wid: str, info: dict[str, Any]) -> None:
        """Write worker ``wid``'s (``role/id``) heartbeat into its role's own hash
        (`Keys.heartbeat_key`: each role's ACL user may write only its own)."""
        info = {"pid": os.getpid(), "host": socket.gethostname(), "t": time.time(), **info}
        await self.r.hset(self.keys.heartbeat_key(wid), wid, json.dumps(info))

    async def forget_worker(self, wid: str) -> None:
        await self.r.hdel(self.keys.heartbeat_key(wid), wid)

    async def heartbeats_of(self, role: str) -> dict[str, dict[str, Any]]:
        """The heartbeats of one role's workers (``role/id`` -> beat)."""
        raw = await self.r.hgetall(self.keys.heartbeats(role))
        return {as_str(k): json.loads(v) for k, v in raw.items()}

    async def workers(self) -> dict[str, dict[str, Any]]:
        """Every role's heartbeats, merged (worker ids are unique: ``role/id``)."""
        out: dict[str, dict[str, Any]] = {}
        for role in HEARTBEAT_ROLES:
            out.update(await self.heartbeats_of(role))
        return out


