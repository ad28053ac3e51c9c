"""TransformersEngine: logprobs, sampling filters, greedy parity, mid-generation swaps, eos."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.model import init_tiny_model, load_model, model_state_for_publish
from tests.helpers import check_pause_keep_swap
from workers.engines import Completion, Engine, SamplingParams
from workers.engines.transformers import TransformersEngine, process_logits

torch.set_num_threads(1)

EOS = 1
# Different lengths in one batch exercise left padding and explicit position ids.
PROMPTS = [[5, 6, 7], [12], [20, 21, 22, 23, 24, 67, 8, 9, 10, 11, 66]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return init_tiny_model(root / "a", seed=0), init_tiny_model(root / "b", seed=1)


def _engine(path: Path, seed: int = 0) -> TransformersEngine:
    model, tok = load_model(path)
    return TransformersEngine(model, tok, seed=seed)


@torch.no_grad()
def _full_logits(model: torch.nn.Module, prompt: list[int], comp: Completion) -> torch.Tensor:
    """Logits [T, V] predicting each completion token, from one unpadded forward."""
    ids = torch.tensor([prompt + comp.token_ids.tolist()])
    logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(comp)]


def _check_shape(c: Completion, max_new: int) -> None:
    assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
    assert c.versions.dtype == np.int32
    assert len(c.token_ids) == len(c.logprobs) == len(c.versions) >= 1
    toks = c.token_ids.tolist()
    if c.finish_reason == "stop":
        assert toks[-1] == EOS and EOS not in toks[:-1]
    else:
        assert c.finish_reason == "length"
        assert len(toks) == max_new and EOS not in toks


def test_engine_satisfies_protocol(dirs: tuple[Path, Path]) -> None:
    assert isinstance(_engine(dirs[0]), Engine)


def test_process_logits_filters_and_renormalises() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 76, generator=g) * 3
    lp = process_logits(logits, SamplingParams(8, greedy=True))
    assert torch.allclose(lp, torch.log_softmax(logits, -1))

    lp = process_logits(logits, SamplingParams(8, temperature=0.5, top_k=5))
    assert (lp.isfinite().sum(-1) == 5).all()
    assert torch.allclose(lp.exp().sum(-1), torch.ones(4))
    kept = lp.isfinite()
    assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, logits.topk(5).indices, True))

    top_p = 0.8
    lp = process_logits(logits, SamplingParams(8, temperature=0.5, top_p=top_p))
    assert torch.allclose(lp.exp().sum(-1), torch.ones(4))
    probs = torch.softmax(logits / 0.5, -1)
    for row in range(4):
        keep = lp[row].isfinite()
        mass = probs[row][keep].sum()
        smallest = probs[row][keep].min()
        assert mass >= top_p and mass - smallest < top_p  # minimal nucleus
        assert probs[row][~keep].max() <= smallest  # the nucleus is a top set
        # Renormalised: kept logprobs are the tempered ones shifted by log(mass).
        assert torch.allclose(lp[row][keep], probs[row][keep].log() - mass.log(), atol=1e-5)


def test_logprobs_match_full_forward_with_left_padding(dirs: tuple[Path, Path]) -> None:
    eng = _engine(dirs[0])
    max_new = 24
    out = asyncio.run(eng.generate(PROMPTS, 3, SamplingParams(max_new)))
    assert [len(g) for g in out] == [3, 3, 3]
    ref, _ = load_model(dirs[0])
    for prompt, group in zip(PROMPTS, out, strict=True):
        for c in group:
            _check_shape(c, max_new)
            assert (c.versions == 0).all()
            lp = torch.log_softmax(_full_logits(ref, prompt, c), -1)
            want = lp.gather(-1, torch.from_numpy(c.token_ids).long()[:, None]).squeeze(-1)
            np.testing.assert_allclose(c.logprobs, want.numpy(), atol=1e-4)


def test_processed_logprobs_and_top_k_membership(dirs: tuple[Path, Path]) -> None:
    eng = _engine(dirs[0], seed=3)
    params = SamplingParams(20, temperature=0.7, top_k=5, top_p=0.9)
    out = asyncio.run(eng.generate(PROMPTS, 2, params))
    ref, _ = load_model(dirs[0])
    for prompt, group in zip(PROMPTS, out, strict=True):
        for c in group:
            _check_shape(c, params.max_new_tokens)
            logits = _full_logits(ref, prompt, c)
            toks = torch.from_numpy(c.token_ids).long()
            want = process_logits(logits, params).gather(-1, toks[:, None]).squeeze(-1)
            np.testing.assert_allclose(c.logprobs, want.numpy(), atol=1e-4)
            top5 = logits.topk(5, dim=-1).indices
            assert (top5 == toks[:, None]).any(-1).all()
            assert (c.logprobs > -np.inf).all()


def test_rows_differ_and_seed_reproduces(dirs: tuple[Path, Path]) -> None:
    params = SamplingParams(12)
    a = asyncio.run(_engine(dirs[0], seed=5).generate([[5, 6]], 4, params))[0]
    b = asyncio.run(_engine(dirs[0], seed=5).generate([[5, 6]], 4, params))[0]
    seqs = [c.token_ids.tolist() for c in a]
    assert len({tuple(s) for s in seqs}) > 1  # the n rows are independent samples
    assert seqs == [c.token_ids.tolist() for c in b]


def test_greedy_matches_hf_generate(dirs: tuple[Path, Path]) -> None:
    eng = _engine(dirs[0])
    max_new = 16
    got = asyncio.run(eng.greedy(PROMPTS, max_new))
    ref, _ = load_model(dirs[0])
    for prompt, c in zip(PROMPTS, got, strict=True):
        _check_shape(c, max_new)
        with torch.no_grad():
            gen = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new)[
                0, len(prompt) :
            ]
        assert c.token_ids.tolist() == gen.tolist()
        lp = torch.log_softmax(_full_logits(ref, prompt, c), -1).max(-1).values
        np.testing.assert_allclose(c.logprobs, lp.numpy(), atol=1e-4)


def test_swap_mid_generation_keeps_cache_and_tags_versions(dirs: tuple[Path, Path]) -> None:
    eng = _engine(dirs[0], seed=1)
    new_model, _ = load_model(dirs[1])
    old_model, _ = load_model(dirs[0])
    sd_new = model_state_for_publish(new_model)
    max_new = 16
    swap_after = 4  # decode-step boundaries to wait before publishing

    async def watcher() -> None:
        for _ in range(swap_after):
            await asyncio.sleep(0)
        eng.update_weights(sd_new, 1)

    async def main() -> list[list[Completion]]:
        res, _ = await asyncio.gather(eng.generate(PROMPTS, 2, SamplingParams(max_new)), watcher())
        return res

    out = asyncio.run(main())
    assert eng.version == 1
    assert all(torch.equal(v, sd_new[k]) for k, v in eng.model.state_dict().items())

    for group in out:
        for c in group:
            _check_shape(c, max_new)
    # pause-keep: the cache keeps what the OLD weights computed; the NEW model continues
    check_pause_keep_swap(PROMPTS, out, old_model.config,
                          lambda x, cache: old_model(x, cache=cache).logits,
                          lambda x, cache: new_model(x, cache=cache).logits)


def test_swap_when_idle_applies_now_and_stale_versions_are_ignored(
    dirs: tuple[Path, Path],
) -> None:
    eng = _engine(dirs[0])
    new_model, _ = load_model(dirs[1])
    old_sd = model_state_for_publish(eng.model)
    eng.update_weights(model_state_for_publish(new_model), 3)
    assert eng.version == 3
    eng.update_weights(old_sd, 3)  # not newer: ignored
    eng.update_weights(old_sd, 2)
    assert eng.version == 3

    max_new = 12
    got = asyncio.run(eng.greedy(PROMPTS[:2], max_new))
    for prompt, c in zip(PROMPTS[:2], got, strict=True):
        assert (c.versions == 3).all()
        with torch.no_grad():
            gen = new_model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new
            )[0, len(prompt) :]
        assert c.token_ids.tolist() == gen.tolist()


def test_newest_queued_swap_wins(dirs: tuple[Path, Path]) -> None:
    eng = _engine(dirs[0])
    sd = model_state_for_publish(load_model(dirs[1])[0])

    async def watcher() -> None:
        await asyncio.sleep(0)
        eng.update_weights(sd, 2)
        eng.update_weights(sd, 1)  # older than the queued one: dropped

    async def main() -> list[Completion]:
        res, _ = await asyncio.gather(eng.greedy([[5, 6, 7]], 8), watcher())
        return res

    (c,) = asyncio.run(main())
    assert set(c.versions.tolist()) == {0, 2} and c.versions[0] == 0
    assert eng.version == 2


def test_eos_stops_rows_independently(dirs: tuple[Path, Path]) -> None:
    model, tok = load_model(dirs[0])
    with torch.no_grad():
        # Zero final-norm gain -> every logit is 0 -> uniform over 76 tokens, so each row stops
        # at step t w.p. 1/76: with 24 rows x 40 steps both outcomes occur for any seed.
        model.model.norm.weight.zero_()
    eng = TransformersEngine(model, tok.eos_token_id, seed=2)
    max_new = 40
    out = asyncio.run(eng.generate(PROMPTS, 8, SamplingParams(max_new)))
    comps = [c for g in out for c in g]
    for c in comps:
        _check_shape(c, max_new)
    reasons = {c.finish_reason for c in comps}
    assert reasons == {"stop", "length"}
    stop_lens = {len(c) for c in comps if c.finish_reason == "stop"}
    assert len(stop_lens) > 1
    for c in comps:
        np.testing.assert_allclose(c.logprobs, -np.log(76.0), atol=1e-5)


def test_degenerate_inputs(dirs: tuple[Path, Path]) -> None:
    eng = _engine(dirs[0])
    out = asyncio.run(eng.generate([[5], [6, 7]], 2, SamplingParams(0)))
    assert [[len(c) for c in g] for g in out] == [[0, 0], [0, 0]]
    assert asyncio.run(eng.generate([], 2, SamplingParams(4))) == []
    with pytest.raises(ValueError):
        asyncio.run(eng.generate([[]], 1, SamplingParams(4)))
    with pytest.raises(ValueError):
        SamplingParams(4, temperature=0.0)


def _trained(path: Path, seed: int) -> torch.nn.Module:
    """The model at ``path`` after a (random) update of every parameter; tied
    embeddings stay tied (the update is in place)."""
    model, _ = load_model(path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("alias", ["copied", "dropped"])
def test_tied_embeddings_reload_refreshes_lm_head(tmp_path: Path, alias: str) -> None:
    """A tied model (``lm_head.weight`` is the input embedding, as in Qwen2.5-0.5B)
    loads published weights whether the checkpoint copies the alias (what the `file`
    transport publishes) or drops it (what ``save_pretrained`` writes): the engine's
    lm_head stays tied and is the new embedding, so greedy tokens and logprobs equal the
    trained model's."""
    from pipeline.weights import FileTransport

    base = init_tiny_model(tmp_path / "tied", seed=0, tie_word_embeddings=True)
    trained = _trained(base, seed=1)
    if alias == "copied":
        t = FileTransport(tmp_path / "w", max_shard_bytes=64 * 1024)
        path = asyncio.run(t.receive(asyncio.run(t.publish(trained, version=1, step=1))))
    else:
        path = tmp_path / "hf"
        trained.save_pretrained(path)
    eng = _engine(base)
    before = asyncio.run(eng.greedy(PROMPTS, 12))
    assert asyncio.run(eng.load_weights(path, 1))
    model = eng.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert torch.equal(model.lm_head.weight, trained.model.embed_tokens.weight)
    want = asyncio.run(TransformersEngine(trained, EOS).greedy(PROMPTS, 12))
    got = asyncio.run(eng.greedy(PROMPTS, 12))
    assert [c.token_ids.tolist() for c in got] == [c.token_ids.tolist() for c in want]
    assert [c.token_ids.tolist() for c in got] != [c.token_ids.tolist() for c in before]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-6)
        assert (g.versions == 1).all()


def test_full_weights_are_read_off_the_event_loop(dirs: tuple[Path, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow read (0.3 s, blocking) of a big checkpoint does not stall decoding."""
    import workers.engines.transformers as tf

    read = tf.read_weights
    monkeypatch.setattr(tf, "read_weights", lambda *a: (time.sleep(0.3), read(*a))[1])
    eng = _engine(dirs[0])

    async def go() -> tuple[int, list[list[Completion]]]:
        load = asyncio.create_task(eng.load_weights(dirs[1], 1))
        await asyncio.sleep(0)
        done = 0
        while not load.done():
            await eng.generate([[5, 6, 7]], 1, SamplingParams(max_new_tokens=2, greedy=True))
            done += 1
        assert await load
        return done, await eng.generate(PROMPTS, 1, SamplingParams(4, greedy=True))

    decoded_during_load, out = asyncio.run(go())
    assert decoded_during_load >= 3 and eng.version == 1
    assert all((g[0].versions == 1).all() for g in out)
