"""Score centering (`pipeline.rl.centering`): checked against brute force on a tiny
vocabulary, where the sampler-expected score can be summed over every token.

The policy is ``p = softmax(θ)`` over V tokens and the sampler an other distribution
``q``; a token ``y ~ q`` contributes ``-w(y) · log p(y)`` to the loss (advantage 1) with
the loss's importance weight ``w``. Its expected gradient ``-Σ_v q_v w_v ∇log p_v`` is
what centering removes.
"""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.rl.centering import centering_coefficients, centering_term, sampler_mass
from pipeline.rl.losses import importance_weights

V = 7
MODES = [("none", 0.0, 3.0), ("token_truncate", 0.0, 3.0), ("token_truncate", 0.5, 1.5),
         ("token_mask", 0.0, 3.0), ("token_mask", 0.7, 1.3)]


def _dists(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(V, generator=g, dtype=torch.float64)
    q_logits = theta + 0.8 * torch.randn(V, generator=g, dtype=torch.float64)
    return theta, torch.log_softmax(q_logits, -1)


def _weights(logp: torch.Tensor, logq: torch.Tensor, mode: str, lo: float, hi: float
             ) -> torch.Tensor:
    """The loss's own importance weight of every token of the vocabulary."""
    ones = torch.ones(1, V, dtype=torch.bool)
    return importance_weights(logp[None].detach(), logq[None], ones, mode, lo, hi)[0]


def _expected_score(theta: torch.Tensor, logq: torch.Tensor, mode: str, lo: float,
                    hi: float) -> torch.Tensor:
    """``Σ_v q_v w_v ∇log p_v`` by brute force (autograd through every token)."""
    th = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(th, -1)
    w = _weights(logp, logq, mode, lo, hi)
    (logq.exp() * w * logp).sum().backward()
    assert th.grad is not None
    return th.grad


def _centering_grad(theta: torch.Tensor, logq: torch.Tensor, top: torch.Tensor, mode: str,
                    lo: float, hi: float) -> torch.Tensor:
    """Gradient of ``C`` with the sampler reporting the ids ``top`` only."""
    th = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(th, -1)
    valid = torch.ones(len(top), dtype=torch.bool)
    centering_term(logp[top], logq[top], valid, mode, lo, hi).backward()
    assert th.grad is not None
    return th.grad


@pytest.mark.parametrize(("mode", "lo", "hi"), MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_the_whole_vocabulary_reported_the_estimate_is_exact(mode: str, lo: float,
                                                                   hi: float, seed: int) -> None:
    theta, logq = _dists(seed)
    want = _expected_score(theta, logq, mode, lo, hi)
    got = _centering_grad(theta, logq, torch.arange(V), mode, lo, hi)
    assert torch.allclose(got, want, atol=1e-12), (got, want)
    ratio = (torch.log_softmax(theta, -1) - logq).exp()
    if mode == "none" or bool(((ratio < lo) | (ratio > hi)).any()):
        assert want.abs().max() > 1e-3  # a bound bit: there was something to remove


@pytest.mark.parametrize(("mode", "lo", "hi"), MODES)
def test_a_tail_proportional_to_the_policys_is_estimated_exactly_from_the_top_k(
        mode: str, lo: float, hi: float) -> None:
    """The tail model ``q ≈ ρ p`` is exact when the sampler's tail is the policy's scaled:
    then the top 3 of 7 tokens give the brute-force expectation."""
    theta, _ = _dists(3)
    p = torch.softmax(theta, -1)
    top = torch.topk(p, 3).indices
    q = p.clone()
    q[top] = torch.tensor([0.5, 0.2, 0.1], dtype=torch.float64)
    tail = torch.ones(V, dtype=torch.bool)
    tail[top] = False
    q[tail] = p[tail] * (0.2 / p[tail].sum())  # tail mass 0.2, shaped like p's
    want = _expected_score(theta, q.log(), mode, lo, hi)
    got = _centering_grad(theta, q.log(), top, mode, lo, hi)
    assert torch.allclose(got, want, atol=1e-12), (got, want)


@pytest.mark.parametrize(("mode", "lo", "hi"), MODES)
def test_centering_changes_nothing_on_policy(mode: str, lo: float, hi: float) -> None:
    theta, _ = _dists(4)
    logp = torch.log_softmax(theta, -1)
    top = torch.topk(logp, 3).indices
    c = centering_coefficients(logp[top], logp[top], torch.ones(3, dtype=torch.bool), mode,
                               lo, hi)
    if mode == "none" or lo <= 1.0 <= hi:
        assert c.abs().max() < 1e-15, c


def test_untruncated_weights_need_no_centering() -> None:
    theta, logq = _dists(5)
    logp = torch.log_softmax(theta, -1)
    c = centering_coefficients(logp, logq, torch.ones(V, dtype=torch.bool),
                               "token_truncate", 0.0, math.inf)
    assert c.abs().max() < 1e-15


def test_the_centred_gradient_has_mean_zero_under_the_sampler() -> None:
    """Monte Carlo: 200k tokens drawn from q, advantage 1, truncated weights in [0, 1.2],
    top-3 reported. Without centering the mean gradient is the pull toward the sampler
    (~0.1 here); with it, the mean is 0 within sampling noise."""
    theta, _ = _dists(6)
    p = torch.softmax(theta, -1)
    top = torch.topk(p, 3).indices
    q = p.clone()
    q[top] = q[top].flip(0)  # the sampler disagrees on the head, agrees on the tail shape
    logq = q.log()
    n = 200_000
    y = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(0))
    th = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(th, -1)
    w = _weights(logp, logq, "token_truncate", 0.0, 1.2)
    base = -(w[y] * logp[y]).mean()
    (g_base,) = torch.autograd.grad(base, th, retain_graph=True)
    valid = torch.ones(3, dtype=torch.bool)
    c = centering_term(logp[top], logq[top], valid, "token_truncate", 0.0, 1.2)
    (g_centred,) = torch.autograd.grad(base + c, th)
    assert g_base.abs().max() > 0.05, g_base
    assert g_centred.abs().max() < 0.01, g_centred


def test_padding_entries_count_for_nothing() -> None:
    theta, logq = _dists(7)
    logp = torch.log_softmax(theta, -1)
    top = torch.topk(logp, 4).indices
    valid = torch.tensor([True, True, True, False])
    garbage_p, garbage_q = logp[top].clone(), logq[top].clone()
    garbage_p[3], garbage_q[3] = float("nan"), float("-inf")
    c = centering_coefficients(garbage_p, garbage_q, valid, "token_truncate", 0.0, 3.0)
    want = centering_coefficients(logp[top[:3]], logq[top[:3]], valid[:3], "token_truncate",
                                  0.0, 3.0)
    assert c[3] == 0 and torch.allclose(c[:3], want)
    assert float(sampler_mass(garbage_q, valid)) == pytest.approx(float(logq[top[:3]].exp().sum()))


def test_sequence_modes_are_refused() -> None:
    one = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="token-level is_mode"):
        centering_coefficients(one, one, one > -1, "sequence_truncate", 0.0, 3.0)
