"""trainer.batch: the trainer's targets line up with what the generator sampled.

A tiny model generates completions with TransformersEngine; the trainer's path
(build_batch -> forward -> completion_logits -> selective_log_softmax) must reproduce the
engine's recorded behaviour logprobs on every masked token, and the mask must cover
exactly the completion tokens. An off-by-one in the target alignment breaks this.
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from pipeline.bus.codec import decode, encode
from pipeline.bus.schema import Limits, Rollout, RolloutGroup, ScoredGroup
from pipeline.model import init_tiny_model, load_model
from pipeline.rl.logprobs import selective_log_softmax
from trainer.batch import Batch, build_batch, completion_logits
from workers.engines import SamplingParams
from workers.engines.transformers import TransformersEngine

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41]]  # different lengths -> different padding
N = 3
MAX_NEW = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, list[ScoredGroup],
                                                            int]:
    path = init_tiny_model(tmp_path_factory.mktemp("batch") / "tiny", seed=0)
    model, tok = load_model(path)
    engine = TransformersEngine(model, tok, seed=11)
    params = SamplingParams(MAX_NEW, temperature=1.0, top_k=0, top_p=1.0)
    out = asyncio.run(engine.generate(PROMPTS, N, params))
    groups = []
    for p_idx, (prompt, comps) in enumerate(zip(PROMPTS, out, strict=True)):
        rollouts = [
            Rollout(completion_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions,
                    mask=np.ones(len(c), dtype=np.uint8), finish_reason=c.finish_reason,
                    text="")
            for c in comps
        ]
        if p_idx == 1:
            # A prefix of a sampled completion keeps its logprobs: this guarantees rows of
            # different completion lengths (padding inside the [B, T] span) whatever is sampled.
            r = rollouts[1]
            rollouts[1] = Rollout(r.completion_ids[:2], r.logprobs[:2], r.versions[:2],
                                  r.mask[:2], "stop", "")
        g = RolloutGroup(group_id=f"0:{p_idx}", prompt_index=p_idx, epoch=0, prompt={},
                         prompt_ids=np.asarray(prompt, dtype=np.int32), generator="g",
                         t_admit=0.0, t_done=0.0, rollouts=rollouts)
        sg = ScoredGroup(group=g.for_training(), rewards=np.zeros(N, np.float32), reward_parts={},
                         advantages=np.arange(N, dtype=np.float32) + 10 * p_idx, scorer="s",
                         t_scored=0.0)
        # through the wire, as the trainer receives it
        got = decode(encode(sg), Limits(vocab_size=tok.vocab_size), expect=ScoredGroup)
        assert isinstance(got, ScoredGroup)
        groups.append(got)
    return model, groups, int(tok.pad_token_id)


def _rows(groups: list[ScoredGroup]) -> list[tuple[np.ndarray, Rollout]]:
    return [(sg.group.prompt_ids, r) for sg in groups for r in sg.group.rollouts]


def _trainer_logps(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return selective_log_softmax(completion_logits(logits.float(), batch), batch.completion_ids)


def test_completion_lengths_vary_in_the_batch(setup: tuple) -> None:
    _, groups, _ = setup
    lens = {len(r.completion_ids) for _, r in _rows(groups)}
    assert len(lens) > 1 and max(lens) <= MAX_NEW


def test_trainer_logps_equal_engine_behaviour_logprobs_on_masked_tokens(setup: tuple) -> None:
    model, groups, pad = setup
    batch = build_batch(groups, pad)
    logps = _trainer_logps(model, batch)
    m = batch.mask.bool()
    assert logps.shape == batch.mask.shape
    assert int(m.sum()) == sum(len(r.completion_ids) for _, r in _rows(groups))
    torch.testing.assert_close(logps[m], batch.behaviour_logps[m], atol=1e-4, rtol=0)
    # and the behaviour logprobs in the batch are the engine's, row by row
    for i, (_, r) in enumerate(_rows(groups)):
        n = len(r.completion_ids)
        np.testing.assert_allclose(logps[i, :n].numpy(), r.logprobs, atol=1e-4, rtol=0)


def test_shifted_alignment_would_not_match(setup: tuple) -> None:
    """Guards the test above: predicting from the wrong position is detectably different."""
    model, groups, pad = setup
    batch = build_batch(groups, pad)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    shifted = Batch(**{**batch.__dict__, "completion_start": batch.completion_start + 1})
    wrong = selective_log_softmax(completion_logits(logits.float(), shifted),
                                  batch.completion_ids)
    m = batch.mask.bool()
    assert (wrong[m] - batch.behaviour_logps[m]).abs().max() > 1e-2


def test_mask_covers_exactly_the_completion_tokens(setup: tuple) -> None:
    _, groups, pad = setup
    batch = build_batch(groups, pad)
    rows = _rows(groups)
    b = len(rows)
    t = max(len(r.completion_ids) for _, r in rows)
    assert batch.completion_ids.shape == batch.mask.shape == batch.behaviour_logps.shape == (b, t)
    assert batch.input_ids.shape == (b, max(len(p) + len(r.completion_ids) for p, r in rows))
    for i, (p, r) in enumerate(rows):
        n_p, n_c = len(p), len(r.completion_ids)
        assert batch.mask[i].tolist() == [1.0] * n_c + [0.0] * (t - n_c)
        assert int(batch.completion_start[i]) == n_p
        # the masked span of row i is exactly input_ids[n_p : n_p + n_c], the completion
        assert batch.input_ids[i, :n_p].tolist() == p.tolist()
        assert batch.input_ids[i, n_p:n_p + n_c].tolist() == r.completion_ids.tolist()
        assert batch.completion_ids[i, :n_c].tolist() == r.completion_ids.tolist()
        assert batch.attention_mask[i].tolist() == [1] * (n_p + n_c) + [0] * (
            batch.input_ids.shape[1] - n_p - n_c)
        assert (batch.input_ids[i, n_p + n_c:] == pad).all()
        assert (batch.behaviour_logps[i, n_c:] == 0).all()
    assert batch.num_tokens == sum(len(r.completion_ids) for _, r in rows)
    assert batch.advantages.tolist() == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]


def test_rollout_mask_zero_tokens_are_excluded(setup: tuple) -> None:
    _, groups, pad = setup
    groups = copy.deepcopy(groups)
    r = groups[0].group.rollouts[0]
    r.mask[0] = 0
    batch = build_batch(groups, pad)
    n = len(r.completion_ids)
    assert batch.mask[0, :n].tolist() == [0.0] + [1.0] * (n - 1)
    assert batch.mask[1:].sum() == build_batch(setup[1], pad).mask[1:].sum()


def test_empty_batch_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty batch"):
        build_batch([], 0)
