"""The scorer's reward process: runs the user's reward functions where a hang can be
killed (`workers.reward_runner` is the scorer's side and says why).

Started as ``python -m workers.reward_child FD PARENT_PID`` with one end of a socket pair
on ``FD``. It loads the functions by import path (nothing is pickled), says it is ready,
then serves requests until the socket closes. Every frame is a 4-byte big-endian length
and a msgpack body (`frame`; `read_frame` on the scorer's loop, `recv_frame` here):
plain data only, both ways.

- scorer -> here, first: ``{"paths": ["pkg.mod:fn", ...]}``; here -> scorer:
  ``{"ready": pid}`` or ``{"fatal": "why"}`` (a function failed to import).
- scorer -> here: ``{"req": r, "batches": [{"kw": kwargs, "n": n, "fns": [f, ...]}]}``:
  the listed functions over each batch, all at once (sync functions each in a daemon
  thread, async ones on this process's loop); here -> scorer, per (batch ``b``,
  function ``f``): ``{"req", "b", "f", "started": true}`` just before the call runs,
  then ``{"req", "b", "f", "ok": [float | None] * n}`` or ``{"req", "b", "f", "problem",
  "detail"}`` (`workers.tasks.rewards.RewardError`). A call that never said it started
  was starved by one that blocked this process's loop: the scorer retries it.

This process never enforces a timeout: the scorer does, by killing it (a stuck thread or
a blocked loop can only be ended that way). It dies with the scorer (``PR_SET_PDEATHSIG``
on Linux) and leaves on its own when the socket closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import struct
import sys
import threading
from typing import Any

import msgpack

from workers.tasks.rewards import (
    RewardError,
    RewardFn,
    invoke_reward,
    load_reward,
    validate,
)

HEADER = struct.Struct(">I")
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _default(obj: Any) -> Any:
    """msgpack's fallback: numpy arrays and scalars as lists and numbers."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"cannot send {type(obj).__name__} to the reward process")


def frame(obj: Any) -> bytes:
    """One frame: length + msgpack body (``TypeError`` for what msgpack cannot carry)."""
    body = msgpack.packb(obj, use_bin_type=True, default=_default)
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's body; ``asyncio.IncompleteReadError`` when the peer is gone."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return msgpack.unpackb(await reader.readexactly(size), raw=False, strict_map_key=False)


def _drop(*args: Any, **kwargs: Any) -> None:
    """``log_extra`` / ``log_metric`` of TRL: accepted and dropped (as in-process)."""


class Child:
    """This process's side: loaded functions, and one blocking socket written under a
    lock (from the loop and from reward threads alike: a frame is on the wire before the
    call it announces runs, so a call that then blocks the loop has said it started) and
    read by a thread of its own (requests still arrive while the loop is blocked)."""

    def __init__(self, sock: socket.socket, rewards: list[RewardFn]) -> None:
        self.sock, self.rewards = sock, rewards
        self.lock = threading.Lock()
        self.running: set[asyncio.Task[None]] = set()  # the loop keeps weak references

    def send(self, obj: Any) -> None:
        data = frame(obj)
        with self.lock:
            self.sock.sendall(data)

    async def call(self, req: int, b: int, f: int, kwargs: dict[str, Any], n: int) -> None:
        rf, head = self.rewards[f], {"req": req, "b": b, "f": f}
        self.send({**head, "started": True})
        try:
            msg = {**head, "ok": validate(rf.name, await invoke_reward(rf, kwargs), n)}
        except RewardError as e:
            msg = {**head, "problem": e.problem[:1000],
                   "detail": (e.detail or "")[:1000] or None}
        self.send(msg)

    def dispatch(self, req: dict[str, Any]) -> None:
        """Start every call of a request at once (on the loop)."""
        for b, batch in enumerate(req["batches"]):
            kwargs = {**batch["kw"], "trainer_state": None, "log_extra": _drop,
                      "log_metric": _drop}
            for f in batch["fns"]:
                t = asyncio.create_task(self.call(req["req"], b, f, kwargs, batch["n"]))
                self.running.add(t)
                t.add_done_callback(self.running.discard)

    def read_requests(self, loop: asyncio.AbstractEventLoop, closed: asyncio.Event) -> None:
        """The reader thread: each request to the loop, then ``closed`` at EOF."""
        stream = self.sock.makefile("rb")
        with contextlib.suppress(OSError, ValueError, EOFError):
            while (req := recv_frame(stream)) is not None:
                loop.call_soon_threadsafe(self.dispatch, req)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(closed.set)

    async def serve(self) -> None:
        """Answer requests until the scorer closes the socket."""
        closed = asyncio.Event()
        threading.Thread(target=self.read_requests, args=(asyncio.get_running_loop(), closed),
                         name="sluice-reward-reader", daemon=True).start()
        await closed.wait()


def recv_frame(stream: Any) -> Any:
    """The next frame from a blocking binary stream; None at EOF."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    body = stream.read(size)
    if len(body) < size:
        return None
    return msgpack.unpackb(body, raw=False, strict_map_key=False)


def _die_with(parent_pid: int) -> None:
    """Be SIGKILLed when the scorer dies, however it dies (Linux), and exit now if it
    already has: a reward process must never outlive its scorer."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent_pid:
        os._exit(1)


def main(argv: list[str]) -> None:
    fd, parent_pid = int(argv[0]), int(argv[1])
    _die_with(parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reward-process %(message)s")
    sock = socket.socket(fileno=fd)
    try:
        hello = recv_frame(sock.makefile("rb"))
        if hello is None:
            return
        try:
            rewards = [load_reward(p) for p in hello["paths"]]
        except BaseException as e:  # an import that raises anything at all
            Child(sock, []).send({"fatal": f"{type(e).__name__}: {e}"[:2000]})
            return
        child = Child(sock, rewards)
        child.send({"ready": os.getpid()})
        asyncio.run(child.serve())
    finally:  # neither a reward's stuck thread nor its atexit hook may keep us alive
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
