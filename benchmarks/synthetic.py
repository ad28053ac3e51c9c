"""Synthetic scored groups for trainer benchmarks and tests: random prompt and completion
tokens with chosen lengths, plausible behaviour logprobs, group-centred advantages; and
multi-turn episodes (`episode_groups`) whose turns repeat across a group's episodes as a
deterministic environment's do, so that episodes share conversation prefixes.

Nothing here is trained to a goal: these batches exist to time and to compare the
trainer's maths across layouts, micro-batch splits and ranks on identical inputs.
"""

from __future__ import annotations

import numpy as np

from pipeline.bus.schema import Rollout, RolloutGroup, ScoredGroup


def scored_groups(n_groups: int, num_generations: int, *, vocab_size: int,
                  prompt_tokens: tuple[int, int], completion_tokens: tuple[int, int],
                  seed: int = 0, first_token: int = 4, version: int = 0) -> list[ScoredGroup]:
    """``n_groups`` groups of ``num_generations`` samples; prompt and completion lengths
    drawn uniformly from the inclusive ranges; token ids in ``[first_token, vocab_size)``
    (the tiny model's ids 0-3 are special)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        p_len = int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))
        prompt = rng.integers(first_token, vocab_size, p_len).astype(np.int32)
        rollouts = []
        for _ in range(num_generations):
            c_len = int(rng.integers(completion_tokens[0], completion_tokens[1] + 1))
            rollouts.append(Rollout(
                completion_ids=rng.integers(first_token, vocab_size, c_len).astype(np.int32),
                logprobs=(-rng.random(c_len) * 3 - 0.05).astype(np.float32),
                versions=np.full(c_len, version, dtype=np.int32),
                mask=np.ones(c_len, dtype=np.uint8), finish_reason="length", text=""))
        out.append(_scored(g, prompt, rollouts, rng))
    return out


def episode_groups(n_groups: int, num_generations: int, *, vocab_size: int,
                   prompt_tokens: tuple[int, int], turns: tuple[int, int],
                   turn_tokens: tuple[int, int], observation_tokens: tuple[int, int],
                   repeat: float, seed: int = 0, first_token: int = 4) -> list[ScoredGroup]:
    """``n_groups`` groups of ``num_generations`` multi-turn episodes, laid out as sluice's
    episodes are (schema 3): each is one completion of model turns (mask 1) and
    observations (mask 0, logprob 0), no observation after the last turn. Lengths are
    drawn uniformly from the inclusive ranges, ``turns`` per episode.

    Episodes share prefixes as real ones do: at each turn, with probability ``repeat`` an
    episode takes the very turn an earlier episode of its group took from the same
    conversation so far (the policy's likely action: the same tokens, then the same
    observation from a deterministic environment, e.g. GuessNumber's first guess of 50);
    otherwise it samples a fresh turn and the conversations diverge for good."""
    rng = np.random.default_rng(seed)

    def draw(bounds: tuple[int, int]) -> np.ndarray:
        n = int(rng.integers(bounds[0], bounds[1] + 1))
        return rng.integers(first_token, vocab_size, n).astype(np.int32)

    out = []
    for g in range(n_groups):
        prompt = draw(prompt_tokens)
        # (conversation so far as turn ids, turn index) -> (turn id, action, observation)
        taken: dict[tuple[int, ...], list[tuple[int, np.ndarray, np.ndarray]]] = {}
        rollouts = []
        for _ in range(num_generations):
            history: tuple[int, ...] = ()
            n_turns = int(rng.integers(turns[0], turns[1] + 1))
            ids, mask = [], []
            for k in range(n_turns):
                seen = taken.setdefault(history, [])
                if seen and rng.random() < repeat:
                    turn_id, action, obs = seen[int(rng.integers(len(seen)))]
                else:
                    turn_id, action, obs = len(seen), draw(turn_tokens), \
                        draw(observation_tokens)
                    seen.append((turn_id, action, obs))
                ids.append(action)
                mask.append(np.ones(len(action), dtype=np.uint8))
                if k < n_turns - 1:
                    ids.append(obs)
                    mask.append(np.zeros(len(obs), dtype=np.uint8))
                history += (turn_id,)
            comp, m = np.concatenate(ids), np.concatenate(mask)
            logps = np.where(m > 0, -rng.random(len(comp)) * 3 - 0.05, 0.0)
            rollouts.append(Rollout(
                completion_ids=comp, logprobs=logps.astype(np.float32),
                versions=np.zeros(len(comp), dtype=np.int32), mask=m,
                finish_reason="stop", text=""))
        out.append(_scored(g, prompt, rollouts, rng))
    return out


def _scored(g: int, prompt: np.ndarray, rollouts: list[Rollout],
            rng: np.random.Generator) -> ScoredGroup:
    """Group ``g`` of ``rollouts`` with uniform random rewards (drawn from ``rng`` after
    the rollouts) and their group-normalised advantages, as a scorer hands it on."""
    rewards = rng.random(len(rollouts)).astype(np.float32)
    adv = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-4)
    group = RolloutGroup(group_id=f"0:{g}", prompt_index=g, epoch=0, prompt={},
                         prompt_ids=prompt, generator="synthetic", t_admit=0.0,
                         t_done=0.0, rollouts=rollouts)
    return ScoredGroup(group=group.for_training(), rewards=rewards,
                       reward_parts={"r": rewards}, advantages=adv.astype(np.float32),
                       scorer="synthetic", t_scored=0.0)
