"""The trainer honours the loss mask of multi-turn rollouts (mask 0 = inserted context).

- grpo_loss on a 2-row batch whose first row is [model, model, env, env, model], against
  the loss written out by hand with plain floats, for every loss_type, with the KL term,
  the truncated IS weight and GSPO's sequence ratio; its gradient against the hand
  formula's finite differences; junk (NaN, inf) at mask-0 positions changes nothing;
- compute_loss with the tiny model: entropy and logprobs over mask-1 tokens only; junk
  behaviour logprobs / advantages / reference logprobs at env tokens change nothing;
- an episode trains exactly like its model turns as single-turn rows whose prompts are
  the conversation so far (token-normalised losses), in every layout;
- per-token advantages: a row's scalar repeated is exactly the [B] loss (every loss_type,
  GSPO, cispo); build_batch places them; gradient_rows reads them at mask-1 tokens only.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.bus.schema import Rollout, RolloutGroup, ScoredGroup
from pipeline.model import init_tiny_model, load_model
from pipeline.rl.logprobs import entropy_from_logits
from pipeline.rl.losses import LossConfig, LossNorm, grpo_loss
from trainer.batch import Batch, build_batch, completion_logits
from trainer.step import (
    StepSettings,
    compute_loss,
    gradient_rows,
    lean_logps,
    step_norm,
    token_logps,
)
from workers.engines.base import Completion
from workers.episodes import Episode, EpisodeBuilder

torch.set_num_threads(1)

NAN, INF = math.nan, math.inf
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
EPS, EPS_HIGH, IS_MAX, L_MAX = 0.2, 0.28, 3.0, 6

# Row 0: [model, model, env, env, model]; row 1: three model tokens, then padding.
MASK = [[1, 1, 0, 0, 1], [1, 1, 1, 0, 0]]
# ratios exp(lp - old): row 0 1.49 (clipped, A > 0), 0.74 (below 1 - eps; kept, A > 0),
# 1.11; row 1 0.74 (clipped, A < 0), 1.22, 1.05. IS weights exp(old - beh): row 0 1,
# 3.67 (truncated to 3), NaN behaviour (weight 1); row 1 1.65, 1, 0.61.
LP = [[-1.0, -0.5, NAN, NAN, -2.0], [-0.3, -1.2, -0.8, NAN, NAN]]
OLD = [[-1.4, -0.2, INF, INF, -2.1], [0.0, -1.4, -0.85, -INF, INF]]
BEH = [[-1.4, -1.5, -INF, INF, NAN], [-0.5, -1.4, -0.35, NAN, -INF]]
REF = [[-1.1, -0.6, NAN, INF, -1.5], [-0.2, -1.0, -1.0, NAN, -INF]]
ADV = [0.5, -1.0]


def is_diff(b: int, t: int) -> float:
    d = OLD[b][t] - BEH[b][t]
    return 0.0 if math.isnan(d) else d  # unknown behaviour logprob: no correction


def hand_loss(lp: list[list[float]], adv: list[list[float]], *, loss_type: str,
              level: str = "token", beta: float = 0.0, is_level: str = "token") -> float:
    """The GRPO-family loss written out per token with plain floats (module docstring of
    pipeline.rl.losses), reading only mask-1 positions. ``adv`` is per token; ``is_level``
    "sequence" is the ``sequence_truncate`` IS weight (one per row)."""
    rows = []
    for b, m in enumerate(MASK):
        idx = [t for t, x in enumerate(m) if x]
        row_w = min(math.exp(sum(is_diff(b, t) for t in idx)), IS_MAX)
        if level == "sequence":  # GSPO: one ratio, exp(mean log ratio over the row)
            s = sum(lp[b][t] - OLD[b][t] for t in idx) / len(idx)
            ratio = {t: math.exp(s) for t in idx}
        else:
            ratio = {t: math.exp(lp[b][t] - OLD[b][t]) for t in idx}
        per = []
        for t in idx:
            a, r = adv[b][t], ratio[t]
            clipped = min(max(r, 1 - EPS), 1 + EPS_HIGH)
            pg = -min(r * a, clipped * a)
            w = row_w if is_level == "sequence" else min(math.exp(is_diff(b, t)), IS_MAX)
            delta = REF[b][t] - lp[b][t]
            kl = math.exp(delta) - delta - 1
            per.append(pg * w + beta * kl * r)  # kl_bias_correction: KL times the ratio
        rows.append(per)
    n = sum(len(p) for p in rows)
    if loss_type == "grpo":
        return sum(sum(p) / len(p) for p in rows) / len(rows)
    if loss_type == "dr_grpo":
        return sum(map(sum, rows)) / (len(rows) * L_MAX)
    return sum(map(sum, rows)) / n  # bnpo, dapo


def per_token(adv: list[float]) -> list[list[float]]:
    return [[a] * len(MASK[0]) for a in adv]


def f64(x: list[list[float]]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def cfg(loss_type: str, level: str = "token", beta: float = 0.0,
        is_mode: str = "token_truncate", **kw: Any) -> LossConfig:
    return LossConfig(loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH,  # type: ignore[arg-type]
                      is_mode=is_mode, is_clip_max=IS_MAX, beta=beta,  # type: ignore[arg-type]
                      max_completion_length=L_MAX, importance_sampling_level=level,  # type: ignore[arg-type]
                      **kw)


def run_loss(c: LossConfig, lp: list[list[float]] = LP, adv: Any = ADV,
             old: list[list[float]] = OLD, beh: list[list[float]] = BEH,
             ref: list[list[float]] = REF) -> tuple[float, torch.Tensor, dict[str, float]]:
    logps = f64(lp).requires_grad_(True)
    a = torch.tensor(adv, dtype=torch.float64)
    loss, metrics = grpo_loss(logps, f64(old), f64(beh), a, torch.tensor(MASK), c,
                              ref_logps=f64(ref) if c.beta > 0 else None)
    loss.backward()
    assert logps.grad is not None
    return float(loss.detach()), logps.grad, metrics


CASES = [(lt, level, beta) for lt in LOSS_TYPES for level in ("token", "sequence")
         for beta in (0.0, 0.1)]


@pytest.mark.parametrize(("loss_type", "level", "beta"), CASES)
def test_loss_and_gradient_against_the_hand_computation(loss_type: str, level: str,
                                                        beta: float) -> None:
    loss, grad, _ = run_loss(cfg(loss_type, level, beta))
    want = hand_loss(LP, per_token(ADV), loss_type=loss_type, level=level, beta=beta)
    assert math.isfinite(loss) and loss == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert not torch.isnan(grad).any()
    h = 1e-6
    for b, m in enumerate(MASK):
        for t, x in enumerate(m):
            if not x:
                assert grad[b, t] == 0.0  # exactly: a mask-0 position takes no gradient
                continue
            up = [row[:] for row in LP]
            down = [row[:] for row in LP]
            up[b][t] += h
            down[b][t] -= h
            fd = (hand_loss(up, per_token(ADV), loss_type=loss_type, level=level, beta=beta)
                  - hand_loss(down, per_token(ADV), loss_type=loss_type, level=level,
                              beta=beta)) / (2 * h)
            assert float(grad[b, t]) == pytest.approx(fd, abs=1e-7), (b, t)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_sequence_level_is_weight_against_the_hand_computation(loss_type: str) -> None:
    """``sequence_truncate``: one weight per row from its mask-1 tokens (row 0: exp(1.3),
    row 1: exp(0) = 1), so environment tokens never enter a row's weight."""
    loss, _, _ = run_loss(cfg(loss_type, beta=0.1, is_mode="sequence_truncate"))
    want = hand_loss(LP, per_token(ADV), loss_type=loss_type, beta=0.1, is_level="sequence")
    assert loss == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert want != pytest.approx(hand_loss(LP, per_token(ADV), loss_type=loss_type, beta=0.1))


