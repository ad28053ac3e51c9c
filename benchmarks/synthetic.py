"""Synthetic scored groups for trainer benchmarks and tests: random prompt and completion
tokens with chosen lengths, plausible behaviour logprobs, group-centred advantages.

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
        rewards = rng.random(num_generations).astype(np.float32)
        adv = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-4)
        group = RolloutGroup(group_id=f"0:{g}", prompt_index=g, epoch=0, prompt={},
                             prompt_ids=prompt, generator="synthetic", t_admit=0.0,
                             t_done=0.0, rollouts=rollouts)
        out.append(ScoredGroup(group=group.for_training(),
                               rewards=rewards, reward_parts={"r": rewards},
                               advantages=adv.astype(np.float32), scorer="synthetic",
                               t_scored=0.0))
    return out
