"""The teacher of on-policy distillation: its logprob of every token the policy sampled.

One job: given rows of (prompt ids, completion ids, mask), return for each row the
teacher's logprob of each completion token given everything before it (prompt and
earlier completion tokens, environment-inserted ones included). Tokens at mask 0 (not
sampled by the policy) get 0: no one reads them. Two backends behind one contract
(`Teacher`):

- `LocalTeacher` (``scoring.teacher_urls`` empty): the model in the scorer's process,
  on ``scoring.teacher_device`` in ``model.dtype``. A scorer read is one batch: rows
  sorted by length and cut into forwards of at most ``batch_tokens`` (padded) tokens;
  the LM head runs only on the positions that predict a mask-1 token, ``head_chunk``
  at a time (at a 152k vocabulary the full ``[B, L, V]`` logits would dominate memory).
  Runs in a worker thread (`asyncio.to_thread`) under `torch.inference_mode`, so the
  scorer's heartbeat goes on. The maths is the trainer's (`pipeline.rl.logprobs`:
  `split_lm`, then `chunked_head_logprobs` on the gathered hidden states), with the LM
  head applied in the model's dtype (logits cast to float32 after it).
- `VLLMTeacher` (``scoring.teacher_urls``): vLLM servers serving the teacher. One
  ``/v1/completions`` request per server per read, the prompts being the rows' token
  ids (prompt + completion), ``max_tokens`` 1 and ``prompt_logprobs`` 0: vLLM then
  returns, at every prompt position after the first, the logprob of the token there
  (computed from the raw logits: vLLM 0.32 applies no sampling parameter, temperature
  included, to prompt logprobs, whatever ``--logprobs-mode`` says). A connection error,
  timeout or HTTP 5xx moves the request to the next server (``attempts`` in all); any
  other refusal (such as a row longer than the server's ``--max-model-len``) fails at
  once. Failures raise `TeacherError`, which the scorer treats like a reward error.

Why temperature 1 and no top-k / top-p for the teacher: distillation pulls the policy
towards the teacher's own distribution, not towards a tempered or truncated version of
it, and the per-token term ``log p_behaviour - log p_teacher`` then estimates the reverse
KL from the distribution the tokens were drawn from to that distribution. Both backends
compute the same thing (vLLM's prompt logprobs are untempered anyway). Sample the policy
at temperature 1 without truncation for distillation: the trainer trains the tempered
(and truncated) distribution the tokens were drawn from, so at temperature T the
policy's tempered distribution is what comes to match the teacher (the scorer warns).

Start check (`check_vocab`, run by the scorer and by `sluice up` / `sluice score`
before any role starts): the teacher's tokenizer vocabulary must equal the policy's
(token -> id, added tokens included); otherwise the same id means different tokens and
the logprobs compare nothing. The model's embedding size may differ (padded vocabularies,
as between Qwen2.5 sizes); the tokenizers may not.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from pipeline.config import ConfigError
from pipeline.vllm_auth import auth_headers, vllm_api_key

if TYPE_CHECKING:
    import aiohttp
    import torch
    from transformers import PreTrainedTokenizerBase

    from pipeline.config import Config

log = logging.getLogger("sluice.teacher")

Row = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(prompt ids int32 [P], completion ids int32 [T], mask uint8 [T]) of one rollout."""


class TeacherError(RuntimeError):
    """The teacher could not score a batch (server down after every attempt, request
    refused, wrong answer): the scorer leaves the groups pending, as for a reward error."""


class Teacher(Protocol):
    async def start(self) -> None: ...

    async def logprobs(self, rows: Sequence[Row]) -> list[np.ndarray]:
        """Per row, float32 ``[T]``: the teacher's logprob of each completion token (0 at
        mask-0 tokens). Raises `TeacherError`."""
        ...

    async def close(self) -> None: ...


# ------------------------------------------------------------------ in-process


