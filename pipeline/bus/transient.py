"""Which errors a role waits out: the one rule behind every Redis retry in sluice.

An error is *transient* when waiting can fix it. There are two kinds:

1. **Errors redis-py has classified**: its ``ConnectionError`` and ``TimeoutError``
   (``AuthenticationError`` is one too, but `pipeline.bus.client.Bus.retrying` raises it
   before asking: no wait fixes a wrong password), ``OSError``, a server still loading its
   data, and a Redis Cluster that is down, failing over or resharding (``CLUSTERDOWN``,
   ``TRYAGAIN``, ``MASTERDOWN``, an uncovered slot, "cannot be connected"), and
   ``NOSCRIPT`` (`NoScriptError`): a server restarted without its script cache. The
   script did not run, so calling again is safe, and the call loads it again (redis-py's
   `Script` does on NOSCRIPT; on a cluster SCRIPT LOAD goes to every primary, and a
   primary restarted between that load and the call answers NOSCRIPT once more).

2. **A lost connection redis-py did not classify** (`lost_connection`): an exception of
   *any* type that is not a `redis.exceptions.RedisError` and was *raised inside the
   connection layer* — redis-py's connection and parser modules, asyncio's streams and
   transports, or uvloop's transport handles — while a command was in flight. Members of
   this family seen so far, all from one cause (redis-py's cluster client closes every
   node connection on ``CLUSTERDOWN`` while other coroutines are using them):

   - ``AttributeError: 'NoneType' object has no attribute 'writelines'`` — the
     connection's writer already set to None by the concurrent ``disconnect()``;
   - ``RuntimeError: unable to perform operation on <TCPTransport closed=True ...>`` —
     uvloop's transport closed by it a moment earlier (the default asyncio loop drops the
     write and reports ``ConnectionResetError`` instead, which redis-py classifies).

   The type is deliberately not consulted: each event loop and redis-py version words
   the same broken socket differently, and matching types one at a time kept missing
   members. Where the exception was raised is what identifies it.

What stays a bug, raised at once: anything raised in sluice's own code (whatever its
type, even the same ``AttributeError``), every ``RedisError`` that redis-py classified as
something other than a lost connection (a ``ResponseError`` such as ``WRONGTYPE``, a
script error, a ``DataError`` for an argument it cannot encode), and errors raised while
redis-py *packs* a command (a caller's bad argument surfaces there, not on the socket).
"""

from __future__ import annotations

import asyncio
import os
from types import TracebackType

from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Errors that redis-py (or the OS) classified as a lost or unusable connection.
TRANSIENT: tuple[type[BaseException], ...] = (
    RedisConnectionError, RedisTimeoutError, BusyLoadingError, ConnectionError, OSError)
# ... and on a Redis Cluster, the replies of a cluster that is failing over or restarting
CLUSTER_TRANSIENT: tuple[type[BaseException], ...] = (
    ClusterDownError, TryAgainError, MasterDownError, SlotNotCoveredError, NoScriptError)

_ASYNCIO_DIR = os.path.dirname(asyncio.__file__).replace("\\", "/")
# asyncio's modules that own sockets and transports (not its tasks, futures or locks:
# misusing those is a bug of the caller)
_ASYNCIO_IO = tuple(f"{_ASYNCIO_DIR}/{m}.py" for m in (
    "streams", "transports", "selector_events", "proactor_events", "sslproto"))
# redis-py's modules that talk to the socket
_REDIS_IO = ("/redis/asyncio/connection.py", "/redis/connection.py")
_REDIS_PARSERS = "/redis/_parsers/"
# redis-py functions in those modules that only pack a command: a bad argument of the
# caller is raised there and must surface (redis-py 8 packs in its serializers' `pack`)
_PACKING = frozenset({"pack_command", "pack_commands", "_pack_command", "pack"})


def transient(e: BaseException) -> bool:
    """Whether waiting can fix ``e``: a lost connection (classified by redis-py or not:
    `lost_connection`), a loading server, a cluster that is down or resharding, or (in
    redis-py's words) a cluster that "cannot be connected" because every node is
    unreachable."""
    return isinstance(e, TRANSIENT + CLUSTER_TRANSIENT) or (
        isinstance(e, RedisClusterException) and "cannot be connected" in str(e)) or (
        lost_connection(e))


def lost_connection(e: BaseException) -> bool:
    """An exception redis-py did not classify that a broken connection raised: not a
    `RedisError` (redis-py's own classification is trusted) and raised — its innermost
    traceback frame — in the connection layer (`in_connection_layer`)."""
    if isinstance(e, RedisError) or not isinstance(e, Exception):
        return False
    frame = _innermost(e.__traceback__)
    return frame is not None and in_connection_layer(frame.tb_frame.f_code.co_filename,
                                                     frame.tb_frame.f_code.co_name)


def in_connection_layer(filename: str, function: str) -> bool:
    """Whether code at ``filename`` (a frame's ``co_filename``) in ``function`` is socket
    I/O on a Redis connection: redis-py's connection module (except its command
    packing) or parsers, asyncio's stream/transport modules, or uvloop's compiled
    handles (their frames are named ``uvloop/....pyx``)."""
    path = filename.replace("\\", "/")
    if path.endswith(_REDIS_IO):
        return function not in _PACKING
    if _REDIS_PARSERS in path or path.endswith(_ASYNCIO_IO):
        return True
    return path.endswith((".pyx", ".pxd", ".pxi")) and (
        path.startswith("uvloop/") or "/uvloop/" in path)


def _innermost(tb: TracebackType | None) -> TracebackType | None:
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last
