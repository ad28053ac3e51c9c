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

It runs in the server's environment (``.venv-vllm``), so it imports only the standard
library. `sluice.vllm_launch` adds it to every server started with a key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MIDDLEWARE = "workers.engines.vllm_guard.RequireKey"  # the --middleware import path
OPEN_PATHS = frozenset({"/health"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class RequireKey:
    """Pass a request on only when it carries the key (or is ``/health``)."""

    def __init__(self, app: ASGIApp) -> None:
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:
            raise RuntimeError(f"{MIDDLEWARE}: VLLM_API_KEY is not set; refusing to serve "
                               "dev-mode routes without a key")
        self.app = app
        self.digest = _digest(key)

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
        if path in OPEN_PATHS or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
