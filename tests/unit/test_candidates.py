"""Top-k / top-p candidate sets: recorded by the engine, carried on the wire, used by the
trainer so that on-policy importance ratios are exactly 1 (and biased without them)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import torch

from pipeline.bus.codec import DecodeError, decode, encode
from pipeline.bus.schema import Limits, Rollout, RolloutGroup, ScoredGroup
from pipeline.model import init_tiny_model, load_model
from pipeline.rl.logprobs import candidate_log_softmax, selective_log_softmax
from trainer.batch import build_batch
from trainer.step import token_logps
from trainer.trainer import Trainer
from workers.engines import SamplingParams
from workers.engines.transformers import TransformersEngine
from workers.episodes import Episode

torch.set_num_threads(1)
PROMPTS = [[5, 6, 7, 8], [12, 13, 14, 15]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("cand") / "m", seed=0)


def test_candidate_log_softmax_renormalises_over_the_set() -> None:
    logits = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]]], requires_grad=True)
    ids = torch.tensor([[2, 1]])
    cands = torch.tensor([[[3, 2, -1], [-1, -1, -1]]])  # row 1: set unknown -> full vocab
    out = candidate_log_softmax(logits, ids, cands, temperature=0.5)
    # position 0: logits/T = [2,4,6,8], set {3,2}: 6 - log(e^6 + e^8)
    assert out[0, 0].item() == pytest.approx(6 - math.log(math.exp(6) + math.exp(8)), abs=1e-6)
    assert out[0, 1].item() == pytest.approx(math.log(0.25), abs=1e-6)
    out.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert logits.grad[0, 0, 0] == 0.0  # outside the set: no gradient
    # a sampled id outside its recorded set is impossible under the sampler: -inf
    bad = candidate_log_softmax(logits, torch.tensor([[0, 1]]), cands)
    assert bad[0, 0].item() == -math.inf
    with pytest.raises(ValueError, match="candidates"):
        candidate_log_softmax(logits, ids, cands[0])


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.6), (8, 0.9)])
def test_on_policy_ratio_is_one_only_with_candidate_sets(model_dir: Path, top_k: int,
                                                          top_p: float) -> None:
    """Trainer logprobs over the recorded sets equal the sampler's processed logprobs."""
    model, tok = load_model(model_dir)
    engine = TransformersEngine(model, tok, seed=3)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=top_k, top_p=top_p)
    groups = asyncio.run(engine.generate(PROMPTS, 4, params))
    for c in (c for g in groups for c in g):
        assert c.candidate_counts is not None and c.candidate_ids is not None
        assert len(c.candidate_counts) == len(c.token_ids)
        assert c.candidate_counts.min() >= 1 and c.candidate_counts.sum() == len(c.candidate_ids)
        if top_k:
            assert c.candidate_counts.max() <= top_k or top_p == 1.0
    sgs = [_scored(i, p, [Episode.of(c).to_rollout(tok) for c in g])
           for i, (p, g) in enumerate(zip(PROMPTS, groups, strict=True))]
    # through the wire and back: the sets survive the codec
    sgs = [decode(encode(sg), Limits(vocab_size=76)) for sg in sgs]
    batch = build_batch(sgs, pad_id=0)  # type: ignore[arg-type]
    assert batch.candidates is not None and batch.candidates_missing == 0
    with torch.no_grad():
        renorm, comp = token_logps(model, batch, temperature=0.8)
        full = selective_log_softmax(comp, batch.completion_ids, 0.8)
    m = batch.mask > 0
    ratio = torch.exp(renorm - batch.behaviour_logps)[m]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)
    biased = torch.exp(full - batch.behaviour_logps)[m]
    assert float(biased.mean()) < 0.99  # full-vocab trainer vs truncated sampler


def test_untruncated_sampling_records_no_sets(model_dir: Path) -> None:
    model, tok = load_model(model_dir)
    engine = TransformersEngine(model, tok)
    out = asyncio.run(engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=4)))
    assert all(c.candidate_ids is None for g in out for c in g)
    greedy = asyncio.run(engine.greedy(PROMPTS, 4))
    assert all(c.candidate_counts is None for c in greedy)


def _rollout(ids: list[int], counts: list[int] | None, cand: list[int] | None) -> Rollout:
    n = len(ids)
    return Rollout(np.array(ids, np.int32), np.full(n, -0.5, np.float32),
                   np.zeros(n, np.int32), np.ones(n, np.uint8), "length", "",
                   None if cand is None else np.array(cand, np.int32),
                   None if counts is None else np.array(counts, np.int32))


def _scored(i: int, prompt: list[int], rollouts: list[Rollout]) -> ScoredGroup:
    g = RolloutGroup(f"0:{i}", i, 0, {"text": "x"}, np.array(prompt, np.int32), "g", 0.0, 0.0,
                     rollouts)
    n = len(rollouts)
    return ScoredGroup(g.for_training(),
                       np.zeros(n, np.float32), {}, np.linspace(-1, 1, n, dtype=np.float32),
                       "s", 0.0)


@pytest.mark.parametrize(("counts", "cand", "match"), [
    ([2, 1], [4, 5], "counts sum"),           # 2 ids, counts sum 3
    ([2], [4, 5], "1 counts for 2 tokens"),   # one count per token
    ([2, -1, 1], [4, 5], "negative"),
    ([2, 1], [4, 9, 7], "not in its candidate set"),  # token 1 (id 5) not in {7}
    ([2, 1], [4, 5, 99], "token id outside"),
])
def test_codec_rejects_inconsistent_sets(counts: list[int], cand: list[int],
                                         match: str) -> None:
    ids = [4, 5] if len(counts) != 3 else [4, 5, 6]
    sg = _scored(0, [3], [_rollout(ids, None, None), _rollout(ids, None, None)])
    sg.group.rollouts[0] = _rollout(ids, [0] * len(ids), []).for_training()  # encodes the keys
    data = encode(sg)
    body = msgpack.unpackb(data, raw=False)
    body["ro"][0]["cand"] = np.array(cand, np.int32).tobytes()
    body["ro"][0]["ncand"] = np.array(counts, np.int32).tobytes()
    with pytest.raises(DecodeError, match=match):
        decode(msgpack.packb(body, use_bin_type=True), Limits(vocab_size=76))


def test_batch_mixes_rows_with_and_without_sets_and_the_trainer_says_so() -> None:
    with_sets = _rollout([4, 5], [2, 1], [4, 9, 5])
    without = _rollout([6, 7, 8], None, None)
    batch = build_batch([_scored(0, [3, 3], [with_sets, without])], pad_id=0)
    assert batch.candidates is not None
    assert batch.candidates.tolist()[0] == [[4, 9], [5, -1], [-1, -1]]
    assert (batch.candidates[1] == -1).all() and batch.candidates_missing == 1
    fake = SimpleNamespace(expects_candidates=True, warned_candidates=False)
    assert Trainer.candidates_missing(fake, batch) == 0.5  # type: ignore[arg-type]
    assert fake.warned_candidates
    fake = SimpleNamespace(expects_candidates=False, warned_candidates=False)
    assert Trainer.candidates_missing(fake, batch) == 0.0  # type: ignore[arg-type]
