"""Rollouts as episodes: one token sequence per rollout, built turn by turn.

A rollout is what follows the prompt: the model's tokens (mask 1, their behaviour
logprobs and per-token weight versions exactly as the engine sampled them) interleaved
with context the environment inserted (mask 0). `EpisodeBuilder` is the one way such a
sequence is assembled, by the environment runner (`workers.environments.runner`) and by
a user's ``generation.rollout`` hook alike (`RolloutContext`, TRL's ``rollout_func``
counterpart), so both give the trainer the same guarantees:

- the arrays are aligned and equal in length; model tokens are never re-tokenised;
- an inserted token carries logprob 0 (it has none: it was not sampled; the trainer
  never reads it, mask 0) and the version of the model token before it (the first model
  token's when it precedes them all), so versions stay non-decreasing and an inserted
  token never makes a sample look staler than its model tokens;
- candidate sets (top-k / top-p) are kept for model tokens; inserted tokens have none.

`TurnBatcher` lets many episodes in flight share the in-process engine: concurrent
one-sequence requests are decoded as one batch (a vLLM engine batches on the server, so
its requests go straight through).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.bus.schema import Rollout
from workers.engines.base import Completion, Engine, SamplingParams
from workers.tasks.prompts import Messages


@dataclass
class Episode:
    """One rollout of a group: the token arrays (see the module docstring for what each
    holds at inserted positions), how it ended (``stop``: the model or the environment
    ended it; ``length``: a token or turn budget cut it), the conversation as chat messages
    (what reward functions get as ``completions`` for a multi-turn rollout), and the
    environment's rewards summed per part (None when no environment scored it)."""

    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]
    versions: np.ndarray  # int32 [T]
    mask: np.ndarray  # uint8 [T]
    finish_reason: str
    messages: Messages | None = None
    env_reward: dict[str, float] | None = None
    turns: int = 1
    candidate_ids: np.ndarray | None = None
    candidate_counts: np.ndarray | None = None
    top_ids: np.ndarray | None = None  # int32 [T, k], -1 = none (inserted context)
    top_logprobs: np.ndarray | None = None  # float32 [T, k]

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def to_rollout(self, tokenizer: Any) -> Rollout:
        """The wire form; its text is the whole decoded sequence (an episode's: the
        transcript, environment turns included), special tokens skipped."""
        return Rollout(
            completion_ids=self.token_ids.astype(np.int32),
            logprobs=self.logprobs.astype(np.float32),
            versions=self.versions.astype(np.int32), mask=self.mask.astype(np.uint8),
            finish_reason=self.finish_reason,
            text=str(tokenizer.decode(self.token_ids, skip_special_tokens=True)),
            candidate_ids=self.candidate_ids, candidate_counts=self.candidate_counts,
            top_ids=self.top_ids, top_logprobs=self.top_logprobs,
            messages=self.messages, env_reward=self.env_reward)

    @classmethod
    def of(cls, c: Completion) -> Episode:
        """A single-turn rollout: one completion, every token the model's."""
        return cls(c.token_ids.astype(np.int32), c.logprobs.astype(np.float32),
                   c.versions.astype(np.int32), np.ones(len(c), dtype=np.uint8),
                   c.finish_reason, candidate_ids=c.candidate_ids,
                   candidate_counts=c.candidate_counts, top_ids=c.top_ids,
                   top_logprobs=c.top_logprobs)