class LocalTeacher:
    """`Teacher` over a transformers causal LM in this process (module docstring)."""

    def __init__(self, model: torch.nn.Module, *, batch_tokens: int = 16384,
                 head_chunk: int = 1024) -> None:
        if batch_tokens < 1 or head_chunk < 1:
            raise ValueError("batch_tokens and head_chunk must be >= 1")
        self.model = model
        self.batch_tokens = batch_tokens
        self.head_chunk = head_chunk

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def logprobs(self, rows: Sequence[Row]) -> list[np.ndarray]:
        try:
            return await asyncio.to_thread(self.forward, rows)
        except (RuntimeError, ValueError, IndexError) as e:  # e.g. a row over the
            raise TeacherError(f"teacher forward failed: {type(e).__name__}: {e}") from e

    def forward(self, rows: Sequence[Row]) -> list[np.ndarray]:
        """`logprobs`, blocking (runs in a worker thread)."""
        import torch

        with torch.inference_mode():
            out = [np.zeros(len(c), dtype=np.float32) for _, c, _ in rows]
            for chunk in self._batches(rows):
                for i, lp in zip(chunk, self._forward([rows[i] for i in chunk]), strict=True):
                    out[i] = lp
            return out

    def _batches(self, rows: Sequence[Row]) -> list[list[int]]:
        """Row indices in batches of at most ``batch_tokens`` padded tokens (one row
        alone when it is longer), rows sorted by length so padding is small."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
        batches: list[list[int]] = []
        for i in order:
            n = len(rows[i][0]) + len(rows[i][1])  # the longest of its batch so far
            if batches and n * (len(batches[-1]) + 1) <= self.batch_tokens:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches

    def _forward(self, rows: list[Row]) -> list[np.ndarray]:
        import torch

        from pipeline.rl.logprobs import chunked_head_logprobs, split_lm

        body, head = split_lm(self.model)
        device = head.weight.device
        seqs = [np.concatenate([p, c]).astype(np.int64) for p, c, _ in rows]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        att = torch.zeros((len(rows), width), dtype=torch.long)
        for r, s in enumerate(seqs):  # right padding: a causal LM's real tokens never
            ids[r, :len(s)] = torch.from_numpy(s)  # attend to it
            att[r, :len(s)] = 1
        hidden = body(input_ids=ids.to(device), attention_mask=att.to(device),
                      use_cache=False).last_hidden_state
        # position P - 1 + j predicts completion token j; only mask-1 ones are computed
        where = [(r, len(p) - 1 + j, int(c[j]))
                 for r, (p, c, m) in enumerate(rows) for j in np.flatnonzero(m)]
        out = [np.zeros(len(c), dtype=np.float32) for _, c, _ in rows]
        if not where:
            return out
        idx = torch.tensor(where, dtype=torch.long, device=device)
        h = hidden[idx[:, 0], idx[:, 1]]
        lps, _ = chunked_head_logprobs(head, h, idx[:, 2], chunk_tokens=self.head_chunk,
                                       fp32_head=False)
        flat = lps.cpu().numpy()
        k = 0
        for r, (_, _, m) in enumerate(rows):
            on = np.flatnonzero(m)
            out[r][on] = flat[k:k + len(on)]
            k += len(on)
        return out


# ------------------------------------------------------------------ vLLM


class VLLMTeacher:
    """`Teacher` over vLLM servers serving the teacher (module docstring). One event
    loop; ``await start()`` first."""

    def __init__(self, urls: list[str], names: Sequence[str], *, timeout_s: float = 300.0,
                 attempts: int = 3, api_key: str | None = None) -> None:
        if not urls:
            raise ValueError("VLLMTeacher needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.names = tuple(n for n in names if n)  # what the teacher may be served as
        self.served: dict[str, str] = {}  # url -> the name it serves the teacher under
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.next = 0
        self.session: aiohttp.ClientSession | None = None
        # the servers' key on every request (vllm_auth); None: $VLLM_API_KEY
        self.headers = auth_headers(vllm_api_key() if api_key is None else api_key)

    async def start(self) -> None:
        """Open the session and find each server's name for the teacher. A server that
        answers but serves something else is a `ConfigError` naming
        ``scoring.teacher_urls``; one that does not answer yet is asked again later."""
        import aiohttp

        self.session = aiohttp.ClientSession()
        for url in self.urls:
            try:
                await self._name(url)
            except TeacherError as e:
                log.warning("teacher server %s not usable yet: %s", url, e)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def _request(self, method: str, url: str, body: Any = None,
                       timeout_s: float | None = None) -> Any:
        import aiohttp

        assert self.session is not None, "call start() first"
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self.session.request(method, url, json=body, headers=self.headers,
                                            timeout=timeout) as r:
                text = await r.text()
                status = r.status
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise _Down(f"{url}: {type(e).__name__}: {e}") from e
        if status >= 500:
            raise _Down(f"{url}: HTTP {status}: {text[:300]}")
        if status != 200:
            raise TeacherError(f"{url}: HTTP {status}: {text[:300]}")
        return _json(text, url)

    async def _name(self, url: str) -> str:
        if url not in self.served:
            models = await self._request("GET", url + "/v1/models", timeout_s=10.0)
            served = [m.get("id") for m in (models or {}).get("data", [])]
            name = next((n for n in self.names if n in served), None)
            if name is None:
                raise ConfigError(f"scoring.teacher_urls: {url} serves {served}, not the "
                                  f"teacher {self.names[0]!r} (scoring.teacher)")
            self.served[url] = name
        return self.served[url]

    async def logprobs(self, rows: Sequence[Row]) -> list[np.ndarray]:
        if not rows:
            return []
        n = min(len(self.urls), len(rows))
        bounds = [round(k * len(rows) / n) for k in range(n + 1)]
        parts = await asyncio.gather(*(self._part(list(rows[a:b]))
                                       for a, b in itertools.pairwise(bounds)))
        return [lp for part in parts for lp in part]

    async def _part(self, rows: list[Row]) -> list[np.ndarray]:
        """One request for ``rows``, moved to the next server on a transient failure."""
        last = ""
        for _ in range(self.attempts):
            url = self.urls[self.next % len(self.urls)]
            self.next += 1
            try:
                return await self._score(url, rows)
            except _Down as e:
                last = str(e)
                log.warning("teacher request failed, trying the next server: %s", e)
        raise TeacherError(f"teacher unreachable after {self.attempts} attempts; last: {last}")

    async def _score(self, url: str, rows: list[Row]) -> list[np.ndarray]:
        seqs = [np.concatenate([p, c]).astype(int).tolist() for p, c, _ in rows]
        body = {"model": await self._name(url), "prompt": seqs, "max_tokens": 1,
                "temperature": 0.0, "prompt_logprobs": 0}
        res = await self._request("POST", url + "/v1/completions", body)
        try:
            choices = sorted(res["choices"], key=lambda ch: ch["index"])
            if len(choices) != len(rows):
                raise ValueError(f"{len(choices)} choices for {len(rows)} prompts")
            return [_completion_logprobs(ch["prompt_logprobs"], seq, p, m)
                    for ch, seq, (p, _, m) in zip(choices, seqs, rows, strict=True)]
        except (KeyError, TypeError, ValueError) as e:
            raise TeacherError(f"{url}: malformed prompt_logprobs answer: {e}") from e


class _Down(TeacherError):
    """Transient: connection refused or lost, timeout, HTTP 5xx."""


def _json(text: str, url: str) -> Any:
    import json

    try:
        return json.loads(text) if text.strip() else None
    except ValueError as e:
        raise TeacherError(f"{url}: not JSON: {text[:200]}") from e


def _completion_logprobs(prompt_logprobs: list[dict[str, Any] | None], seq: list[int],
                         prompt: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The completion part of one vLLM ``prompt_logprobs`` list (one entry per prompt
    token, None for the first; each maps token id (a string) to ``{"logprob", ...}``)."""
    if len(prompt_logprobs) != len(seq):
        raise ValueError(f"{len(prompt_logprobs)} prompt logprobs for {len(seq)} tokens")
    out = np.zeros(len(seq) - len(prompt), dtype=np.float32)
    for j in np.flatnonzero(mask):
        pos = len(prompt) + int(j)
        entry = prompt_logprobs[pos]
        if entry is None or str(seq[pos]) not in entry:
            raise ValueError(f"no logprob for token {seq[pos]} at position {pos}")
        out[j] = float(entry[str(seq[pos])]["logprob"])
    return out


