"""ASGI middleware loaded INTO a vLLM server (``--middleware``): the key on every path.

vLLM's own ``--api-key`` / ``VLLM_API_KEY`` check (its ``AuthenticationMiddleware``)
guards only paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``; the dev-mode
routes sluice needs (``/pause``, ``/resume``, ``/collective_rpc``,
``/update_weight_version``, ``/init_weight_transfer_engine``, ``/update_weights``…) and
``/tokenize``, ``/metrics`` stay open to anyone who reaches the port. `RequireKey` refuses
(401) every HTTP or websocket request whose ``Authorization: Bearer`` is not the key in
``$VLLM_API_KEY``, except ``GET /health`` (liveness probes: it reveals nothing and
changes nothing). Without a key in the environment the server refuses to start rather
than run open.

It also answers ``POST /sluice/exit`` (keyed, like every path but ``/health``): the
server ends itself (SIGTERM to its own process, as a process manager would send; if
vLLM's shutdown has not ended the process ``EXIT_GRACE_S`` later, it exits at once).
WHY: a weight push that fails mid-collective leaves the server's workers blocked in NCCL
for good (no timeout, no abort from outside); its engine never generates again, while
``/health`` still answers. The trainer asks such servers to exit
(`pipeline.weights.nccl`), and whatever started them starts them again: `sluice up`'s
watch over the servers it launched, a Kubernetes container's restart policy.

It runs in the server's environment (``.venv-vllm``), so it imports only the standard
library. `sluice.vllm_launch` adds it to every server started with a key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MIDDLEWARE = "workers.engines.vllm_guard.RequireKey"  # the --middleware import path
OPEN_PATHS = frozenset({"/health"})
EXIT_PATH = "/sluice/exit"  # POST, keyed: the server ends itself (module doc)
EXIT_GRACE_S = 30.0  # vLLM's own shutdown gets this long before the process exits at once


def exit_server(grace_s: float = EXIT_GRACE_S) -> None:
    """SIGTERM this process (vLLM shuts down its engine and workers), and ``os._exit``
    from a daemon thread if the process still runs ``grace_s`` later (a shutdown that
    waits on a worker stuck in a collective would never end)."""
    def hard_exit() -> None:
        threading.Event().wait(grace_s)
        os._exit(75)  # EX_TEMPFAIL: started again by whoever started it

    threading.Thread(target=hard_exit, name="sluice-exit", daemon=True).start()
    os.kill(os.getpid(), signal.SIGTERM)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class RequireKey:
    """Pass a request on only when it carries the key (or is ``/health``)."""

    def __init__(self, app: ASGIApp, on_exit: Callable[[], None] = exit_server) -> None:
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:
            raise RuntimeError(f"{MIDDLEWARE}: VLLM_API_KEY is not set; refusing to serve "
                               "dev-mode routes without a key")
        self.app = app
        self.digest = _digest(key)
        self.on_exit = on_exit

    def authorized(self, scope: Scope) -> bool:
        """Constant-time comparison of the bearer token with the key."""
        for name, value in scope.get("headers") or []:
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return (scheme.lower() == "bearer"
                        and hmac.compare_digest(_digest(token.strip()), self.digest))
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan: not a request
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if (path == EXIT_PATH and scope["type"] == "http" and scope.get("method") == "POST"
                and self.authorized(scope)):
            await _json(send, 202, {"exiting": True})
            self.on_exit()  # after the answer is sent: the caller knows it was heard
            return
        if path in OPEN_PATHS or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await _json(send, 401, {"error": "Unauthorized"}, [(b"www-authenticate", b"Bearer")])


async def _json(send: Send, status: int, obj: Any,
                headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