@dataclass
class EpisodeBuilder:
    """Accumulates one rollout's segments (`add_model`, `add_context`), then `finish`."""

    start_version: int = 0
    _ids: list[np.ndarray] = field(default_factory=list)
    _lps: list[np.ndarray] = field(default_factory=list)
    _vers: list[np.ndarray | None] = field(default_factory=list)
    _cands: list[tuple[np.ndarray, np.ndarray] | None] = field(default_factory=list)
    _tops: list[tuple[np.ndarray, np.ndarray] | None] = field(default_factory=list)
    _model_turns: int = 0
    _len: int = 0

    def __len__(self) -> int:
        return self._len

    @property
    def token_ids(self) -> list[int]:
        return [int(t) for a in self._ids for t in a]

    def add_model(self, c: Completion) -> None:
        """The model's turn, exactly as sampled (mask 1)."""
        n = len(c)
        self._ids.append(np.asarray(c.token_ids, dtype=np.int32))
        self._lps.append(np.asarray(c.logprobs, dtype=np.float32))
        self._vers.append(np.asarray(c.versions, dtype=np.int32))
        if c.candidate_ids is not None and c.candidate_counts is not None:
            self._cands.append((np.asarray(c.candidate_ids, np.int32),
                                np.asarray(c.candidate_counts, np.int32)))
        else:
            self._cands.append(None)
        self._tops.append(None if c.top_ids is None or c.top_logprobs is None else
                          (np.asarray(c.top_ids, np.int32),
                           np.asarray(c.top_logprobs, np.float32)))
        self._model_turns += 1
        self._len += n

    def add_context(self, ids: Sequence[int]) -> None:
        """Tokens the environment (or the hook) inserted: mask 0, no logprob."""
        a = np.asarray(list(ids), dtype=np.int32)
        if a.ndim != 1:
            raise ValueError("context ids must be a flat list of token ids")
        self._ids.append(a)
        self._lps.append(np.zeros(len(a), np.float32))
        self._vers.append(None)
        self._cands.append(None)
        self._tops.append(None)
        self._len += len(a)

    def finish(self, finish_reason: str, *, messages: Messages | None = None,
               env_reward: dict[str, float] | None = None) -> Episode:
        if finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {finish_reason!r}")
        model = [v for v in self._vers if v is not None and len(v)]
        first = int(model[0][0]) if model else self.start_version
        vers: list[np.ndarray] = []
        mask: list[np.ndarray] = []
        last = first
        for ids, v in zip(self._ids, self._vers, strict=True):
            if v is None:
                vers.append(np.full(len(ids), last, np.int32))
                mask.append(np.zeros(len(ids), np.uint8))
            else:
                vers.append(v)
                mask.append(np.ones(len(ids), np.uint8))
                if len(v):
                    last = int(v[-1])
        cand_ids = cand_counts = None
        if any(c is not None for c in self._cands):
            cand_ids = _cat([c[0] for c in self._cands if c is not None], np.int32)
            cand_counts = _cat([c[1] if c is not None else np.zeros(len(ids), np.int32)
                               for ids, c in zip(self._ids, self._cands, strict=True)], np.int32)
        top_ids, top_lps = self._top_arrays()
        return Episode(_cat(self._ids, np.int32), _cat(self._lps, np.float32),
                       _cat(vers, np.int32), _cat(mask, np.uint8), finish_reason,
                       messages=messages, env_reward=env_reward,
                       turns=max(self._model_turns, 1), candidate_ids=cand_ids,
                       candidate_counts=cand_counts, top_ids=top_ids, top_logprobs=top_lps)

    def _top_arrays(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The segments' sampler top logprobs as ``[T, k]``: -1 ids (no entry) at inserted
        context and at model turns whose engine reported none; None if none did."""
        k = max((t[0].shape[1] for t in self._tops if t is not None), default=0)
        if not k:
            return None, None
        ids, lps = [], []
        for seg, t in zip(self._ids, self._tops, strict=True):
            i = np.full((len(seg), k), -1, np.int32)
            lp = np.zeros((len(seg), k), np.float32)
            if t is not None:
                i[:, :t[0].shape[1]], lp[:, :t[1].shape[1]] = t
            ids.append(i)
            lps.append(lp)
        return np.concatenate(ids), np.concatenate(lps)


class TurnBatcher:
    """One-sequence generate requests of concurrent episodes, decoded together.

    A request waits for the batch in flight to finish, then goes with every request that
    arrived meanwhile (same sampling parameters) into one ``engine.generate`` call. Engines
    with independent requests (``independent_prompts``: vLLM) are called directly."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.direct = bool(getattr(engine, "independent_prompts", False))
        self._queue: list[tuple[list[int], SamplingParams, asyncio.Future[Completion]]] = []
        self._worker: asyncio.Task[None] | None = None
        self.calls = 0  # engine calls made (batches), for tests and metrics

    async def generate(self, ids: list[int], params: SamplingParams) -> Completion:
        if self.direct:
            self.calls += 1
            return (await self.engine.generate([ids], 1, params))[0][0]
        fut: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._queue.append((ids, params, fut))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # let the other episodes of this tick queue their turns
        while self._queue:
            params = self._queue[0][1]
            batch = [q for q in self._queue if q[1] == params]
            self._queue = [q for q in self._queue if q[1] != params]
            self.calls += 1
            try:
                out = await self.engine.generate([ids for ids, _, _ in batch], 1, params)
            except Exception as e:  # every waiter sees the engine's own error
                for *_, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (*_, fut), group in zip(batch, out, strict=True):
                if not fut.done():
                    fut.set_result(group[0])


@dataclass
class RolloutContext:
    """What a rollout (the environment runner, or a ``generation.rollout`` hook) gets for
    one group: ``n`` rollouts of ``prompt`` (its dict) whose rendered ids are
    ``prompt_ids``, sampled with ``params``.

    ``generate`` samples one continuation of any token sequence (the prompt ids plus what
    the episode holds so far) with exact tokens, logprobs and versions; ``episode`` starts
    a builder. A hook returns ``n`` `Episode`s built with them."""

    prompt: dict[str, Any]
    prompt_ids: list[int]
    n: int
    params: SamplingParams
    tokenizer: Any
    batcher: TurnBatcher
    version: int = 0
    conversation: Messages | None = None  # the prompt as messages, when ``prompt_ids`` are
    # a chat template's rendering without the generation prompt (episodes of an
    # environment: `workers.environments.runner.episode_prompt`)

    async def generate(self, ids: Sequence[int], max_new_tokens: int | None = None
                       ) -> Completion:
        """One sampled continuation of ``ids`` (at most ``max_new_tokens``, default the
        configured ``generation.max_new_tokens``). A request for fewer tokens than that is
        sampled at the full cap and cut (a cut completion ends ``length``): requests stay
        alike, so concurrent episodes share a batch."""
        c = await self.batcher.generate([int(t) for t in ids], self.params)
        if max_new_tokens is not None and len(c) > max_new_tokens:
            k = max(max_new_tokens, 0)
            c = Completion(c.token_ids[:k], c.logprobs[:k], c.versions[:k], "length",
                           *_cut_candidates(c, k))
        return c

    def episode(self) -> EpisodeBuilder:
        return EpisodeBuilder(start_version=self.version)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


def _cat(xs: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype)


def _cut_candidates(c: Completion, k: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    if c.candidate_ids is None or c.candidate_counts is None:
        return None, None
    counts = c.candidate_counts[:k]
    return c.candidate_ids[:int(counts.sum())], counts


def check_episodes(value: Any, n: int, where: str) -> list[Episode]:
    """What a rollout returned, if it is ``n`` well-formed episodes; else ``ValueError``
    saying what is wrong (the group then retires dead with that reason)."""
    if not isinstance(value, list | tuple) or len(value) != n:
        got = f"{len(value)} items" if isinstance(value, list | tuple) else type(value).__name__
        raise ValueError(f"{where} must return {n} Episodes (generation.num_generations), "
                         f"got {got}")
    for i, e in enumerate(value):
        if not isinstance(e, Episode):
            raise ValueError(f"{where}[{i}] is a {type(e).__name__}, not an Episode (build it "
                             "with ctx.episode() ... .finish())")
        if not len(e.token_ids) == len(e.logprobs) == len(e.versions) == len(e.mask):
            raise ValueError(f"{where}[{i}]: token, logprob, version and mask arrays differ "
                             "in length")
        if not len(e) or not e.mask.any():
            raise ValueError(f"{where}[{i}] has no model token (nothing to train on)")
    return list(value)
