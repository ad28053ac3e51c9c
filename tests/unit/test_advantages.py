"""pipeline.rl.advantages against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.rl.advantages import (
    batch_advantages,
    combine_rewards,
    group_advantages,
    is_zero_variance,
)

NAN = np.nan


# ---------------------------------------------------------------- combine_rewards


def test_combine_rewards_nansum_and_all_nan_row() -> None:
    per_fn = np.array([[1.0, 2.0], [NAN, 3.0], [NAN, NAN], [-1.0, NAN]])
    weights = np.array([0.5, 2.0])
    total = combine_rewards(per_fn, weights)
    # 0.5*1 + 2*2 = 4.5; None skipped -> 2*3 = 6; all None -> NaN; 0.5*-1 = -0.5
    assert total[0] == pytest.approx(4.5)
    assert total[1] == pytest.approx(6.0)
    assert math.isnan(total[2])
    assert total[3] == pytest.approx(-0.5)


def test_combine_rewards_zero_weight_still_counts_as_present() -> None:
    # A function that returned 0 with weight 0 is present: the row totals 0, not NaN.
    total = combine_rewards(np.array([[0.0, NAN]]), np.array([0.0, 1.0]))
    assert total.tolist() == [0.0]


def test_combine_rewards_shape_errors() -> None:
    with pytest.raises(ValueError):
        combine_rewards(np.array([1.0, 2.0]), np.array([1.0]))
    with pytest.raises(ValueError):
        combine_rewards(np.ones((2, 2)), np.ones(3))


# ---------------------------------------------------------------- group_advantages


def test_group_default_is_unbiased_std_plus_1e4() -> None:
    # r = [1, 3]: mean 2, centred [-1, 1]; ddof=1 std = sqrt(2) = 1.41421356
    # adv = ±1 / (1.41421356 + 1e-4) = ±0.70705678
    adv = group_advantages(np.array([1.0, 3.0]))
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv, [-0.70705678, 0.70705678], rtol=1e-6)


def test_group_ddof0_and_eps0() -> None:
    # ddof=0 std of [1, 3] = 1 -> exactly ±1 with eps=0; ±1/1.0001 = ±0.99990001 with 1e-4
    np.testing.assert_allclose(
        group_advantages(np.array([1.0, 3.0]), ddof=0, eps=0.0), [-1.0, 1.0], rtol=1e-7
    )
    np.testing.assert_allclose(
        group_advantages(np.array([1.0, 3.0]), ddof=0), [-0.99990001, 0.99990001], rtol=1e-6
    )


def test_group_four_rewards_ddof1() -> None:
    # r = [0, 0, 1, 1]: mean 0.5, centred ±0.5; ddof=1 var = 4*0.25/3 = 1/3,
    # std = 0.57735027 -> ±0.5/0.57735027 = ±0.8660254 (eps=0)
    adv = group_advantages(np.array([0.0, 0.0, 1.0, 1.0]), eps=0.0)
    np.testing.assert_allclose(adv, [-0.8660254, -0.8660254, 0.8660254, 0.8660254], rtol=1e-6)


def test_group_none_only_centres() -> None:
    adv = group_advantages(np.array([1.0, 2.0, 6.0]), scale_rewards="none")
    # mean 3
    np.testing.assert_allclose(adv, [-2.0, -1.0, 3.0])
    assert adv.dtype == np.float32


def test_group_equal_rewards_give_zeros_even_with_eps0() -> None:
    for eps in (1e-4, 0.0):
        adv = group_advantages(np.array([0.7, 0.7, 0.7]), eps=eps)
        assert np.all(adv == 0.0)


def test_group_single_reward_is_zero_not_nan() -> None:
    # n=1 <= ddof=1: std is taken as 0, centred value is 0.
    assert group_advantages(np.array([5.0])).tolist() == [0.0]


def test_group_rejects_batch_nan_and_bad_args() -> None:
    with pytest.raises(ValueError, match="batch_advantages"):
        group_advantages(np.array([1.0, 2.0]), scale_rewards="batch")
    with pytest.raises(ValueError):
        group_advantages(np.array([1.0, NAN]))
    with pytest.raises(ValueError):
        group_advantages(np.array([]))
    with pytest.raises(ValueError):
        group_advantages(np.array([1.0, 2.0]), ddof=-1)
    with pytest.raises(ValueError):
        group_advantages(np.array([1.0, 2.0]), scale_rewards="nope")  # type: ignore[arg-type]


# ---------------------------------------------------------------- batch_advantages


def test_batch_scales_by_std_of_all_rewards() -> None:
    # groups [3, -1] and [3, 3]; all rewards [3, -1, 3, 3]: mean 2, deviations
    # [1, -3, 1, 1], squares sum 12 -> ddof=1 var 4, std 2; ddof=0 var 3, std sqrt(3).
    # Per-group centring: [2, -2] and [0, 0].
    g = [np.array([3.0, -1.0]), np.array([3.0, 3.0])]
    a, b = batch_advantages(g, scale_rewards="batch", eps=0.0)
    np.testing.assert_allclose(a, [1.0, -1.0], rtol=1e-7)
    np.testing.assert_allclose(b, [0.0, 0.0])
    a0, _ = batch_advantages(g, scale_rewards="batch", eps=0.0, ddof=0)
    np.testing.assert_allclose(a0, [1.1547005, -1.1547005], rtol=1e-6)  # 2/sqrt(3)
    ad, _ = batch_advantages(g, scale_rewards="batch")  # default eps 1e-4, ddof 1
    np.testing.assert_allclose(ad, [0.99995, -0.99995], rtol=1e-6)  # 2/2.0001
    assert a.dtype == np.float32 and b.dtype == np.float32


def test_batch_group_and_none_modes_match_group_advantages() -> None:
    g = [np.array([3.0, -1.0]), np.array([1.0, 2.0, 6.0])]
    # group mode: [3, -1] ddof=1 std = sqrt(8) = 2.8284271 -> ±2/2.8284271 = ±0.70710678
    a, _ = batch_advantages(g, scale_rewards="group", eps=0.0)
    np.testing.assert_allclose(a, [0.70710678, -0.70710678], rtol=1e-6)
    a, b = batch_advantages(g, scale_rewards="none")
    np.testing.assert_allclose(a, [2.0, -2.0])
    np.testing.assert_allclose(b, [-2.0, -1.0, 3.0])
    for mode in ("group", "none"):
        out = batch_advantages(g, scale_rewards=mode)  # type: ignore[arg-type]
        for r, adv in zip(g, out, strict=True):
            np.testing.assert_array_equal(adv, group_advantages(r, scale_rewards=mode))  # type: ignore[arg-type]


def test_batch_empty_list() -> None:
    assert batch_advantages([], scale_rewards="batch") == []


# ---------------------------------------------------------------- is_zero_variance


def test_is_zero_variance() -> None:
    assert is_zero_variance(np.array([1.0, 1.0, 1.0]))
    assert is_zero_variance(np.array([1.0, 1.0 + 5e-7]))  # within atol 1e-6
    assert not is_zero_variance(np.array([1.0, 1.0 + 2e-6]))
    assert not is_zero_variance(np.array([0.0, 0.0, 1.0]))
    assert is_zero_variance(np.array([0.0, 0.5]), atol=0.5)
    assert is_zero_variance(np.array([2.0]))
    with pytest.raises(ValueError):
        is_zero_variance(np.array([1.0, NAN]))


def test_rloo_is_leave_one_out_and_sums_to_zero() -> None:
    from pipeline.rl.advantages import rloo

    r = [1.0, 0.0, 0.5, 0.5]
    got = rloo(rewards=r)
    want = [r[i] - (sum(r) - r[i]) / 3 for i in range(4)]  # by the definition
    assert got == pytest.approx(want) and sum(got) == pytest.approx(0.0)
    assert rloo(rewards=[2.0]) == [0.0]


def test_check_hook_advantages_accepts_rows_or_tokens_and_names_the_problem() -> None:
    from pipeline.rl.advantages import check_hook_advantages

    adv, tok = check_hook_advantages([0.5, -0.5], [3, 2], "h")
    assert adv.tolist() == [0.5, -0.5] and tok is None
    adv, tok = check_hook_advantages([[1.0, 0.0, 2.0], [-1.0, -1.0]], [3, 2], "h")
    assert tok is not None and [t.tolist() for t in tok] == [[1.0, 0.0, 2.0], [-1.0, -1.0]]
    assert adv.tolist() == pytest.approx([1.0, -1.0])
    with pytest.raises(ValueError, match="must return 2 advantages"):
        check_hook_advantages([1.0], [3, 2], "h")
    with pytest.raises(ValueError, match="rollout 1 has 2 tokens but 3"):
        check_hook_advantages([[1.0, 0.0, 2.0], [1.0, 1.0, 1.0]], [3, 2], "h")
    with pytest.raises(ValueError, match="non-finite"):
        check_hook_advantages([float("nan"), 0.0], [3, 2], "h")
