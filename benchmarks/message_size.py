"""Bytes per `scored` group: the old layout (schema 1) vs the lean one (schema 2).

    .venv/bin/python -m benchmarks.message_size

Before schema 2 a scorer re-encoded the whole rollout group on ``scored`` (prompt dict,
texts, finish reasons, generator metadata) plus its own fields; now a `scored` entry
carries a `TrainGroup` (ids, logprobs, versions, mask, candidate sets when recorded,
clipped flags) plus rewards and advantages (docs/wire-format.md). "before" is computed exactly as
the old codec did it: the rollout encoding of the same group, re-typed ``scored``, plus
the scorer's fields; "after" is `pipeline.bus.codec.encode` of today's `ScoredGroup`.

Two cases, 8 completions per group, top-k/top-p candidate sets off (none recorded):
- ``copy``: the quick-start task (examples/copy.toml): prompt ``"48213="`` (7 tokens of
  the char-level tokenizer), completions of 8 tokens, 2 reward functions;
- ``1024-token``: a GSM8K-sized prompt (~600 characters, 160 tokens, an answer and a
  solution column) and 1,024-token completions (~4.3 characters per token of English
  text, a 151k vocabulary), 2 reward functions.
Deterministic (seeded); no Redis, no model. Printed: rollout entry bytes, scored bytes
before and after, the ratio before/after and the bytes saved per completion token.
"""

from __future__ import annotations

import time

import msgpack
import numpy as np

from pipeline.bus.codec import encode
from pipeline.bus.schema import Rollout, RolloutGroup, ScoredGroup

WORDS = ("the", "number", "of", "apples", "is", "so", "we", "multiply", "by", "and", "then",
         "add", "<think>", "</think>", "therefore", "total", "each", "box", "holds", "cost")


def _text(rng: np.random.Generator, n_chars: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < n_chars:
        out.append(WORDS[int(rng.integers(len(WORDS)))] if rng.random() > 0.2
                   else str(int(rng.integers(1000))))
    return " ".join(out)[:n_chars]


def make_group(*, n: int, prompt_tokens: int, completion_tokens: int, vocab: int,
               prompt: dict[str, str], chars_per_token: float, seed: int) -> RolloutGroup:
    """One realistic group: every completion ``completion_tokens`` long with its text."""
    rng = np.random.default_rng(seed)
    rollouts = []
    for i in range(n):
        t = completion_tokens
        rollouts.append(Rollout(
            completion_ids=rng.integers(4, vocab, t).astype(np.int32),
            logprobs=(-rng.random(t) * 3).astype(np.float32),
            versions=np.full(t, 41, dtype=np.int32), mask=np.ones(t, dtype=np.uint8),
            finish_reason="length" if i % 3 == 0 else "stop",
            text=_text(rng, int(t * chars_per_token))))
    return RolloutGroup(group_id="3:1234", prompt_index=1234, epoch=3, prompt=prompt,
                        prompt_ids=rng.integers(4, vocab, prompt_tokens).astype(np.int32),
                        generator="generator/host-12345", t_admit=time.time(),
                        t_done=time.time(), rollouts=rollouts)


def _scorer_fields(n: int, parts: tuple[str, ...]) -> dict[str, object]:
    rewards = np.linspace(0, 1, n, dtype=np.float32)
    return {"rewards": rewards, "reward_parts": {p: rewards for p in parts},
            "advantages": (rewards - rewards.mean()).astype(np.float32),
            "scorer": "scorer/host-23456", "t_scored": time.time()}


def old_scored_bytes(g: RolloutGroup, sg: ScoredGroup) -> int:
    """The schema-1 `scored` encoding: the group's rollout map re-typed, + scorer fields
    (the old codec's exact key order: type, the group's keys, the scorer's, schema)."""
    group_map = msgpack.unpackb(encode(g), raw=False)
    body = {"type": "scored", **{k: v for k, v in group_map.items()
                                 if k not in ("type", "schema")},
            "rew": sg.rewards.astype("<f4").tobytes(),
            "parts": {k: v.astype("<f4").tobytes() for k, v in sg.reward_parts.items()},
            "adv": sg.advantages.astype("<f4").tobytes(), "scorer": sg.scorer,
            "t_scored": sg.t_scored, "schema": 1}
    return len(msgpack.packb(body, use_bin_type=True))


def measure(name: str, g: RolloutGroup, parts: tuple[str, ...]) -> dict[str, float]:
    sg = ScoredGroup(group=g.for_training(), **_scorer_fields(len(g.rollouts), parts))  # type: ignore[arg-type]
    before, after = old_scored_bytes(g, sg), len(encode(sg))
    tokens = sum(len(r.completion_ids) for r in g.rollouts)
    return {"case": name, "rollout": len(encode(g)), "before": before, "after": after,
            "ratio": before / after, "saved_per_token": (before - after) / tokens}


def main() -> None:
    copy = make_group(n=8, prompt_tokens=7, completion_tokens=8, vocab=76,
                      prompt={"text": "48213=", "answer": "48213", "task": "copy"},
                      chars_per_token=0.75, seed=0)
    question = _text(np.random.default_rng(1), 600)
    long = make_group(n=8, prompt_tokens=160, completion_tokens=1024, vocab=151_936,
                      prompt={"text": question, "answer": "72",
                              "solution": _text(np.random.default_rng(2), 300) + " #### 72"},
                      chars_per_token=4.3, seed=3)
    rows = [measure("copy (8 x 8 tokens)", copy, ("copy_reward", "exact_match")),
            measure("1024-token (8 x 1024)", long, ("accuracy_reward", "think_format_reward"))]
    print(f"{'case':<24}{'rollouts B':>12}{'scored before B':>17}{'scored after B':>16}"
          f"{'before/after':>14}{'saved B/token':>15}")
    for r in rows:
        print(f"{r['case']:<24}{r['rollout']:>12}{r['before']:>17}{r['after']:>16}"
              f"{r['ratio']:>13.2f}x{r['saved_per_token']:>15.2f}")


if __name__ == "__main__":
    main()
