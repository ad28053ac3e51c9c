"""pipeline.rl.offpolicy and the off-policy options of grpo_loss, against hand-computed values.

Convention: the policy's ``logps`` are 0 (a leaf), so a behaviour logprob of ``-ln r``
makes the token ratio ``π / π_behaviour`` equal ``r``.
"""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.config import TrainerConfig
from pipeline.rl.losses import LossConfig, grpo_loss, importance_weights
from pipeline.rl.offpolicy import (
    cispo_per_token,
    geometric_mean_mask,
    ratio_denominator_logps,
    sequence_log_ratio,
)
from tests.unit.test_loss import close, t

LN2 = math.log(2.0)


def beh(ratios: list[list[float]]) -> torch.Tensor:
    """Behaviour logprobs that give token ratios ``ratios`` against logps = 0."""
    return -torch.log(t(ratios))


def run(cfg: LossConfig, behaviour: torch.Tensor, adv: list[float],
        mask: list[list[float]] | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    logps = torch.zeros(behaviour.shape, requires_grad=True)
    m = torch.ones(behaviour.shape) if mask is None else t(mask)
    loss, metrics = grpo_loss(logps, None, behaviour, t(adv), m, cfg)
    loss.backward()
    assert logps.grad is not None
    return loss, logps.grad, metrics


# ---------------------------------------------------------------- pure functions

def test_sequence_log_ratio_is_the_masked_row_mean() -> None:
    lr = t([[LN2, 0.0, 3 * LN2], [2 * LN2, 9.0, 9.0]])
    out = sequence_log_ratio(lr, t([[1, 1, 1], [1, 0, 0]]))
    close(out, [[4 * LN2 / 3], [2 * LN2]])  # geometric means 2^(4/3) and 4
    close(sequence_log_ratio(lr, torch.zeros(2, 3)), [[0.0], [0.0]])  # no tokens: ratio 1


def test_geometric_mean_mask_drops_rows_outside_the_band() -> None:
    b = beh([[2.0, 0.5, 4.0], [1.0, 1.0, 100.0]])  # geo means 4^(1/3) = 1.587, and 1
    mask = t([[1, 1, 1], [1, 1, 0]])                  # (the 100 is masked out)
    close(geometric_mean_mask(torch.zeros(2, 3), b, mask, 0.5, 1.5), [[0.0], [1.0]])
    close(geometric_mean_mask(torch.zeros(2, 3), b, mask, 0.5, 2.0), [[1.0], [1.0]])
    nan = torch.full((1, 3), math.nan)  # unknown behaviour: ratio 1, kept
    close(geometric_mean_mask(torch.zeros(1, 3), nan, torch.ones(1, 3), 0.9, 1.1), [[1.0]])
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        geometric_mean_mask(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), 1.2, 2.0)


def test_cispo_clips_the_weight_and_keeps_every_gradient() -> None:
    lp = torch.zeros(1, 3, requires_grad=True)
    cispo_per_token(lp, t([[0.5, 2.0, 10.0]]), t([[-1.0]]), eps_max=5.0).sum().backward()
    assert lp.grad is not None
    # d/dlp of -w*A*lp = -w*A with w = min(r, 5): [0.5, 2, 5] * -(-1). PPO's clip would
    # zero the first token's gradient (r = 0.5 < 0.8 with A < 0); CISPO keeps it.
    close(lp.grad, [[0.5, 2.0, 5.0]])


def test_reference_is_proximal_or_behaviour_with_nan_fallback() -> None:
    old, b = t([[1.0, 2.0]]), t([[0.5, math.nan]])
    close(ratio_denominator_logps(old, b, decoupled=True), [[1.0, 2.0]])
    close(ratio_denominator_logps(old, b, decoupled=False), [[0.5, 2.0]])


def test_icepop_is_token_mask_with_a_band() -> None:
    w = importance_weights(torch.zeros(1, 3), beh([[0.4, 1.0, 6.0]]), torch.ones(1, 3),
                           mode="token_mask", clip_min=0.5, clip_max=5.0)
    close(w, [[0.0, 1.0, 0.0]])


# ---------------------------------------------------------------- through grpo_loss

