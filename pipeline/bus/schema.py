"""Typed messages that cross process boundaries (docs/wire-format.md).

These are plain dataclasses; `pipeline.bus.codec` is the only place that turns them into
bytes and back, validating everything on the way in. Arrays are numpy with fixed dtypes:
token ids, versions int32; logprobs, rewards, advantages float32; mask uint8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

SCHEMA_VERSION = 3
"""Wire format version, carried by every message. 2: a `scored` entry carries a `TrainGroup`
(only what the trainer reads), no longer the whole rollout group. 3: multi-turn
rollouts (a rollout's ``messages`` and ``env_reward``) and per-token advantages;
a reader of 2 would silently train per-token advantages as none, hence the bump."""

PromptValue = Any
"""A prompt column's value: str, int, float, bool, None, or lists / str-keyed maps of these
(a conversation is a list of ``{"role", "content"}`` maps); `pipeline.bus.codec` validates."""


class _Tokens:
    """What a completion on either stream offers: its version span and candidate sets.
    (A plain mixin: the dataclasses below declare the fields.)"""

    versions: np.ndarray
    candidate_ids: np.ndarray | None
    candidate_counts: np.ndarray | None

    @property
    def min_version(self) -> int | None:
        """The oldest version that sampled a token of this completion; None for one with
        no tokens (sampled by no version: it must not date its group, `group_min_version`)."""
        return int(self.versions.min()) if len(self.versions) else None

    def candidate_sets(self) -> list[np.ndarray] | None:
        """Token ``t``'s candidate ids as ``sets[t]`` (empty = unknown); None if none."""
        if self.candidate_ids is None or self.candidate_counts is None:
            return None
        return split_candidates(self.candidate_ids, self.candidate_counts)


@dataclass
class Rollout(_Tokens):
    """One completion, or one multi-turn episode. Invariant: all four arrays have the
    same length. An episode's ``mask`` is 0 at the tokens its environment inserted (their
    ``logprobs`` are 0: not sampled), ``messages`` holds its turns as chat messages
    (``assistant`` for the model's, the environment's own roles) and ``env_reward`` the
    environment's rewards summed per named part; both None for a single completion.

    ``candidate_ids``/``candidate_counts`` (both or neither) record, when the sampler
    truncated its distribution (top-k / top-p), the token ids it could have drawn at each
    position: token ``t``'s set is the next ``candidate_counts[t]`` entries of
    ``candidate_ids`` (0 = unknown at that position). The trainer renormalises its
    logprobs over the same set so the importance ratio compares like with like.

    ``top_ids``/``top_logprobs`` (both or neither), when the generator asked its engine for
    them (``generation.num_sampler_logprobs``), are the sampler's ``k`` most likely tokens
    at each position and their logprobs under the distribution it drew from: what score
    centering (`pipeline.rl.centering`) estimates the sampler's expected score from.
    """

    completion_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T], behaviour policy, as sampled
    versions: np.ndarray  # int32 [T], weight version that sampled each token
    mask: np.ndarray  # uint8 [T], 1 = policy token (trained), 0 = inserted context
    finish_reason: str
    text: str
    candidate_ids: np.ndarray | None = None  # int32 [sum(candidate_counts)]
    candidate_counts: np.ndarray | None = None  # int32 [T]
    top_ids: np.ndarray | None = None  # int32 [T, k], the sampler's top ids, -1 = none
    top_logprobs: np.ndarray | None = None  # float32 [T, k], their sampler logprobs
    messages: list[dict[str, PromptValue]] | None = None  # a multi-turn episode's turns
    env_reward: dict[str, float] | None = None  # environment reward parts, summed per part

    def for_training(self) -> TrainRollout:
        """What the trainer reads of this completion (shares the arrays, no copy)."""
        return TrainRollout(self.completion_ids, self.logprobs, self.versions, self.mask,
                            clipped=self.finish_reason == "length",
                            candidate_ids=self.candidate_ids,
                            candidate_counts=self.candidate_counts,
                            top_ids=self.top_ids, top_logprobs=self.top_logprobs)


