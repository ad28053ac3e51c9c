"""pipeline.rl.distillation (on-policy distillation advantages) against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.rl.distillation import mean_over_mask, reverse_kl, token_advantages

F = np.float32


def test_token_advantages_add_the_teacher_term_at_mask_1_and_are_0_at_mask_0() -> None:
    behaviour = [np.array([-1.0, -2.0, 0.0, -0.5], F), np.array([-3.0], F)]
    teacher = [np.array([-0.5, -4.0, -9.0, -0.5], F), np.array([-1.0], F)]
    masks = [np.array([1, 1, 0, 1], np.uint8), np.array([1], np.uint8)]
    adv = token_advantages(np.array([0.25, -0.25]), behaviour, teacher, masks, coef=2.0)
    # rollout 0: 0.25 + 2*(t - b) = 0.25 + 2*0.5, 0.25 + 2*(-2), mask 0 -> 0, 0.25 + 0
    np.testing.assert_allclose(adv[0], [1.25, -3.75, 0.0, 0.25])
    np.testing.assert_allclose(adv[1], [-0.25 + 2 * 2.0])
    assert all(a.dtype == np.float32 for a in adv)
    assert adv[0][2] == 0.0  # exactly, not a near-zero: the environment's token


def test_pure_distillation_is_the_log_ratio_and_its_mean_over_mask_1() -> None:
    behaviour = [np.array([-1.0, -1.0, -1.0], F)]
    teacher = [np.array([-2.0, 0.0, -7.0], F)]
    masks = [np.array([1, 1, 0], np.uint8)]
    adv = token_advantages(np.zeros(1), behaviour, teacher, masks, coef=1.0)
    np.testing.assert_allclose(adv[0], [-1.0, 1.0, 0.0])
    np.testing.assert_allclose(mean_over_mask(adv, masks), [0.0])  # (-1 + 1) / 2
    # reverse KL estimate: mean of behaviour - teacher over mask 1 = (1 + -1) / 2
    assert reverse_kl(behaviour, teacher, masks) == (0.0, 2)


def test_mean_over_mask_is_0_for_a_rollout_with_no_policy_token() -> None:
    adv = [np.array([3.0, 5.0], F), np.array([1.0, 2.0, 4.0], F)]
    masks = [np.array([0, 0], np.uint8), np.array([1, 0, 1], np.uint8)]
    np.testing.assert_allclose(mean_over_mask(adv, masks), [0.0, 2.5])


def test_reverse_kl_pools_rollouts_token_by_token() -> None:
    behaviour = [np.array([-1.0, -2.0], F), np.array([-0.5], F)]
    teacher = [np.array([-3.0, -2.0], F), np.array([-1.5], F)]
    masks = [np.array([1, 1], np.uint8), np.array([1], np.uint8)]
    total, n = reverse_kl(behaviour, teacher, masks)
    assert n == 3 and total == pytest.approx(2.0 + 0.0 + 1.0)


def test_mismatched_lengths_and_non_finite_teacher_logprobs_are_refused() -> None:
    b, m = [np.zeros(3, F)], [np.ones(3, np.uint8)]
    with pytest.raises(ValueError, match="2 teacher logprobs"):
        token_advantages(np.zeros(1), b, [np.zeros(2, F)], m, 1.0)
    with pytest.raises(ValueError, match="not finite"):
        token_advantages(np.zeros(1), b, [np.array([0, -np.inf, 0], F)], m, 1.0)
    with pytest.raises(ValueError, match="shape"):
        token_advantages(np.zeros(2), b, [np.zeros(3, F)], m, 1.0)
    # a non-finite value where the mask is 0 is nobody's business
    token_advantages(np.zeros(1), b, [np.array([0, np.nan, 0], F)],
                     [np.array([1, 0, 1], np.uint8)], 1.0)
