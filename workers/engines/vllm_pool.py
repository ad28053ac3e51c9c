"""Per-server bookkeeping of the vLLM engine: rotation state, caps, adapters, errors."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from workers.engines.vllm_metrics import ServerMetrics


class VLLMError(RuntimeError):
    """A vLLM server refused a request (HTTP 4xx) or answered nonsense: not transient."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ServerDown(RuntimeError):
    """A server did not answer, timed out, answered 5xx, or restarted: transient; the
    server leaves rotation and the request is retried elsewhere."""


@dataclass
class Server:
    """One server as the engine sees it.

    Invariants: ``inflight`` counts sequences (``n`` per request) sent and not yet
    answered; a server is in rotation only when ``healthy``; ``version`` is the newest
    weights it holds (for LoRA runs, the newest adapter loaded); ``adapters`` lists
    loaded ``(version, name)`` oldest first.
    """

    url: str
    ceiling: int
    version: int = 0
    cap: int = 1
    inflight: int = 0
    healthy: bool = True
    completions_api: bool = False  # no /inference/v1/generate: /v1/completions fallback
    served_name: str = ""  # the base model's name on this server ("" = the engine's model)
    max_model_len: int = 0
    metrics: ServerMetrics | None = None
    swaps: list[float] = field(default_factory=list)  # pause -> resume (or adapter load) s
    adapters: list[tuple[int, str]] = field(default_factory=list)
    adapter_users: dict[str, int] = field(default_factory=dict)
    unloading: set[str] = field(default_factory=set)
    unloaded: list[str] = field(default_factory=list)
    last_error: str = ""
    downs: int = 0
    next_probe: float = 0.0
    probe_backoff_s: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            self.downs += 1
            self.probe_backoff_s = 0.0
            self.next_probe = time.monotonic() + 0.2
        self.healthy = False
        self.last_error = reason

    def back_off(self, reason: str, max_s: float) -> None:
        """A probe failed: probe again after an exponentially longer pause."""
        self.last_error = reason
        self.probe_backoff_s = min(max_s, max(0.25, self.probe_backoff_s * 2))
        self.next_probe = time.monotonic() + self.probe_backoff_s

    def mark_up(self) -> None:
        self.healthy = True
        self.last_error = ""
