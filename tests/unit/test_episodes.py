"""workers.episodes: EpisodeBuilder's invariants, check_episodes, TurnBatcher (one engine
call for concurrent turns, each equal to a lone call) and RolloutContext's token cap."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.model import load_model
from workers.engines.base import Completion, SamplingParams
from workers.engines.transformers import TransformersEngine
from workers.episodes import (
    Episode,
    EpisodeBuilder,
    RolloutContext,
    TurnBatcher,
    check_episodes,
)

torch.set_num_threads(1)


def completion(ids: list[int], versions: list[int], *, cands: list[list[int]] | None = None,
               finish: str = "length") -> Completion:
    """A model turn with logprobs -(1 + position/10) (distinct, non-zero) and, with
    ``cands``, one candidate set per token."""
    c_ids = c_counts = None
    if cands is not None:
        assert len(cands) == len(ids)
        c_ids = np.array([t for s in cands for t in s], np.int32)
        c_counts = np.array([len(s) for s in cands], np.int32)
    return Completion(np.array(ids, np.int32),
                      -(1.0 + np.arange(len(ids), dtype=np.float32) / 10),
                      np.array(versions, np.int32), finish, c_ids, c_counts)


# ---------------------------------------------------------------- EpisodeBuilder


def test_builder_aligns_segments_masks_model_tokens_and_fills_inserted_ones() -> None:
    """Context before any model token, two model turns (one with candidate sets, one
    without), context between and after them: every array has the episode's length, mask
    1 exactly at model tokens, inserted tokens logprob 0 and the version of the model
    token before them (the first model token's for the leading context)."""
    t0 = completion([10, 11], [3, 4], cands=[[10, 12], [11]])
    t1 = completion([30], [5])
    b = EpisodeBuilder(start_version=0)
    b.add_context([7, 8])
    b.add_model(t0)
    b.add_context([20, 21, 22])
    b.add_model(t1)
    b.add_context([40])
    assert len(b) == 9 and b.token_ids == [7, 8, 10, 11, 20, 21, 22, 30, 40]
    e = b.finish("length", messages=[{"role": "assistant", "content": "x"}],
                 env_reward={"r": 1.0})

    assert e.token_ids.tolist() == [7, 8, 10, 11, 20, 21, 22, 30, 40]
    assert e.mask.tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 0]
    np.testing.assert_array_equal(e.logprobs, np.array([0, 0, -1.0, -1.1, 0, 0, 0, -1.0, 0],
                                                       np.float32))
    assert e.versions.tolist() == [3, 3, 3, 4, 4, 4, 4, 5, 5]
    assert (e.token_ids.dtype, e.logprobs.dtype, e.versions.dtype, e.mask.dtype) == (
        np.int32, np.float32, np.int32, np.uint8)
    # candidate sets: the first turn's kept, count 0 (unknown) everywhere else
    assert e.candidate_counts is not None and e.candidate_ids is not None
    assert e.candidate_counts.tolist() == [0, 0, 2, 1, 0, 0, 0, 0, 0]
    assert e.candidate_ids.tolist() == [10, 12, 11]
    assert e.finish_reason == "length" and e.turns == 2
    assert e.messages == [{"role": "assistant", "content": "x"}] and e.env_reward == {"r": 1.0}


def test_builder_without_candidates_and_without_model_tokens() -> None:
    b = EpisodeBuilder()
    b.add_model(completion([5, 6], [2, 2]))
    e = b.finish("stop")
    assert e.candidate_ids is None and e.candidate_counts is None
    assert e.turns == 1 and e.mask.tolist() == [1, 1]
    # no model token at all: inserted tokens carry the builder's start version
    b = EpisodeBuilder(start_version=7)
    b.add_context([1, 2, 3])
    e = b.finish("length")
    assert e.versions.tolist() == [7, 7, 7] and e.mask.tolist() == [0, 0, 0]
    assert e.turns == 1  # an episode counts at least one turn
    empty = EpisodeBuilder().finish("stop")
    assert len(empty) == 0 and empty.mask.dtype == np.uint8


