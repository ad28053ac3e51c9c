"""The engine contract every rollout backend implements.

GRPO's importance ratio needs, for every sampled token, the exact behaviour logprob and the
weight version that produced it. Engines therefore report both per token, and weight swaps
may land mid-generation (between decode steps), so one completion can span versions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from pipeline.config.generation import GenerationConfig


class EngineError(RuntimeError):
    """A request failed for good (after the engine's own retries) or the backend is set
    up wrongly; the message says which and why."""


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a token.

    Processing order is temperature -> top-k -> top-p, then renormalise; the recorded
    logprob is under that processed distribution. ``top_k=0`` and ``top_p=1.0`` disable the
    filters. ``greedy`` ignores all of them and takes the argmax.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    top_logprobs: int = 0
    """Report the k most likely tokens of the processed distribution at every generated
    token, with their logprobs (score centering); 0 = none. Greedy decoding reports none."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 unless greedy, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_logprobs <= 64:
            raise ValueError(f"top_logprobs must be in [0, 64], got {self.top_logprobs}")

    @classmethod
    def of(cls, g: GenerationConfig, *, top_logprobs: bool = True) -> SamplingParams:
        """`generation`'s sampling settings (generators, and the evaluator's sampled
        passes, which need no top logprobs: ``top_logprobs=False``)."""
        return cls(g.max_new_tokens, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                   top_logprobs=g.num_sampler_logprobs if top_logprobs else 0)

    @property
    def truncates(self) -> bool:
        """True when top-k / top-p cut the distribution (candidate sets matter)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


@dataclass
class Completion:
    """One sampled continuation; the three arrays are aligned and have equal length T.

    token_ids: int32 [T]; ends with the eos id iff ``finish_reason == "stop"``.
    logprobs: float32 [T]; behaviour logprob of each token under the processed distribution
        it was drawn from (greedy: plain ``log_softmax(logits)``).
    versions: int32 [T]; weight version whose forward produced each token's logits;
        non-decreasing along the sequence.
    finish_reason: "stop" (eos sampled) or "length" (hit max_new_tokens).
    candidate_ids / candidate_counts: when top-k / top-p truncated the distribution, the
        ids each token could have been drawn from (flat int32, and int32 [T] set sizes);
        None when nothing was truncated or the engine cannot tell.
    top_ids / top_logprobs: with ``SamplingParams.top_logprobs`` = k, the k most likely
        ids of each token's processed distribution (int32 [T, k], -1 = none) and their
        logprobs there (float32 [T, k]); None otherwise.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    candidate_ids: np.ndarray | None = None
    candidate_counts: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


@runtime_checkable
class Engine(Protocol):
    """A rollout backend holding one policy whose weights can be swapped while it decodes.

    Lifecycle: ``await start()`` before the first call, ``await close()`` at the end.
    """

    version: int

    async def start(self) -> None:
        """Connect / check the backend; raise with a clear message if it is unusable."""
        ...

    async def close(self) -> None: ...

    async def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Completion]]:
        """Return ``n`` completions per prompt (outer list aligned with ``prompts``).

        A weight swap lands between decode steps: every token records the version whose
        forward produced it, so a completion may span versions (non-decreasing).
        """
        ...

    async def load_weights(self, path: Path, version: int, fmt: str = "safetensors") -> bool:
        """Swap in the weights of a verified weight-store directory (``fmt`` is the
        announcement's format: ``safetensors`` full weights, an HF folder of shards behind
        ``model.safetensors.index.json``, or a ``lora`` adapter; see
        `pipeline.weights`). Reading the files must not block the event loop.

        Returns False, doing nothing, when ``version`` is not newer than the current (or
        already queued) one, so duplicate or reordered announcements are harmless.
        """
        ...

    def health(self) -> dict[str, object]:
        """Counters and state for the role's heartbeat (``healthy`` among them)."""
        ...