def test_clipped_tokens_have_no_gradient_and_the_others_do() -> None:
    """The hand example is not degenerate: token-level dapo without KL has zero gradient
    exactly at the two clipped tokens and non-zero ones at the other model tokens."""
    _, grad, _ = run_loss(cfg("dapo"))
    assert grad[0, 0] == 0.0 and grad[1, 0] == 0.0
    assert all(grad[b, t] != 0.0 for b, t in ((0, 1), (0, 4), (1, 1), (1, 2)))


def test_metrics_are_over_mask_1_tokens() -> None:
    _, _, m = run_loss(cfg("dapo", beta=0.1))
    raw = [1.0, math.exp(1.3), math.exp(0.5), 1.0, math.exp(-0.5)]  # NaN behaviour left out
    assert m["is_ratio/min"] == pytest.approx(min(raw))
    assert m["is_ratio/max"] == pytest.approx(max(raw))
    assert m["is_ratio/mean"] == pytest.approx(sum(raw) / 5)
    assert m["logprob_diff/mean_abs"] == pytest.approx((0 + 1.3 + 0 + 0.5 + 0 + 0.5) / 6)
    kls = [math.exp(REF[b][t] - LP[b][t]) - (REF[b][t] - LP[b][t]) - 1
           for b, row in enumerate(MASK) for t, x in enumerate(row) if x]
    assert m["kl"] == pytest.approx(sum(kls) / 6)
    assert m["clip_ratio/low_mean"] == pytest.approx(1 / 6)  # row 1 token 0
    assert m["clip_ratio/high_mean"] == pytest.approx(1 / 6)  # row 0 token 0
    assert m["clip_ratio/region_mean"] == pytest.approx(2 / 6)