def test_builder_rejects_bad_input() -> None:
    b = EpisodeBuilder()
    with pytest.raises(ValueError, match="flat list of token ids"):
        b.add_context([[1, 2]])  # type: ignore[list-item]
    b.add_model(completion([5], [0]))
    with pytest.raises(ValueError, match="finish_reason must be 'stop' or 'length'"):
        b.finish("eos")


def test_episode_of_a_completion_is_all_model_tokens() -> None:
    c = completion([4, 5, 1], [1, 1, 2], cands=[[4], [5, 6], [1]], finish="stop")
    e = Episode.of(c)
    assert e.mask.tolist() == [1, 1, 1] and e.finish_reason == "stop" and e.turns == 1
    np.testing.assert_array_equal(e.logprobs, c.logprobs)
    assert e.candidate_counts is not None and e.candidate_counts.tolist() == [1, 2, 1]


segment = st.one_of(
    st.tuples(st.just("model"), st.integers(0, 4), st.booleans(), st.integers(0, 2)),
    st.tuples(st.just("context"), st.integers(0, 4), st.just(False), st.just(0)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(segment, max_size=7), st.integers(0, 5))
def test_builder_invariants_hold_for_any_segment_sequence(
        segs: list[tuple[str, int, bool, int]], start: int) -> None:
    """Property: for any interleaving (empty segments included, model versions rising
    within and across turns), the arrays align, mask is 1 exactly at model tokens,
    inserted tokens have logprob 0, versions are non-decreasing, model tokens keep theirs,
    and candidate counts are the model's where it gave them and 0 elsewhere."""
    b = EpisodeBuilder(start_version=start)
    version, tok = start, 100
    want_mask: list[int] = []
    want_lp: list[float] = []
    want_counts: list[int] = []
    model_versions: list[tuple[int, int]] = []  # (position, version)
    any_cands = False
    for kind, n, with_cands, bump in segs:
        ids = list(range(tok, tok + n))
        tok += n
        if kind == "model":
            vers = []
            for _ in range(n):
                vers.append(version)
                version += bump
            cands = [[t, t + 1000] for t in ids] if with_cands else None
            any_cands |= with_cands
            c = completion(ids, vers, cands=cands)
            b.add_model(c)
            model_versions += list(zip(range(len(want_mask), len(want_mask) + n), vers,
                                       strict=True))
            want_mask += [1] * n
            want_lp += c.logprobs.tolist()
            want_counts += [2 if with_cands else 0] * n
        else:
            b.add_context(ids)
            want_mask += [0] * n
            want_lp += [0.0] * n
            want_counts += [0] * n
    e = b.finish("stop")
    n_total = len(want_mask)
    assert len(e) == len(e.token_ids) == len(e.logprobs) == len(e.versions) == len(e.mask)
    assert len(e) == n_total == len(b)
    assert e.token_ids.tolist() == list(range(100, 100 + n_total))
    assert e.mask.tolist() == want_mask
    np.testing.assert_array_equal(e.logprobs, np.array(want_lp, np.float32))
    assert (np.diff(e.versions) >= 0).all()
    for pos, v in model_versions:
        assert e.versions[pos] == v
    if model_versions:
        first = model_versions[0][1]
        lead = want_mask.index(1)
        assert (e.versions[:lead] == first).all()  # leading context: the first model token's
        for i in range(lead + 1, n_total):  # later context: the model token before it
            if want_mask[i] == 0:
                assert e.versions[i] == e.versions[i - 1]
    else:
        assert (e.versions == start).all()
    if any_cands:
        assert e.candidate_counts is not None and e.candidate_ids is not None
        assert e.candidate_counts.tolist() == want_counts
        assert len(e.candidate_ids) == sum(want_counts)
    else:
        assert e.candidate_counts is None and e.candidate_ids is None


# ---------------------------------------------------------------- check_episodes


def _episode(mask: list[int]) -> Episode:
    n = len(mask)
    return Episode(np.arange(n, dtype=np.int32), np.zeros(n, np.float32),
                   np.zeros(n, np.int32), np.array(mask, np.uint8), "stop")


def test_check_episodes_accepts_n_well_formed_episodes() -> None:
    eps = (_episode([1, 0]), _episode([0, 1, 1]))
    out = check_episodes(eps, 2, "hook")
    assert isinstance(out, list) and out == list(eps)


@pytest.mark.parametrize(("value", "match"), [
    ({"a": 1}, r"hook must return 2 Episodes \(generation.num_generations\), got dict"),
    ([_episode([1])], "hook must return 2 Episodes .*got 1 items"),
    ([_episode([1]), {"token_ids": [1]}], r"hook\[1\] is a dict, not an Episode"),
    ([_episode([1]), Episode(np.zeros(2, np.int32), np.zeros(1, np.float32),
                             np.zeros(2, np.int32), np.ones(2, np.uint8), "stop")],
     r"hook\[1\]: token, logprob, version and mask arrays differ in length"),
    ([_episode([0, 0]), _episode([1])], r"hook\[0\] has no model token"),
    ([_episode([1]), _episode([])], r"hook\[1\] has no model token"),
])
def test_check_episodes_says_what_is_wrong(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_episodes(value, 2, "hook")


# ---------------------------------------------------------------- TurnBatcher


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> TransformersEngine:
    model, tok = load_model(tiny_model_dir)
    return TransformersEngine(model, tok, seed=0)


class Spy:
    """An engine wrapper recording each ``generate`` call's prompts; ``called`` is set
    once the first call has begun."""

    def __init__(self, engine: Any, independent: bool = False) -> None:
        self.engine = engine
        self.batches: list[list[list[int]]] = []
        self.called: asyncio.Event | None = None
        if independent:
            self.independent_prompts = True

    async def generate(self, prompts: list[list[int]], n: int,
                       params: SamplingParams) -> list[list[Completion]]:
        self.batches.append([list(p) for p in prompts])
        if self.called is not None:
            self.called.set()
        return await self.engine.generate(prompts, n, params)


CONTEXTS = [[5, 6, 7], [12], [20, 21, 22, 23, 24, 67, 8, 9, 10, 11, 66], [40, 41]]
GREEDY = SamplingParams(6, greedy=True)


def test_concurrent_requests_make_one_engine_call_equal_to_lone_calls(
        engine: TransformersEngine) -> None:
    spy = Spy(engine)
    b = TurnBatcher(spy)  # type: ignore[arg-type]

    async def main() -> list[Completion]:
        return list(await asyncio.gather(*(b.generate(ids, GREEDY) for ids in CONTEXTS)))

    got = asyncio.run(main())
    assert b.calls == 1 and spy.batches == [CONTEXTS]  # one call, every context, in order
    for ids, c in zip(CONTEXTS, got, strict=True):
        lone = asyncio.run(engine.generate([ids], 1, GREEDY))[0][0]
        assert c.token_ids.tolist() == lone.token_ids.tolist()
        np.testing.assert_allclose(c.logprobs, lone.logprobs, atol=1e-5)
        assert c.finish_reason == lone.finish_reason
        assert c.versions.tolist() == lone.versions.tolist()


def test_batcher_groups_by_params_and_queues_during_a_batch(
        engine: TransformersEngine) -> None:
    """Different sampling parameters never share a call; a request that arrives while a
    batch decodes goes into the next one."""
    spy = Spy(engine)
    b = TurnBatcher(spy)  # type: ignore[arg-type]
    other = SamplingParams(3, greedy=True)

    async def main() -> tuple[list[Completion], Completion]:
        spy.called = asyncio.Event()
        first = [asyncio.ensure_future(b.generate(ids, GREEDY)) for ids in CONTEXTS[:2]]
        odd = asyncio.ensure_future(b.generate(CONTEXTS[2], other))
        await spy.called.wait()  # the first batch is decoding now
        late = await b.generate(CONTEXTS[3], GREEDY)
        return [*await asyncio.gather(*first), late], await odd

    same, odd = asyncio.run(main())
    # queued in order: the first params' batch, then the odd one, then the late request
    assert spy.batches == [CONTEXTS[:2], [CONTEXTS[2]], [CONTEXTS[3]]] and b.calls == 3
    assert len(odd) == 3 and all(len(c) == 6 for c in same)


class Failing:
    async def generate(self, prompts: list[list[int]], n: int,
                       params: SamplingParams) -> list[list[Completion]]:
        await asyncio.sleep(0)
        raise RuntimeError("engine down")


def test_engine_error_reaches_every_waiter() -> None:
    b = TurnBatcher(Failing())  # type: ignore[arg-type]

    async def main() -> list[Any]:
        return list(await asyncio.gather(*(b.generate(ids, GREEDY) for ids in CONTEXTS),
                                         return_exceptions=True))

    out = asyncio.run(main())
    assert b.calls == 1
    assert all(isinstance(e, RuntimeError) and str(e) == "engine down" for e in out)


def test_independent_engine_is_called_per_request(engine: TransformersEngine) -> None:
    spy = Spy(engine, independent=True)
    b = TurnBatcher(spy)  # type: ignore[arg-type]

    async def main() -> list[Completion]:
        return list(await asyncio.gather(*(b.generate(ids, GREEDY) for ids in CONTEXTS[:3])))

    asyncio.run(main())
    assert b.direct and b.calls == 3 and spy.batches == [[ids] for ids in CONTEXTS[:3]]


# ---------------------------------------------------------------- RolloutContext


def _ctx(engine: Any, params: SamplingParams, tok: Any = None) -> RolloutContext:
    return RolloutContext({"text": "x"}, CONTEXTS[0], 2, params, tok, TurnBatcher(engine))


def test_generate_below_the_cap_is_cut_and_ends_length(engine: TransformersEngine) -> None:
    ctx = _ctx(engine, GREEDY)
    full = asyncio.run(ctx.generate(CONTEXTS[2]))
    assert len(full) == 6 and full.finish_reason == "length"  # the cap: nothing cut
    cut = asyncio.run(ctx.generate(CONTEXTS[2], max_new_tokens=2))
    assert len(cut) == 2 and cut.finish_reason == "length"
    assert cut.token_ids.tolist() == full.token_ids[:2].tolist()
    np.testing.assert_allclose(cut.logprobs, full.logprobs[:2], atol=1e-5)
    assert cut.versions.tolist() == full.versions[:2].tolist()
    above = asyncio.run(ctx.generate(CONTEXTS[2], max_new_tokens=50))
    assert above.token_ids.tolist() == full.token_ids.tolist()
    zero = asyncio.run(ctx.generate(CONTEXTS[2], max_new_tokens=0))
    assert len(zero) == 0 and zero.finish_reason == "length"


def test_cut_keeps_the_candidate_sets_of_the_kept_tokens(engine: TransformersEngine) -> None:
    params = SamplingParams(6, top_k=5)
    ctx = _ctx(engine, params)
    c = asyncio.run(ctx.generate(CONTEXTS[1], max_new_tokens=3))
    assert len(c) == 3 and c.finish_reason == "length"
    assert c.candidate_counts is not None and c.candidate_ids is not None
    assert c.candidate_counts.tolist() == [5, 5, 5]
    assert len(c.candidate_ids) == 15
    for i, t in enumerate(c.token_ids.tolist()):  # each token is in its own set
        assert t in c.candidate_ids[5 * i:5 * i + 5].tolist()


def test_concurrent_cut_requests_still_share_one_batch(engine: TransformersEngine) -> None:
    """Requests for fewer tokens are sampled at the cap, so they batch with the rest."""
    spy = Spy(engine)
    ctx = _ctx(spy, GREEDY)

    async def main() -> list[Completion]:
        return list(await asyncio.gather(*(ctx.generate(ids, max_new_tokens=k + 1)
                                           for k, ids in enumerate(CONTEXTS))))

    out = asyncio.run(main())
    assert len(spy.batches) == 1 and [len(c) for c in out] == [1, 2, 3, 4]
