"""The sampler's top logprobs, from the engine through the wire to the trainer's loss
(score centering, `pipeline.rl.centering`): on the in-process engine, with and without
top-k truncation, the trainer's logprobs at the sampler's top ids equal the sampler's
(so centering is a no-op on-policy), and the codec refuses malformed entries."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from pipeline.bus.codec import DecodeError, decode, encode
from pipeline.bus.schema import Limits, RolloutGroup, ScoredGroup
from pipeline.config import load_config
from pipeline.config.root import score_centering_on
from pipeline.model import init_tiny_model, load_model
from pipeline.rl.losses import LossConfig, grpo_loss
from trainer.batch import build_batch
from trainer.packing import make_layout
from trainer.step import StepSettings, lean_logps, optimize
from workers.engines import SamplingParams
from workers.engines.transformers import TransformersEngine
from workers.episodes import Episode

torch.set_num_threads(1)
PROMPTS = [[5, 6, 7, 8], [12, 13, 14, 15]]
K = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("top") / "m", seed=0)


def _scored(i: int, prompt: list[int], rollouts: list) -> ScoredGroup:  # type: ignore[type-arg]
    g = RolloutGroup(f"0:{i}", i, 0, {"text": "x"}, np.array(prompt, np.int32), "g", 0.0, 0.0,
                     rollouts)
    n = len(rollouts)
    return ScoredGroup(g.for_training(), np.zeros(n, np.float32), {},
                       np.linspace(-1, 1, n, dtype=np.float32), "s", 0.0)


def _sample(model_dir: Path, top_k: int) -> tuple[torch.nn.Module, list[ScoredGroup]]:
    model, tok = load_model(model_dir)
    engine = TransformersEngine(model, tok, seed=5)
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=top_k, top_logprobs=K)
    groups = asyncio.run(engine.generate(PROMPTS, 4, params))
    for c in (c for g in groups for c in g):
        assert c.top_ids is not None and c.top_logprobs is not None
        assert c.top_ids.shape == c.top_logprobs.shape == (len(c), K)
        lps = np.where(c.top_ids >= 0, c.top_logprobs, -np.inf)
        assert (np.diff(lps, axis=1) <= 0).all()  # most likely first
        for t, tid in enumerate(c.token_ids):  # the sampled token, when in the top, agrees
            hit = np.nonzero(c.top_ids[t] == tid)[0]
            if len(hit):
                assert c.top_logprobs[t, hit[0]] == pytest.approx(c.logprobs[t], abs=1e-6)
        if top_k:  # outside a top-k of 3 there is nothing: the 4th entry is none
            assert (c.top_ids[:, 3] == -1).all() and (c.top_ids[:, :3] >= 0).all()
    sgs = [_scored(i, p, [Episode.of(c).to_rollout(tok) for c in g])
           for i, (p, g) in enumerate(zip(PROMPTS, groups, strict=True))]
    return model, [decode(encode(sg), Limits(vocab_size=76)) for sg in sgs]  # type: ignore[misc]


@pytest.mark.parametrize("top_k", [0, 3])
def test_on_policy_the_trainer_sees_the_samplers_top_logprobs(model_dir: Path,
                                                              top_k: int) -> None:
    model, sgs = _sample(model_dir, top_k)
    batch = build_batch(sgs, pad_id=0)
    assert batch.sampler_top_ids is not None and batch.sampler_top_logps is not None
    st = StepSettings(loss=LossConfig(score_centering=True), temperature=0.8, chunk_tokens=5)
    with torch.no_grad():
        logps, _, top = lean_logps(model, batch, st)
    assert top is not None
    valid = (batch.sampler_top_ids >= 0) & (batch.mask > 0).unsqueeze(-1)
    # float16 on the wire: 1e-3 relative at most
    gap = (top - batch.sampler_top_logps).abs()[valid]
    assert float(gap.max()) < 2e-3, float(gap.max())
    torch.testing.assert_close(logps[batch.mask > 0], batch.behaviour_logps[batch.mask > 0],
                               atol=1e-4, rtol=0)
    # on-policy centering adds (almost) nothing: the loss and its gradient are unchanged
    grads = []
    for centre in (False, True):
        lp, _, tp = lean_logps(model, batch, st)
        lp.retain_grad()
        loss, metrics = grpo_loss(lp, None, batch.behaviour_logps, batch.advantages,
                                  batch.mask, LossConfig(score_centering=centre),
                                  policy_top_logps=tp, sampler_top_logps=batch.sampler_top_logps)
        loss.backward()
        assert lp.grad is not None
        grads.append(lp.grad.clone())
        if centre:
            assert metrics["sampling/centered_frac"] == 1.0
            assert 0.0 < metrics["sampling/sampler_mass"] <= 1.0 + 1e-6
            if top_k:  # a top-4 of a top-3 distribution covers all of it
                assert metrics["sampling/sampler_mass"] == pytest.approx(1.0, abs=2e-3)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-3, rtol=0)


def test_off_policy_centering_changes_the_step_and_it_still_trains(model_dir: Path) -> None:
    """Sampled by the initial weights, trained by weights moved away: the centring term
    is non-zero, and a full optimizer step with it is finite."""
    model, sgs = _sample(model_dir, 0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = build_batch(sgs, pad_id=0)
    st = StepSettings(loss=LossConfig(score_centering=True, is_clip_max=1.05), temperature=0.8)
    lp, _, tp = lean_logps(model, batch, st)
    args = (lp, None, batch.behaviour_logps, batch.advantages, batch.mask)
    on, _ = grpo_loss(*args, LossConfig(is_clip_max=1.05))
    centred, m = grpo_loss(*args, LossConfig(score_centering=True, is_clip_max=1.05),
                           policy_top_logps=tp, sampler_top_logps=batch.sampler_top_logps)
    assert abs(float(centred.detach()) - float(on.detach())) > 1e-4
    assert m["sampling/masked_mean"] > 0  # the tight bound bites
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = optimize(model, opt, batch, st)
    assert out["skipped"] == 0 and np.isfinite(out["loss"])
    assert "sampling/sampler_mass" in out


def test_layout_changes_nothing(model_dir: Path) -> None:
    """The packed layout gathers the same top logprobs as the padded one."""
    model, sgs = _sample(model_dir, 0)
    batch = build_batch(sgs, pad_id=0)
    st = StepSettings(loss=LossConfig(), temperature=0.8)
    with torch.no_grad():
        a = lean_logps(model, batch, st)[2]
        b = lean_logps(model, batch, StepSettings(loss=LossConfig(), temperature=0.8,
                                                  layout="packed"))[2]
    assert a is not None and b is not None
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert make_layout(batch, "packed", 0) is not None


def test_greedy_reports_no_top_logprobs(model_dir: Path) -> None:
    model, tok = load_model(model_dir)
    engine = TransformersEngine(model, tok)
    out = asyncio.run(engine.generate(PROMPTS, 1, SamplingParams(4, greedy=True,
                                                                  top_logprobs=K)))
    assert all(c.top_ids is None for g in out for c in g)


@pytest.mark.parametrize(("change", "match"), [
    ({"topk": 0}, "outside"),
    ({"top": np.zeros(5, np.int32).tobytes()}, "for 6 tokens x 4"),
    ({"top": np.full(24, -2, np.int32).tobytes()}, "token id outside"),
    ({"toplp": np.full(24, 0.5, np.float16).tobytes()}, "above 0"),
    ({"toplp": None}, "together"),
])
def test_codec_refuses_malformed_top_logprobs(model_dir: Path, change: dict,  # type: ignore[type-arg]
                                              match: str) -> None:
    _, sgs = _sample(model_dir, 0)
    body = msgpack.unpackb(encode(sgs[0]), raw=False)
    ro = body["ro"][0]
    n = len(np.frombuffer(ro["ids"], np.int32))
    if n != 6:
        pytest.skip("a completion ended early; the lengths below assume 6 tokens")
    for k, v in change.items():
        if v is None:
            del ro[k]
        else:
            ro[k] = v
    with pytest.raises(DecodeError, match=match):
        decode(msgpack.packb(body, use_bin_type=True), Limits(vocab_size=76))


def test_config_names_the_key_centering_needs(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[trainer]\nscore_centering = true\n")
    with pytest.raises(ValueError, match=r"generation\.num_sampler_logprobs"):
        load_config(cfg)
    with pytest.raises(ValueError, match="score_centering needs token-level"):
        load_config(cfg, ["generation.num_sampler_logprobs=8", "trainer.is_mode=sequence_mask"])
    ok = load_config(cfg, ["generation.num_sampler_logprobs=8"])
    assert ok.trainer.score_centering and ok.generation.num_sampler_logprobs == 8


def test_centering_is_on_by_default_where_the_sampler_reports_top_logprobs() -> None:
    assert not score_centering_on(load_config(None))               # no top logprobs
    assert score_centering_on(load_config(None, ["generation.num_sampler_logprobs=8"]))
    assert not score_centering_on(load_config(     # a sequence-level loss: off, no error
        None, ["generation.num_sampler_logprobs=8", "trainer.is_mode=sequence_mask"]))
    assert not score_centering_on(load_config(
        None, ["generation.num_sampler_logprobs=8", "trainer.score_centering=false"]))


@pytest.mark.parametrize(("sets", "ok"), [
    (["generation.top_k=20"], False),
    (["generation.top_p=0.9"], False),
    (["generation.top_k=20", "generation.num_sampler_logprobs=8"], False),
    (["generation.top_k=8", "generation.num_sampler_logprobs=8"], True),
    (["generation.top_p=0.9", "generation.vllm.accept_biased_truncation=true"], True),
])
def test_truncation_on_vllm_needs_candidate_sets_or_a_named_opt_out(sets: list[str],
                                                                    ok: bool) -> None:
    base = ["generation.engine=vllm", "generation.vllm.launch=1", *sets]
    if ok:
        load_config(None, base)
    else:
        with pytest.raises(ValueError, match="accept_biased_truncation"):
            load_config(None, base)
    load_config(None, sets)  # the in-process engine records its sets itself