# ------------------------------------------------------------------ construction, checks


def teacher_names(cfg: Config) -> tuple[str, ...]:
    """What a vLLM server may serve the teacher as: ``scoring.teacher`` as written, and as
    an absolute folder (how `sluice up` and the vLLM engine name a local model)."""
    t = cfg.scoring.teacher
    return (t, str(Path(t).resolve())) if Path(t).exists() else (t,)


def load_teacher(cfg: Config) -> Teacher:
    """The run's teacher (``scoring.teacher`` must be set): on its vLLM servers when
    ``scoring.teacher_urls`` is set, else in this process."""
    s = cfg.scoring
    if s.teacher_urls:
        return VLLMTeacher(list(s.teacher_urls), teacher_names(cfg),
                           timeout_s=cfg.generation.vllm.request_timeout_s,
                           api_key=vllm_api_key(cfg.generation.vllm.api_key_file))
    from pipeline.attention import attention_for
    from pipeline.devices import resolve_device
    from pipeline.model import load_model

    device = resolve_device(s.teacher_device, "scoring.teacher_device")
    folder = _teacher_folder(s.teacher)
    model, _ = load_model(folder, dtype=cfg.model.dtype, device=device,
                          attn_implementation=attention_for(cfg, device, model_path=folder))
    return LocalTeacher(model)


