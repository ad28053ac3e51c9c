"""Typed messages that cross process boundaries (see DESIGN.md §3).

These are plain dataclasses; `pipeline.bus.codec` is the only place that turns them into
bytes and back, validating everything on the way in. Arrays are numpy with fixed dtypes:
token ids, versions int32; logprobs, rewards, advantages float32; mask uint8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SCHEMA_VERSION = 1

PromptValue = Any
"""A prompt column's value: str, int, float, bool, None, or lists / str-keyed maps of these
(a conversation is a list of ``{"role", "content"}`` maps); `pipeline.bus.codec` validates."""


@dataclass
class Rollout:
    """One completion. Invariant: all four arrays have the same length.

    ``candidate_ids``/``candidate_counts`` (both or neither) record, when the sampler
    truncated its distribution (top-k / top-p), the token ids it could have drawn at each
    position: token ``t``'s set is the next ``candidate_counts[t]`` entries of
    ``candidate_ids`` (0 = unknown at that position). The trainer renormalises its
    logprobs over the same set so the importance ratio compares like with like.
    """

    completion_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T], behaviour policy, as sampled
    versions: np.ndarray  # int32 [T], weight version that sampled each token
    mask: np.ndarray  # uint8 [T], 1 = policy token (trained), 0 = inserted context
    finish_reason: str
    text: str
    candidate_ids: np.ndarray | None = None  # int32 [sum(candidate_counts)]
    candidate_counts: np.ndarray | None = None  # int32 [T]

    @property
    def min_version(self) -> int:
        return int(self.versions.min()) if len(self.versions) else 0

    def candidate_sets(self) -> list[np.ndarray] | None:
        """Token ``t``'s candidate ids as ``sets[t]`` (empty = unknown); None if none."""
        if self.candidate_ids is None or self.candidate_counts is None:
            return None
        return split_candidates(self.candidate_ids, self.candidate_counts)


def split_candidates(candidate_ids: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """The flat wire form of candidate sets -> one array per token (``len(counts)``)."""
    return np.split(candidate_ids, np.cumsum(counts)[:-1]) if len(counts) else []


@dataclass
class RolloutGroup:
    """All completions of one prompt; ``group_id`` = ``epoch:prompt_index`` is unique."""

    group_id: str
    prompt_index: int
    epoch: int
    prompt: dict[str, PromptValue]
    prompt_ids: np.ndarray  # int32 [P]
    generator: str
    t_admit: float
    t_done: float
    rollouts: list[Rollout]

    @property
    def min_version(self) -> int:
        return min(r.min_version for r in self.rollouts)


@dataclass
class ScoredGroup:
    """A rollout group plus rewards and advantages; one row per rollout."""

    group: RolloutGroup
    rewards: np.ndarray  # float32 [n], weighted total
    reward_parts: dict[str, np.ndarray]  # name -> float32 [n], NaN where fn returned None
    advantages: np.ndarray  # float32 [n]
    scorer: str
    t_scored: float


@dataclass
class WeightsPublished:
    version: int
    step: int
    uri: str
    format: str  # safetensors | lora | nccl
    sha256: str
    nbytes: int
    t: float


@dataclass
class RunFinished:
    reason: str
    t: float = 0.0


@dataclass
class Limits:
    """Bounds applied on decode; anything outside them is rejected (dead-lettered)."""

    vocab_size: int = 1 << 31
    max_message_bytes: int = 16 * 2**20
    max_tokens: int = 1 << 20
    max_rollouts: int = 4096