def test_decoupled_weights_tokens_coupled_clips_them() -> None:
    b = beh([[2.0, 1.0, 0.5]])  # ratio to the sampler 2, 1, 0.5; A = +1; ε = 0.2
    # decoupled (default): coef_1 = 1, weight w = [2, 1, 0.5] -> loss -(3.5)/3, grad -w/3
    loss, grad, _ = run(LossConfig(), b, [1.0])
    close(loss, -3.5 / 3)
    close(grad, [[-2 / 3, -1 / 3, -1 / 6]])
    # coupled: ratio r = [2, 1, 0.5]; -min(r, clip(r)) = [-1.2 (clipped), -1, -0.5]
    # -> loss -2.7/3; gradient 0 where clipped, -r/3 elsewhere
    loss, grad, m = run(LossConfig(decoupled_ppo=False), b, [1.0])
    close(loss, -2.7 / 3)
    close(grad, [[0.0, -1 / 3, -0.5 / 3]])
    assert m["clip_ratio/high_mean"] == pytest.approx(1 / 3)


def test_gspo_one_ratio_per_sequence() -> None:
    cfg = LossConfig(importance_sampling_level="sequence", decoupled_ppo=False)
    # token ratios 2 and 0.5: geometric mean 1 -> loss -A, grad -A * s / |y| / N * |y|
    loss, grad, _ = run(cfg, beh([[2.0, 0.5]]), [1.0])
    close(loss, -1.0)
    close(grad, [[-0.5, -0.5]])
    # ratios 4 and 4: s = 4 > 1.2 with A > 0: the whole sequence is clipped (no gradient)
    loss, grad, m = run(cfg, beh([[4.0, 4.0]]), [1.0])
    close(loss, -1.2)
    close(grad, [[0.0, 0.0]])
    assert m["clip_ratio/high_mean"] == 1.0
    # a token-level ratio would clip only... both here; 4 and 0.25 shows the difference:
    # token level clips the first (grad 0) and keeps the second (-0.25/2); GSPO's s = 1.
    _, grad_tok, _ = run(LossConfig(decoupled_ppo=False), beh([[4.0, 0.25]]), [1.0])
    close(grad_tok, [[0.0, -0.125]])
    _, grad_seq, _ = run(cfg, beh([[4.0, 0.25]]), [1.0])
    close(grad_seq, [[-0.5, -0.5]])


def test_cispo_loss_caps_ratio_at_epsilon_high() -> None:
    cfg = LossConfig(loss_type="cispo", epsilon_high=5.0, decoupled_ppo=False)
    loss, grad, m = run(cfg, beh([[10.0, 1.0]]), [1.0])
    close(loss, 0.0)  # -w*A*logps with logps = 0
    close(grad, [[-2.5, -0.5]])  # -min(r, 5) * A / N (N = 2)
    assert m["clip_ratio/high_mean"] == 0.5
    with pytest.raises(ValueError, match="epsilon_high"):
        LossConfig(loss_type="cispo")


def test_geo_mask_drops_a_stale_sequence_from_the_loss() -> None:
    b = beh([[4.0, 4.0], [1.0, 1.0]])  # default decoupled: old = logps = 0
    loss, grad, _ = run(LossConfig(is_clip_max=10.0, geo_mask=(0.5, 2.0)), b, [1.0, 1.0])
    close(loss, -2 / 4)  # row 0 (geo 4) dropped; row 1 tokens -1 each; 4 tokens counted
    close(grad, [[0.0, 0.0], [-0.25, -0.25]])


def test_on_policy_every_option_equals_the_default() -> None:
    torch.manual_seed(0)
    on = torch.zeros(3, 4)  # behaviour == policy: every ratio 1
    adv, mask = [1.0, -0.5, 0.25], [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    base_loss, base_grad, _ = run(LossConfig(), on, adv, mask)
    for cfg in (LossConfig(decoupled_ppo=False), LossConfig(geo_mask=(0.9, 1.1)),
                LossConfig(importance_sampling_level="sequence", decoupled_ppo=False),
                LossConfig(loss_type="cispo", epsilon_high=4.0, decoupled_ppo=False)):
        loss, grad, _ = run(cfg, on, adv, mask)
        if cfg.loss_type != "cispo":  # CISPO's value is -w·A·log π (0 here); same gradient
            close(loss, float(base_loss.detach()))
        close(grad, base_grad)


def test_config_names_the_key_of_a_bad_off_policy_setting() -> None:
    with pytest.raises(ValueError, match="epsilon_high"):
        TrainerConfig(loss_type="cispo")
    with pytest.raises(ValueError, match="geo_mask"):
        TrainerConfig(geo_mask=(1.5, 2.0))
    assert TrainerConfig(loss_type="cispo", epsilon_high=5.0).epsilon_high == 5.0