@pytest.mark.parametrize(("loss_type", "level", "beta"), CASES)
def test_values_at_mask_0_positions_change_nothing(loss_type: str, level: str,
                                                   beta: float) -> None:
    """The junk (NaN, ±inf) of the example against zeros at every mask-0 position: the
    same loss, gradient and metrics, bit for bit."""
    def zeroed(x: list[list[float]]) -> list[list[float]]:
        return [[v if m else 0.0 for v, m in zip(row, mrow, strict=True)]
                for row, mrow in zip(x, MASK, strict=True)]

    c = cfg(loss_type, level, beta)
    junk = run_loss(c)
    clean = run_loss(c, zeroed(LP), ADV, zeroed(OLD), zeroed(BEH), zeroed(REF))
    assert junk[0] == clean[0]
    assert torch.equal(junk[1], clean[1])
    assert junk[2] == clean[2]


# ---------------------------------------------------------------- per-token advantages


PER_TOKEN_CASES = [
    *((lt, "token") for lt in (*LOSS_TYPES, "cispo")),
    *((lt, "sequence") for lt in (*LOSS_TYPES, "cispo")),
]


@pytest.mark.parametrize(("loss_type", "level"), PER_TOKEN_CASES)
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_repeated_per_token_advantages_are_the_row_advantage(loss_type: str, level: str,
                                                             beta: float) -> None:
    """[B, T] advantages equal to each row's scalar (junk at mask-0 positions) give the
    [B] loss, gradient and metrics exactly."""
    if loss_type == "cispo":  # its epsilon_high is the ratio cap, > 1
        c = LossConfig(loss_type="cispo", epsilon=EPS, epsilon_high=1.3, is_clip_max=IS_MAX,
                       beta=beta, importance_sampling_level=level)  # type: ignore[arg-type]
    else:
        c = cfg(loss_type, level, beta)
    tok_adv = [[a if m else junk for m, junk in zip(mrow, (NAN, INF, -INF, NAN, INF),
                                                   strict=True)]
               for a, mrow in zip(ADV, MASK, strict=True)]
    row = run_loss(c, adv=ADV)
    tok = run_loss(c, adv=tok_adv)
    assert math.isfinite(row[0]) and row[0] == tok[0]
    assert torch.equal(row[1], tok[1])
    assert row[2] == tok[2]


def test_per_token_advantages_weigh_each_token() -> None:
    """Different advantages per token: the hand formula with those advantages."""
    adv = [[0.5, -2.0, NAN, INF, 1.5], [-1.0, 0.25, 0.0, -INF, NAN]]
    for lt in LOSS_TYPES:
        loss, _, _ = run_loss(cfg(lt, beta=0.1), adv=adv)
        assert loss == pytest.approx(hand_loss(LP, adv, loss_type=lt, beta=0.1), rel=1e-12)


# ---------------------------------------------------------------- batches from episodes


def scored(rollouts: list[Rollout], prompt: list[int], advantages: list[float],
           token_advantages: list[np.ndarray] | None = None, gid: str = "0:0") -> ScoredGroup:
    g = RolloutGroup(gid, 0, 0, {"text": "x"}, np.array(prompt, np.int32), "test",
                     time.time(), time.time(), rollouts)
    n = len(rollouts)
    return ScoredGroup(g.for_training(), np.zeros(n, np.float32), {},
                       np.array(advantages, np.float32), "test", time.time(),
                       token_advantages)


def rollout(ids: list[int], mask: list[int], lps: list[float]) -> Rollout:
    n = len(ids)
    return Rollout(np.array(ids, np.int32), np.array(lps, np.float32), np.zeros(n, np.int32),
                   np.array(mask, np.uint8), "stop", "")


