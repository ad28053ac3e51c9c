"""Engine over one or more vLLM servers: token-in/token-out over HTTP (issue 4, core).

Requests go to ``POST /inference/v1/generate`` (server started with
``--enable-scale-out``), which returns per-token weight versions; logprobs must be of
the processed distribution (``--logprobs-mode processed_logprobs``), which ``start()``
checks by behaviour: with top-k = 2 the two reported top logprobs of a processed
distribution sum to probability 1, raw ones do not.

Weight swaps (``load_weights``): on every server concurrently, pause with ``mode=keep``
(in-flight requests freeze, keeping their KV cache) → ``collective_rpc reload_weights``
from the announced directory → ``update_weight_version`` → ``reset_prefix_cache`` (a
reload does not invalidate cached prefixes) → resume, the resume in a ``finally`` so a
failed reload never leaves a server paused. Tokens sampled after the resume carry the
new version label; the label of a server's initial weights ("default") maps to the
engine's initial version.

Not yet here (issue 4 continues): LoRA adapters, concurrency caps from ``/metrics``,
taking failed servers out of rotation with retries, NCCL, launching servers from
``sluice up``. Routing is least-in-flight over the configured servers.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from workers.engines.base import Completion, SamplingParams

INITIAL_LABEL = "default"


class VLLMError(RuntimeError):
    """A vLLM server refused a request, answered nonsense, or is set up wrongly."""


@dataclass
class Server:
    url: str
    inflight: int = 0
    swaps: list[float] = field(default_factory=list)  # pause -> resume seconds


class VLLMEngine:
    """`Engine` over vLLM servers. One event loop; call ``start()`` first."""

    def __init__(self, urls: list[str], model: str, *, version: int = 0,
                 timeout_s: float = 600.0, seed: int | None = None) -> None:
        if not urls:
            raise ValueError("VLLMEngine needs at least one server URL")
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.model = model
        self.version = version
        self.initial_version = version
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.rng = random.Random(seed)
        self.session: aiohttp.ClientSession | None = None

    # ----------------------------------------------------------------- plumbing
    async def _post(self, server: Server, path: str, body: dict[str, Any] | None = None) -> Any:
        assert self.session is not None, "call start() first"
        async with self.session.post(server.url + path, json=body or {}) as r:
            text = await r.text()
            if r.status != 200:
                raise VLLMError(f"{server.url}{path}: HTTP {r.status}: {text[:300]}")
            return await r.json(content_type=None) if text.strip() else None

    async def start(self) -> None:
        """Open the HTTP session and check every server serves ``model`` with processed
        logprobs; raise `VLLMError` naming the server and the fix otherwise."""
        self.session = aiohttp.ClientSession(timeout=self.timeout)
        for s in self.servers:
            assert self.session is not None
            async with self.session.get(s.url + "/v1/models") as r:
                ids = [m["id"] for m in (await r.json()).get("data", [])]
            if self.model not in ids:
                raise VLLMError(f"{s.url} serves {ids}, not {self.model!r}")
            probe = await self._request(s, [1], 1, {"max_tokens": 1, "temperature": 1.0,
                                                    "top_k": 2, "logprobs": 2})
            top = probe["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
            mass = sum(math.exp(t["logprob"]) for t in top[:2])
            if abs(mass - 1.0) > 1e-3:
                raise VLLMError(f"{s.url} reports raw logprobs (top-2 mass {mass:.4f} under "
                                "top_k=2): start it with --logprobs-mode processed_logprobs")

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    # ----------------------------------------------------------------- generation
    def _pick(self) -> Server:
        return min(self.servers, key=lambda s: s.inflight)

    async def _request(self, s: Server, prompt: list[int], n: int,
                       sampling: dict[str, Any]) -> Any:
        body = {"request_id": uuid.uuid4().hex, "token_ids": prompt, "model": self.model,
                "output_mode": "tokens",
                "sampling_params": {"n": n, "seed": self.rng.randrange(2**31), **sampling}}
        s.inflight += 1
        try:
            return await self._post(s, "/inference/v1/generate", body)
        finally:
            s.inflight -= 1

    @staticmethod
    def sampling(params: SamplingParams) -> dict[str, Any]:
        out: dict[str, Any] = {"max_tokens": params.max_new_tokens, "logprobs": 1}
        if params.greedy:
            out["temperature"] = 0.0
            return out
        out["temperature"] = params.temperature
        if params.top_k:
            out["top_k"] = params.top_k
        if params.top_p < 1.0:
            out["top_p"] = params.top_p
        return out

    def _versions(self, spans: list[dict[str, Any]], length: int) -> np.ndarray:
        v = np.full(length, self.initial_version, dtype=np.int32)
        for span in spans or []:
            label = str(span["version"])
            ver = self.initial_version if label == INITIAL_LABEL else int(label)
            v[int(span["start"]):int(span["end"])] = ver
        return v

    def _completion(self, choice: dict[str, Any]) -> Completion:
        ids = np.asarray(choice["token_ids"], dtype=np.int32)
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(ids):
            raise VLLMError(f"{len(content)} logprobs for {len(ids)} tokens")
        lps = np.asarray([c["logprob"] for c in content], dtype=np.float32)
        reason = "stop" if choice.get("finish_reason") == "stop" else "length"
        return Completion(token_ids=ids, logprobs=lps,
                          versions=self._versions(choice.get("weight_versions"), len(ids)),
                          finish_reason=reason)

    async def generate(self, prompts: list[list[int]], n: int,
                       params: SamplingParams) -> list[list[Completion]]:
        """``n`` completions per prompt, one request per prompt, spread over servers.

        The engine cannot see top-k/top-p candidate sets, so its completions carry none
        (the trainer then warns and reports ``candidates/missing_frac``).
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        sampling = self.sampling(params)

        async def one(p: list[int]) -> list[Completion]:
            res = await self._request(self._pick(), list(p), n, sampling)
            choices = sorted(res["choices"], key=lambda c: c["index"])
            return [self._completion(c) for c in choices]

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    async def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[Completion]:
        res = await self.generate(prompts, 1, SamplingParams(max_new_tokens, greedy=True))
        return [g[0] for g in res]

    # ----------------------------------------------------------------- weights
    async def _swap(self, s: Server, path: str, version: int) -> None:
        t = time.perf_counter()
        await self._post(s, "/pause?mode=keep")
        try:
            await self._post(s, "/collective_rpc", {"method": "reload_weights",
                                                     "kwargs": {"weights_path": path}})
            await self._post(s, "/update_weight_version", {"new_version": str(version)})
            await self._post(s, "/reset_prefix_cache")
        finally:
            await self._post(s, "/resume")
            s.swaps.append(time.perf_counter() - t)

    async def load_weights(self, path: str, version: int) -> bool:
        """Reload every server from a safetensors directory; False if not newer."""
        if version <= self.version:
            return False
        await asyncio.gather(*(self._swap(s, path, version) for s in self.servers))
        self.version = version
        return True
