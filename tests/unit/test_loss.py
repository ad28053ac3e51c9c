"""pipeline.rl.losses against hand-computed values (B=2, T=3)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.rl.logprobs import entropy_from_logits, selective_log_softmax
from pipeline.rl.losses import LossConfig, grpo_loss, importance_weights

LN2 = math.log(2.0)


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def leaf(x: list) -> torch.Tensor:
    return t(x).requires_grad_(True)


def ln(x: list[list[float]]) -> torch.Tensor:
    return torch.log(t(x))


def close(a: torch.Tensor, expected: list | float, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        a.detach(), torch.as_tensor(expected, dtype=a.dtype), atol=atol, rtol=1e-5
    )


# ---------------------------------------------------------------- normalisation

# logps = old = behaviour = 0 (coef_1 = 1, IS weight 1), A = [1, -0.5],
# mask [[1,1,0],[1,0,0]]: per-token loss -A -> row sums -2 and +0.5, total -1.5, 3 tokens.
# With old=None the gradient of each masked token is -A * w / normaliser.
NORM_CASES = [
    # (loss_type, extra, expected loss, expected grad)
    ("dapo", {}, -1.5 / 3, [[-1 / 3, -1 / 3, 0.0], [1 / 6, 0.0, 0.0]]),
    ("dapo", {"num_items_in_batch": 6.0}, -1.5 / 6, [[-1 / 6, -1 / 6, 0.0], [1 / 12, 0.0, 0.0]]),
    ("bnpo", {}, -1.5 / 3, [[-1 / 3, -1 / 3, 0.0], [1 / 6, 0.0, 0.0]]),
    # grpo: mean of row means (-2/2, 0.5/1) = -0.25; grad -A / (B * row_len)
    ("grpo", {}, -0.25, [[-0.25, -0.25, 0.0], [0.25, 0.0, 0.0]]),
    # dr_grpo: -1.5 / (B=2 * L=4) = -0.1875; grad -A / 8
    ("dr_grpo", {}, -0.1875, [[-0.125, -0.125, 0.0], [0.0625, 0.0, 0.0]]),
]


@pytest.mark.parametrize(("loss_type", "extra", "expected", "grad"), NORM_CASES)
def test_loss_type_normalisation_and_grad(
    loss_type: str, extra: dict, expected: float, grad: list
) -> None:
    cfg = LossConfig(loss_type=loss_type, max_completion_length=4)  # type: ignore[arg-type]
    logps = leaf([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    loss, metrics = grpo_loss(logps, None, torch.zeros(2, 3), t([1.0, -0.5]), mask, cfg, **extra)
    close(loss, expected)
    loss.backward()
    assert logps.grad is not None
    close(logps.grad, grad)
    assert metrics["clip_ratio/region_mean"] == 0.0
    assert metrics["kl"] == 0.0


def test_grpo_counts_an_empty_row_in_the_mean() -> None:
    # row 0: mean of -1, -1 = -1; row 1 has no tokens: 0 / clamp(0, 1) = 0; mean = -0.5
    loss, _ = grpo_loss(
        torch.zeros(2, 3),
        None,
        torch.zeros(2, 3),
        t([1.0, 5.0]),
        t([[1, 1, 0], [0, 0, 0]]),
        LossConfig(loss_type="grpo"),
    )
    close(loss, -0.5)


def test_dapo_with_no_tokens_is_zero_not_nan() -> None:
    loss, metrics = grpo_loss(
        torch.zeros(2, 3), None, torch.zeros(2, 3), t([1.0, 1.0]), torch.zeros(2, 3), LossConfig()
    )
    close(loss, 0.0)
    assert math.isnan(metrics["is_ratio/mean"])


# ---------------------------------------------------------------- clipping

# old = 0, ratios exp(logps - old) = [0.5, 1, 1.25] in both rows, A = [1, -1], all masked.
RATIOS = [[0.5, 1.0, 1.25], [0.5, 1.0, 1.25]]


def _clip_case(cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    logps = ln(RATIOS).requires_grad_(True)
    loss, metrics = grpo_loss(
        logps, torch.zeros(2, 3), torch.zeros(2, 3), t([1.0, -1.0]), torch.ones(2, 3), cfg
    )
    loss.backward()
    assert logps.grad is not None
    return loss, metrics, logps.grad


def test_clip_asymmetric_epsilon_high() -> None:
    # eps_low 0.2 -> 0.8, eps_high 0.28 -> 1.28.
    # row0 (A=+1): -min(r, clamp r) = [-0.5, -1, -1.25] (1.25 < 1.28: not clipped)
    # row1 (A=-1): -min(-r, -clamp r) = [0.8 (clipped up from 0.5), 1, 1.25]
    # sum = -2.75 + 3.05 = 0.30, /6 tokens = 0.05
    loss, m, grad = _clip_case(LossConfig(epsilon=0.2, epsilon_high=0.28))
    close(loss, 0.05)
    assert m["clip_ratio/low_mean"] == pytest.approx(1 / 6)
    assert m["clip_ratio/high_mean"] == pytest.approx(0.0)
    assert m["clip_ratio/region_mean"] == pytest.approx(1 / 6)
    # d/dlogp of -A * r is -A * r; clipped token (row1, tok0) gets 0. /6
    close(grad, [[-0.5 / 6, -1 / 6, -1.25 / 6], [0.0, 1 / 6, 1.25 / 6]])


def test_clip_symmetric_when_epsilon_high_is_none() -> None:
    # eps_high = eps = 0.2 -> 1.2: row0 tok2 now clipped to -1.2 (no gradient).
    # sum = (-0.5 - 1 - 1.2) + 3.05 = 0.35, /6 = 0.0583333
    cfg = LossConfig(epsilon=0.2)
    assert cfg.eps_high == 0.2
    loss, m, grad = _clip_case(cfg)
    close(loss, 0.35 / 6)
    assert m["clip_ratio/low_mean"] == pytest.approx(1 / 6)
    assert m["clip_ratio/high_mean"] == pytest.approx(1 / 6)
    assert m["clip_ratio/region_mean"] == pytest.approx(2 / 6)
    close(grad, [[-0.5 / 6, -1 / 6, 0.0], [0.0, 1 / 6, 1.25 / 6]])


# ---------------------------------------------------------------- importance weights

# old = 0, behaviour = -log(raw) so exp(old - behaviour) = raw; (row1, tok2) is masked out.
RAW = [[0.5, 2.0, 4.0], [1.0, 0.8, 8.0]]
IS_MASK = [[1, 1, 1], [1, 1, 0]]
IS_CASES = [
    ("token_truncate", [[0.6, 2.0, 3.0], [1.0, 0.8, 0.0]]),  # clamped to [0.6, 3] (TRL)
    ("token_mask", [[0.0, 2.0, 0.0], [1.0, 0.8, 0.0]]),  # 0.5 < 0.6 and 4 > 3 zeroed
    # rows: exp(sum of masked diffs) = 0.5*2*4 = 4 and 1*0.8 = 0.8 (the masked 8 excluded)
    ("sequence_truncate", [[3.0, 3.0, 3.0], [0.8, 0.8, 0.0]]),
    ("sequence_mask", [[0.0, 0.0, 0.0], [0.8, 0.8, 0.0]]),
    ("none", [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
]


@pytest.mark.parametrize(("mode", "expected"), IS_CASES)
def test_importance_weights_modes(mode: str, expected: list) -> None:
    old = torch.zeros(2, 3, requires_grad=True)
    w = importance_weights(old, -ln(RAW), t(IS_MASK), mode, clip_min=0.6, clip_max=3.0)  # type: ignore[arg-type]
    assert not w.requires_grad
    close(w, expected, atol=1e-5)


def test_importance_weights_sequence_mask_below_min_and_inclusive_bounds() -> None:
    w = importance_weights(
        torch.zeros(2, 3), -ln(RAW), t(IS_MASK), "sequence_mask", clip_min=0.9, clip_max=5.0
    )
    close(w, [[4.0, 4.0, 4.0], [0.0, 0.0, 0.0]], atol=1e-5)  # row1 0.8 < 0.9
    # ratio exactly 1 with min == max == 1 is kept (bounds inclusive)
    w = importance_weights(
        torch.zeros(1, 2),
        torch.zeros(1, 2),
        torch.ones(1, 2),
        "token_mask",
        clip_min=1.0,
        clip_max=1.0,
    )
    close(w, [[1.0, 1.0]])


# Loss with IS: logps = 0 (leaf), old=None, behaviour = -log([[2, .5, 4], [1, 1, 1]]),
# A = [1, -0.5], mask IS_MASK (5 tokens); per token -A * w.
IS_LOSS_CASES = [
    # w [[2, .6, 3], [1, 1, 0]] (.5 raised to clip_min): (-2 - .6 - 3 + .5 + .5) / 5
    ("token_truncate", -0.92),
    # w [[0, 2, 0], [1, 1, 0]]: (-2 + 1) / 5 = -0.2
    ("token_mask", -0.2),
    # row0 exp(ln2 - ln2 + ln4) = 4 -> 3 each: (-9 + 1) / 5 = -1.6
    ("sequence_truncate", -1.6),
    # row0 4 > 3 -> 0: (0 + 1) / 5 = 0.2
    ("sequence_mask", 0.2),
    # w = 1: (-3 + 1) / 5 = -0.4
    ("none", -0.4),
]
IS_BEHAVIOUR = [[2.0, 0.5, 4.0], [1.0, 1.0, 1.0]]


@pytest.mark.parametrize(("mode", "expected"), IS_LOSS_CASES)
def test_loss_importance_weighting(mode: str, expected: float) -> None:
    cfg = LossConfig(is_mode=mode, is_clip_min=0.6, is_clip_max=3.0)  # type: ignore[arg-type]
    loss, _ = grpo_loss(torch.zeros(2, 3), None, -ln(IS_BEHAVIOUR), t([1.0, -0.5]), t(IS_MASK), cfg)
    close(loss, expected, atol=1e-5)


def test_loss_is_gradient_and_metrics() -> None:
    logps = torch.zeros(2, 3, requires_grad=True)
    loss, m = grpo_loss(
        logps,
        None,
        -ln(IS_BEHAVIOUR),
        t([1.0, -0.5]),
        t(IS_MASK),
        LossConfig(is_mode="token_truncate", is_clip_max=3.0),
    )
    loss.backward()
    assert logps.grad is not None
    # dapo with old=None: grad = -A * w / N, w [[2, .5, 3], [1, 1, 0]], N = 5
    close(logps.grad, [[-0.4, -0.1, -0.6], [0.1, 0.1, 0.0]], atol=1e-5)
    # raw ratios over masked tokens: 2, .5, 4, 1, 1 (the masked third of row1 excluded)
    assert m["is_ratio/min"] == pytest.approx(0.5, rel=1e-5)
    assert m["is_ratio/max"] == pytest.approx(4.0, rel=1e-5)
    assert m["is_ratio/mean"] == pytest.approx(1.7, rel=1e-5)
    assert m["is_ratio/outside_frac"] == pytest.approx(1 / 5)  # only 4 > is_clip_max 3
    _, masked = grpo_loss(logps, None, -ln(IS_BEHAVIOUR), t([1.0, -0.5]), t(IS_MASK),
                          LossConfig(is_mode="token_mask", is_clip_min=0.6, is_clip_max=3.0))
    assert masked["is_ratio/outside_frac"] == pytest.approx(2 / 5)  # 4 and 0.5
    # |old - behaviour|: ln2 + ln2 + 2 ln2 + 0 + 0 over 5 tokens = 0.5545177
    assert m["logprob_diff/mean_abs"] == pytest.approx(4 * LN2 / 5, rel=1e-5)
    assert m["clip_ratio/region_mean"] == 0.0


# ---------------------------------------------------------------- KL


def test_kl_term_value_grad_and_metric() -> None:
    # A = 0, so only beta * k3 remains. ref - logps: ln2 at (0,0), ln0.5 at (1,1), else 0.
    # k3(ln2) = 2 - ln2 - 1 = 0.3068528; k3(ln.5) = .5 + ln2 - 1 = 0.1931472; sum 0.5.
    # dapo over 6 tokens: 0.1 * 0.5 / 6 = 0.0083333; kl metric 0.5 / 6 = 0.0833333.
    # d k3 / d logps = 1 - exp(ref - logps): -1 at (0,0), +0.5 at (1,1). With the bias
    # correction the term is k3 * exp(logps - sg(logps)), whose gradient adds k3 itself:
    # -1 + 0.3068528 = -ln2 at (0,0) and 0.5 + 0.1931472 = ln2 at (1,1).
    ref = ln([[2.0, 1.0, 1.0], [1.0, 0.5, 1.0]])
    for corrected, g00, g11 in ((False, -1.0, 0.5), (True, -LN2, LN2)):
        logps = torch.zeros(2, 3, requires_grad=True)
        loss, m = grpo_loss(
            logps,
            None,
            torch.zeros(2, 3),
            t([0.0, 0.0]),
            torch.ones(2, 3),
            LossConfig(beta=0.1, kl_bias_correction=corrected),
            ref_logps=ref,
        )
        close(loss, 0.1 * 0.5 / 6)
        assert m["kl"] == pytest.approx(0.5 / 6, rel=1e-5)
        loss.backward()
        assert logps.grad is not None
        close(logps.grad, [[0.1 * g00 / 6, 0.0, 0.0], [0.0, 0.1 * g11 / 6, 0.0]])


def test_kl_is_not_importance_weighted_and_off_when_beta_zero() -> None:
    ref = ln([[2.0, 1.0, 1.0], [1.0, 0.5, 1.0]])
    behaviour = torch.full((2, 3), -LN2)  # IS weight 2 everywhere
    loss, _ = grpo_loss(
        torch.zeros(2, 3),
        None,
        behaviour,
        t([0.0, 0.0]),
        torch.ones(2, 3),
        LossConfig(beta=0.1),
        ref_logps=ref,
    )
    close(loss, 0.1 * 0.5 / 6)
    loss, m = grpo_loss(
        torch.zeros(2, 3),
        None,
        torch.zeros(2, 3),
        t([0.0, 0.0]),
        torch.ones(2, 3),
        LossConfig(beta=0.0),
        ref_logps=ref,
    )
    close(loss, 0.0)
    assert m["kl"] == 0.0
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(
            torch.zeros(2, 3),
            None,
            torch.zeros(2, 3),
            t([0.0, 0.0]),
            torch.ones(2, 3),
            LossConfig(beta=0.1),
        )


# ---------------------------------------------------------------- masking and gradients


def test_masked_tokens_contribute_nothing_even_if_garbage() -> None:
    cfg = LossConfig(beta=0.1, is_mode="sequence_truncate")
    mask = t(IS_MASK)  # (1, 2) is masked out
    adv = t([1.0, -0.5])

    def run(pad: list[float]) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        lp_v, old_v, beh_v, ref_v = pad
        logps = leaf([[0.1, -0.2, 0.05], [0.0, 0.3, lp_v]])
        old = t([[0.0, 0.0, 0.0], [0.0, 0.1, old_v]])
        beh = t([[LN2, -LN2, 0.2], [0.0, 0.0, beh_v]])
        ref = t([[0.3, 0.0, 0.0], [-0.1, 0.0, ref_v]])
        loss, m = grpo_loss(logps, old, beh, adv, mask, cfg, ref_logps=ref)
        loss.backward()
        assert logps.grad is not None
        return loss, m, logps.grad

    clean = run([0.0, 0.0, 0.0, 0.0])
    dirty = run([1e4, math.nan, math.inf, -math.inf])
    close(dirty[0], float(clean[0].detach()))
    assert dirty[1] == clean[1]
    assert torch.isfinite(dirty[2]).all()
    close(dirty[2], clean[2].tolist())
    assert dirty[2][1, 2] == 0.0


def test_gradient_flows_only_through_logps() -> None:
    logps = torch.zeros(2, 3, requires_grad=True)
    old = torch.zeros(2, 3, requires_grad=True)
    beh = torch.full((2, 3), 0.1, requires_grad=True)
    ref = torch.full((2, 3), 0.2, requires_grad=True)
    adv = t([1.0, -1.0]).requires_grad_(True)
    loss, _ = grpo_loss(logps, old, beh, adv, torch.ones(2, 3), LossConfig(beta=0.1), ref_logps=ref)
    assert loss.requires_grad
    loss.backward()
    assert logps.grad is not None
    assert old.grad is None and beh.grad is None and ref.grad is None and adv.grad is None


def test_old_none_equals_detached_logps() -> None:
    logps = t([[0.1, -0.3, 0.2], [0.0, 0.4, -0.1]])
    args = (ln(IS_BEHAVIOUR), t([1.0, -0.5]), t(IS_MASK), LossConfig())
    a, ma = grpo_loss(logps, None, *args)
    b, mb = grpo_loss(logps, logps.clone(), *args)
    close(a, float(b))
    assert ma == mb


# ---------------------------------------------------------------- config and shapes


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_completion_length"):
        LossConfig(loss_type="dr_grpo")
    with pytest.raises(ValueError):
        LossConfig(is_clip_min=2.0, is_clip_max=1.0)
    with pytest.raises(ValueError):
        LossConfig(loss_type="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LossConfig(is_mode="seq")  # type: ignore[arg-type]
    cfg = LossConfig(epsilon=0.2, epsilon_high=0.28)
    assert (cfg.eps_low, cfg.eps_high) == (0.2, 0.28)


def test_shape_errors() -> None:
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError):
        grpo_loss(z, None, z, t([1.0, 2.0, 3.0]), torch.ones(2, 3), LossConfig())
    with pytest.raises(ValueError):
        grpo_loss(z, None, torch.zeros(2, 4), t([1.0, 2.0]), torch.ones(2, 3), LossConfig())
    with pytest.raises(ValueError):
        grpo_loss(z, None, z, t([1.0, 2.0]), torch.ones(2, 3), LossConfig(), num_items_in_batch=0.0)


# ---------------------------------------------------------------- logits helpers


def test_entropy_from_logits() -> None:
    # uniform over 4: ln 4 = 1.3862944; probs (.25, .75): .25 ln4 + .75 ln(4/3) = 0.5623351
    uniform = torch.zeros(1, 2, 4)
    close(entropy_from_logits(uniform), [[1.3862944, 1.3862944]])
    two = torch.tensor([[[0.0, math.log(3.0)]] * 3])  # [1, 3, 2]
    h = entropy_from_logits(two, chunk_size=1)
    assert h.shape == (1, 3)
    close(h, [[0.5623351] * 3])


def test_selective_log_softmax_and_temperature() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])  # [1, 2, 2]
    ids = torch.tensor([[1, 0]])
    # softmax([0, ln3]) = (.25, .75): ln .75 = -0.2876821; uniform: ln .5 = -0.6931472
    close(selective_log_softmax(logits, ids), [[-0.2876821, -0.6931472]])
    # T=2: logits [0, ln sqrt3] -> p = sqrt3 / (1 + sqrt3) = 0.6339746, ln = -0.4557464
    close(selective_log_softmax(logits, ids, temperature=2.0), [[-0.4557464, -0.6931472]])
    low = selective_log_softmax(logits.to(torch.bfloat16), ids)
    assert low.dtype == torch.bfloat16
    close(low.float(), [[-0.2876821, -0.6931472]], atol=1e-2)
    with pytest.raises(ValueError):
        selective_log_softmax(logits, ids, temperature=0.0)