def test_build_batch_places_per_token_advantages() -> None:
    """One group with per-token advantages, one without: [B, T] advantages, the given
    values at each row's tokens, the scalar repeated for the other group, 0 in padding."""
    a = scored([rollout([5, 6, 7], [1, 0, 1], [-1, 0, -1]), rollout([8], [1], [-1])],
               [4, 4], [0.0, 0.0],
               [np.array([0.5, 9.0, -0.5], np.float32), np.array([2.0], np.float32)])
    b = scored([rollout([9, 10], [1, 1], [-1, -1]), rollout([11, 12, 13, 14], [1] * 4, [-1] * 4)],
               [4], [0.75, -0.25], gid="0:1")
    batch = build_batch([a, b], pad_id=0)
    assert batch.advantages.shape == (4, 4)
    assert batch.advantages.tolist() == [[0.5, 9.0, -0.5, 0.0], [2.0, 0.0, 0.0, 0.0],
                                         [0.75, 0.75, 0.0, 0.0], [-0.25] * 4]
    assert batch.mask.tolist()[0] == [1, 0, 1, 0]
    sub = batch.rows([1, 2])  # a micro-batch keeps its rows' advantages, trimmed
    assert sub.advantages.tolist() == [[2.0, 0.0], [0.75, 0.75]]
    plain = build_batch([b], pad_id=0)
    assert plain.advantages.shape == (2,) and plain.advantages.tolist() == [0.75, -0.25]


def test_gradient_rows_read_per_token_advantages_at_mask_1_only() -> None:
    rows = [rollout([5, 6, 7], [1, 0, 1], [-1, 0, -1])] * 4
    toks = [np.array(x, np.float32) for x in
            ([0.0, 0.0, 0.3], [0.0, 5.0, 0.0], [0.0, 0.0, 0.0], [0.2, 0.2, 0.2])]
    batch = build_batch([scored(rows, [4], [0.1, 1.7, 0.0, 0.2], toks)], pad_id=0)
    assert gradient_rows(batch, LossConfig()).tolist() == [0, 3]  # row 1: only at mask 0
    assert gradient_rows(batch, LossConfig(beta=0.1)).tolist() == [0, 1, 2, 3]
    scalar = build_batch([scored(rows, [4], [0.0, 1.0, 0.0, -2.0])], pad_id=0)
    assert gradient_rows(scalar, LossConfig()).tolist() == [1, 3]


# ---------------------------------------------------------------- with the model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lm")
    return init_tiny_model(root / "a", seed=3), init_tiny_model(root / "b", seed=4)


def fresh(path: Path) -> torch.nn.Module:
    model, _ = load_model(path)
    model.train()
    return model


def settings(loss_type: str = "dapo", beta: float = 0.0, layout: str = "padded") -> StepSettings:
    return StepSettings(loss=LossConfig(loss_type=loss_type, beta=beta,  # type: ignore[arg-type]
                                        max_completion_length=L_MAX),
                        temperature=0.9, layout=layout, chunk_tokens=3)  # type: ignore[arg-type]


PROMPT = [5, 6, 7]


def turn(ids: list[int], lps: list[float]) -> Completion:
    return Completion(np.array(ids, np.int32), np.array(lps, np.float32),
                      np.zeros(len(ids), np.int32), "length")


def episode_batch() -> Batch:
    """Two episodes of one prompt, built as the runner builds them:
    [m m e e m] and [m e e m m] (e: environment tokens, mask 0)."""
    eps = []
    for segs in ([("m", [20, 21], [-1.0, -2.0]), ("e", [30, 31]), ("m", [22], [-1.5])],
                 [("m", [40], [-0.7]), ("e", [32, 33]), ("m", [41, 42], [-2.2, -0.4])]):
        b = EpisodeBuilder()
        for kind, ids, *lps in segs:
            if kind == "m":
                b.add_model(turn(ids, lps[0]))
            else:
                b.add_context(ids)
        eps.append(to_rollout(b.finish("stop"), _NoTok()))
    return build_batch([scored(eps, PROMPT, [0.7, -0.4])], pad_id=0)


def split_batch() -> Batch:
    """The same model turns as single-turn rows, each prompted by the conversation so far."""
    rows = [(PROMPT, [20, 21], [-1.0, -2.0], 0.7),
            ([*PROMPT, 20, 21, 30, 31], [22], [-1.5], 0.7),
            (PROMPT, [40], [-0.7], -0.4),
            ([*PROMPT, 40, 32, 33], [41, 42], [-2.2, -0.4], -0.4)]
    return build_batch([scored([to_rollout(turn(ids, lps), _NoTok())], p, [a], gid=f"0:{i}")
                        for i, (p, ids, lps, a) in enumerate(rows)], pad_id=0)


