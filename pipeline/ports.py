"""Free loopback ports for the servers sluice starts (embedded Redis, vLLM, metrics
endpoints, torchrun's rendezvous). A port is free when asked; the caller binds it soon
after, so another process can take it in between: every caller handles a bind failure."""

from __future__ import annotations

import socket


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now: all bound at once, so no two are equal
    (separate `free_port` calls may hand out the same port twice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