@dataclass
class TrainRollout(_Tokens):
    """One completion as a `scored` entry carries it: the arrays of its `Rollout` (same
    invariant: equal lengths; the same candidate sets, which the trainer needs to
    renormalise top-k / top-p logprobs) and ``clipped`` (its finish reason was
    ``length``: TRL's clipped ratio, `trainer.stats`). Not its text: no trainer code reads
    it, and it would cross Redis twice."""

    completion_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T], behaviour policy, as sampled
    versions: np.ndarray  # int32 [T]
    mask: np.ndarray  # uint8 [T], 1 = policy token (trained)
    clipped: bool  # hit max_new_tokens (finish_reason "length")
    candidate_ids: np.ndarray | None = None  # int32 [sum(candidate_counts)]
    candidate_counts: np.ndarray | None = None  # int32 [T]
    top_ids: np.ndarray | None = None  # int32 [T, k], -1 = none
    top_logprobs: np.ndarray | None = None  # float32 [T, k]


def group_min_version(rollouts: list[Rollout] | list[TrainRollout]) -> int:
    """A group's age for the staleness test: the oldest version of any token of its
    completions. A completion with no tokens has no say (it was sampled by no version;
    counting it as version 0 made every group holding one retire ``stale``), and a group
    with no token at all is dated 0: nothing to train and nothing to date it by."""
    return min((v for r in rollouts if (v := r.min_version) is not None), default=0)


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
        return group_min_version(self.rollouts)

    def for_training(self) -> TrainGroup:
        """The part of this group a `scored` entry carries (shares the arrays)."""
        return TrainGroup(self.group_id, self.prompt_ids,
                          [r.for_training() for r in self.rollouts])


@dataclass
class TrainGroup:
    """What the trainer reads of a rollout group: its id (dedup, ledger), the prompt ids
    (each row is prompt + completion) and the completions' `TrainRollout`s. The prompt
    dict, the texts and the generator's metadata stay on ``rollouts`` (reward functions,
    the audit and ``sluice tail rollouts`` read them there)."""

    group_id: str
    prompt_ids: np.ndarray  # int32 [P]
    rollouts: list[TrainRollout]

    @property
    def min_version(self) -> int:
        return group_min_version(self.rollouts)


@dataclass
class ScoredGroup:
    """What the trainer needs of one scored group (docs/design.md §5): the `TrainGroup`, rewards
    and advantages; one row per rollout. Build it with ``RolloutGroup.for_training()``.
    ``token_advantages``, when set, gives every rollout one advantage per token (same
    length as its ids; the trainer reads them at mask-1 tokens only) and replaces
    ``advantages`` in the loss (``advantages`` then holds their mean over mask-1 tokens,
    for reports)."""

    group: TrainGroup
    rewards: np.ndarray  # float32 [n], weighted total
    reward_parts: dict[str, np.ndarray]  # name -> float32 [n], NaN where fn returned None
    advantages: np.ndarray  # float32 [n]
    scorer: str
    t_scored: float
    token_advantages: list[np.ndarray] | None = None  # float32 [T_i] per rollout

    def advantage_of(self, i: int) -> np.ndarray | float:
        """Rollout ``i``'s advantage: per token when the scorer gave them (on-policy
        distillation, a per-token ``scoring.advantages`` hook), else one number."""
        if self.token_advantages is not None:
            return self.token_advantages[i]
        return float(self.advantages[i])


@dataclass
class WeightsPublished:
    version: int
    step: int
    uri: str
    format: str  # safetensors | lora | nccl | delta
    sha256: str
    nbytes: int
    t: float
    base: int = -1  # delta: the version it applies to; -1 = a full version
    state: str = ""  # runs with deltas: sha256 of the full state (pipeline/weights/delta.py)


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