class _NoTok:
    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for p in model.parameters()]


def loss_and_grads(path: Path, batch: Batch, st: StepSettings, old_model: Path | None = None,
                   norm: LossNorm | None = None, ref: torch.Tensor | None = None,
                   ) -> tuple[float, list[torch.Tensor], dict[str, float]]:
    old = None
    if old_model is not None:
        with torch.no_grad():
            old = token_logps(fresh(old_model), batch, st.temperature)[0]
    model = fresh(path)
    model.zero_grad(set_to_none=True)
    loss, metrics = compute_loss(model, batch, st, old_logps=old, ref_logps=ref, norm=norm)
    loss.backward()
    return float(loss.detach()), grads(model), metrics


@pytest.mark.parametrize("layout", ["padded", "packed", "shared", "trie"])
@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "dr_grpo"])
def test_an_episode_trains_like_its_turns_as_single_turn_rows(
        models: tuple[Path, Path], loss_type: str, layout: str) -> None:
    """Token-normalised losses with one step normaliser (6 model tokens, 2 samples): the
    episodes' loss and gradient equal those of their model turns as single-turn rows whose
    prompts hold everything before them, environment tokens included. The ratio is taken
    against another model's logprobs, so the loss reads every model token's logprob."""
    st = settings(loss_type, layout=layout)
    norm = LossNorm(tokens=6, rows=2)
    ep = episode_batch()
    assert ep.mask.tolist() == [[1, 1, 0, 0, 1], [1, 0, 0, 1, 1]]
    multi = loss_and_grads(models[0], ep, st, models[1], norm)
    single = loss_and_grads(models[0], split_batch(), st, models[1], norm)
    assert multi[0] == pytest.approx(single[0], rel=1e-5, abs=1e-7)
    for g1, g2 in zip(multi[1], single[1], strict=True):
        torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-5)
    assert any(g.abs().sum() > 0 for g in multi[1])


def test_environment_tokens_are_context(models: tuple[Path, Path]) -> None:
    """The equivalence above is not vacuous: other environment tokens change the loss of
    the model tokens after them."""
    st = settings()
    ep = episode_batch()
    base = loss_and_grads(models[0], ep, st, models[1])[0]
    ep.input_ids[0, len(PROMPT) + 2] = 50  # row 0's first environment token
    assert loss_and_grads(models[0], ep, st, models[1])[0] != pytest.approx(base, rel=1e-6)


def test_an_all_model_episode_is_a_single_turn_rollout(models: tuple[Path, Path]) -> None:
    """Two model turns with nothing between them (mask all ones) train exactly as one
    completion of the same tokens."""
    b = EpisodeBuilder()
    b.add_model(turn([20, 21], [-1.0, -2.0]))
    b.add_model(turn([22, 23, 24], [-1.5, -0.2, -0.9]))
    ep = to_rollout(b.finish("length"), _NoTok())
    single = to_rollout(turn([20, 21, 22, 23, 24], [-1.0, -2.0, -1.5, -0.2, -0.9]), _NoTok())
    assert ep.mask.tolist() == [1] * 5
    for lt in ("grpo", "dapo", "dr_grpo"):
        st = settings(lt)
        a = loss_and_grads(models[0], build_batch([scored([ep, ep], PROMPT, [0.5, -0.5])], 0),
                           st, models[1])
        s = loss_and_grads(models[0], build_batch([scored([single, single], PROMPT,
                                                          [0.5, -0.5])], 0), st, models[1])
        assert a[0] == s[0] and a[2] == s[2]
        assert all(torch.equal(x, y) for x, y in zip(a[1], s[1], strict=True))


def junked(batch: Batch) -> Batch:
    """``batch`` with NaN / ±inf behaviour logprobs and advantages at its mask-0 tokens
    (per-token advantages: each row's scalar at its mask-1 tokens)."""
    m = batch.mask == 0
    junk = torch.tensor([NAN, INF, -INF])[torch.arange(int(m.sum())) % 3]
    beh = batch.behaviour_logps.clone()
    beh[m] = junk
    adv = batch.advantages.unsqueeze(1).repeat(1, batch.mask.shape[1]).clone()
    adv[m] = junk
    versions = batch.versions.clone()
    versions[m] = 10**6
    return Batch(batch.input_ids, batch.attention_mask, batch.completion_start,
                 batch.completion_ids, beh, batch.mask, adv, versions, batch.candidates,
                 batch.candidates_missing, batch.group)