def _teacher_folder(path: str) -> str:
    from pipeline.hub import resolve_model

    try:
        return resolve_model(path).local_dir
    except ConfigError as e:
        raise ConfigError(str(e).replace("model.path", "scoring.teacher", 1)) from None


def check_vocab(cfg: Config, policy_tokenizer: PreTrainedTokenizerBase | None = None) -> None:
    """``ConfigError`` naming ``scoring.teacher`` when the teacher's tokenizer vocabulary
    differs from the policy's (or the teacher cannot be found); nothing without a
    teacher. ``policy_tokenizer``: the policy's, when the caller has it; else loaded from
    ``model.path``, or the tiny model's when `sluice up` is about to build it."""
    if not cfg.scoring.teacher:
        return
    from pipeline.model import load_tokenizer

    policy = policy_tokenizer or _policy_tokenizer(cfg)
    teacher = load_tokenizer(_teacher_folder(cfg.scoring.teacher))
    mine, theirs = policy.get_vocab(), teacher.get_vocab()
    if mine == theirs:
        return
    differ = sorted(set(mine.items()) ^ set(theirs.items()), key=str)[:3]
    raise ConfigError(
        f"scoring.teacher: {cfg.scoring.teacher!r} has another vocabulary than the policy "
        f"{cfg.model.path!r} ({len(theirs)} tokens vs {len(mine)}; e.g. token/id "
        f"{differ} in one only): distillation compares the logprobs of the same token ids, "
        "so the teacher needs the policy's tokenizer")


def _policy_tokenizer(cfg: Config) -> PreTrainedTokenizerBase:
    from pipeline.hub import is_hub_id
    from pipeline.model import build_char_tokenizer, load_tokenizer

    path = cfg.model.path
    if not is_hub_id(path) and not (Path(path) / "config.json").is_file() and cfg.model.init:
        return build_char_tokenizer()  # `sluice up` builds the tiny model there
    return load_tokenizer(path, cfg.model.revision)


def check_teacher(cfg: Config, policy_tokenizer: Any = None) -> None:
    """What the scorer runs at start, and `sluice up` / `sluice score` before any role:
    with ``scoring.teacher`` set, its vocabulary must be the policy's
    (`check_vocab`: ``ConfigError`` naming ``scoring.teacher``) and an
    in-process teacher's device must exist (``scoring.teacher_device``); warns
    when the policy samples at a temperature other than 1 or truncated (top-k / top-p),
    as the teacher is compared untempered (module docstring)."""
    if not cfg.scoring.teacher:
        return
    if not cfg.scoring.teacher_urls:
        from pipeline.devices import resolve_device

        resolve_device(cfg.scoring.teacher_device, "scoring.teacher_device")
    check_vocab(cfg, policy_tokenizer)
    g = cfg.generation
    if g.temperature != 1.0 or g.top_k or g.top_p < 1.0:
        log.warning("scoring.teacher: the policy samples at temperature %g (top_k %d, top_p "
                    "%g); the teacher is compared at temperature 1 without truncation, so "
                    "the tempered policy is what comes to match it (docs/distillation.md)",
                    g.temperature, g.top_k, g.top_p)