@pytest.mark.parametrize(("loss_type", "beta"), [("dapo", 0.0), ("grpo", 0.05),
                                                 ("dr_grpo", 0.05)])
def test_junk_at_environment_tokens_changes_nothing_in_compute_loss(
        models: tuple[Path, Path], loss_type: str, beta: float) -> None:
    st = settings(loss_type, beta)
    clean = episode_batch()
    ref = None
    if beta:
        with torch.no_grad():
            ref = token_logps(fresh(models[1]), clean, st.temperature)[0]
        ref_junk = ref.clone()
        ref_junk[clean.mask == 0] = NAN
    a = loss_and_grads(models[0], clean, st, models[1], ref=ref)
    b = loss_and_grads(models[0], junked(clean), st, models[1],
                       ref=ref_junk if beta else None)
    assert math.isfinite(a[0]) and a[0] == b[0]
    assert a[2] == b[2]
    for x, y in zip(a[1], b[1], strict=True):
        assert torch.isfinite(y).all() and torch.equal(x, y)


def test_entropy_and_logprobs_are_over_mask_1_tokens(models: tuple[Path, Path]) -> None:
    st = settings()
    batch = episode_batch()
    model = fresh(models[0])
    with torch.no_grad():
        lp, ent, _ = lean_logps(model, batch, st, with_entropy=True)
        ref_lp, comp = token_logps(model, batch, st.temperature)
        ref_ent = entropy_from_logits(comp / st.temperature)
        full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.equal(comp, completion_logits(full.float(), batch))
    m = batch.mask > 0
    assert ent is not None
    assert (lp[~m] == 0).all() and (ent[~m] == 0).all()
    torch.testing.assert_close(lp[m], ref_lp[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[m], ref_ent[m], atol=1e-5, rtol=1e-5)
    _, metrics = compute_loss(model, junked(batch), st)
    assert metrics["entropy"] == pytest.approx(float(ref_ent[m].mean()), rel=1e-5)
    # the mean over every token (environment ones too) differs: the test tells them apart
    assert float(ref_ent.mean()) != pytest.approx(metrics["entropy"], rel=1e-6)


def test_per_token_advantage_batch_trains_like_the_row_advantages(
        models: tuple[Path, Path]) -> None:
    """build_batch with token_advantages equal to each rollout's scalar gives the same
    loss and gradient through compute_loss as the plain [B] batch, and step_norm and
    gradient_rows agree."""
    rolls = [rollout([20, 21, 30, 31, 22], [1, 1, 0, 0, 1], [-1.0, -2.0, 0, 0, -1.5]),
             rollout([40, 32, 33, 41, 42], [1, 0, 0, 1, 1], [-0.7, 0, 0, -2.2, -0.4])]
    plain = build_batch([scored(rolls, PROMPT, [0.7, -0.4])], pad_id=0)
    toks = [np.full(5, 0.7, np.float32), np.full(5, -0.4, np.float32)]
    toks[0][2:4] = 123.0  # at mask-0 tokens: never read
    per = build_batch([scored(rolls, PROMPT, [0.7, -0.4], toks)], pad_id=0)
    assert per.advantages.shape == (2, 5)
    assert step_norm(per) == step_norm(plain)
    assert gradient_rows(per, LossConfig()).tolist() == gradient_rows(plain, LossConfig()).tolist()
    for lt in ("grpo", "dapo"):
        st = settings(lt)
        a = loss_and_grads(models[0], plain, st, models[1])
        b = loss_and_grads(models[0], per, st, models[1])
        assert a[0] == b[0] and a[2] == b[2]
        assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def test_to_rollout_keeps_the_episode_mask() -> None:
    """to_rollout keeps an episode's arrays and mask (the path every batch above takes)."""
    b = EpisodeBuilder()
    b.add_model(turn([20], [-1.0]))
    b.add_context([30, 31])
    e = b.finish("stop", messages=[{"role": "assistant", "content": ""}])
    r = to_rollout(e, _NoTok())
    assert r.mask.tolist() == [1, 0, 0] and r.logprobs.tolist() == [-1.0, 0.0, 0.0]
    assert r.messages == e.messages and r.finish_reason == "stop"
    assert to_rollout(turn([7, 8], [-0.5, -0.25]), _NoTok()).mask.tolist() == [1, 1]


def to_rollout(x: Any, tok: Any) -> Any:
    """An episode (or a lone completion) on the wire, as the generator appends it."""
    return (x if isinstance(x, Episode) else Episode.of(x)).to_rollout(tok)
