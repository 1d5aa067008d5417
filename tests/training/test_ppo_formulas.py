"""PPO's and the reward model's formulas (training/objectives/ppo_loss.py) against values worked
out by hand here, in float64, and their gradients against finite differences."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from training.objectives.ppo_loss import (
    AdaptiveKL,
    PolicyClip,
    bradley_terry,
    explained_variance,
    gae,
    kl_estimate,
    last_token_index,
    minibatch_order,
    policy_loss,
    token_rewards,
    value_loss,
    whiten,
)

EXACT = dict(rtol=0.0, atol=1e-12)


def t(*rows):
    """Rows of a (B, T) float64 tensor."""
    return torch.tensor(rows, dtype=torch.float64)


def v(values):
    """A (N,) float64 tensor."""
    return torch.tensor(values, dtype=torch.float64)


def test_gae_with_gamma_and_lambda():
    rewards, values, mask = t([0.0, 0.0, 1.0]), t([0.5, 0.4, 0.3]), t([1.0, 1.0, 1.0])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    a2 = 1.0 - 0.3  # the last token: no next value
    a1 = (0.9 * 0.3 - 0.4) + 0.9 * 0.8 * a2
    a0 = (0.9 * 0.4 - 0.5) + 0.9 * 0.8 * a1
    torch.testing.assert_close(advantages, t([a0, a1, a2]), **EXACT)
    torch.testing.assert_close(returns, t([a0 + 0.5, a1 + 0.4, a2 + 0.3]), **EXACT)


def test_masked_tokens_are_transparent_to_gae():
    # Token 1 is an observation: it neither discounts nor rewards, and carries the next advantage.
    rewards, values, mask = t([0.0, 0.0, 1.0]), t([0.5, 123.0, 0.3]), t([1.0, 0.0, 1.0])
    advantages, _ = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    a2 = 1.0 - 0.3
    a0 = (0.9 * 0.3 - 0.5) + 0.9 * 0.8 * a2
    torch.testing.assert_close(advantages, t([a0, a2, a2]), **EXACT)
    # ... the same as GAE over the sequence with the observation removed.
    dense, _ = gae(t([0.0, 1.0]), t([0.5, 0.3]), t([1.0, 1.0]), gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages[:, [0, 2]], dense, **EXACT)


def test_gae_ignores_padding_after_the_response():
    padded, _ = gae(t([0.0, 1.0, 0.0, 0.0]), t([0.5, 0.3, 9.0, 9.0]), t([1.0, 1.0, 0.0, 0.0]), gamma=1.0, lam=0.95)
    dense, _ = gae(t([0.0, 1.0]), t([0.5, 0.3]), t([1.0, 1.0]), gamma=1.0, lam=0.95)
    torch.testing.assert_close(padded[:, :2], dense, **EXACT)
    torch.testing.assert_close(padded[:, 2:], t([0.0, 0.0]), **EXACT)


def test_whitening_uses_the_unbiased_variance_over_response_tokens():
    x, mask = t([1.0, 2.0, 3.0, 6.0]), t([1.0, 1.0, 1.0, 1.0])
    std = math.sqrt((4 + 1 + 0 + 9) / 3)  # mean 3, n - 1 = 3
    torch.testing.assert_close(whiten(x, mask, eps=0.0), t([-2 / std, -1 / std, 0.0, 3 / std]), **EXACT)
    torch.testing.assert_close(whiten(x, mask, eps=0.0, shift_mean=False),
                               t([-2 / std + 3, -1 / std + 3, 3.0, 3 / std + 3]), **EXACT)
    masked = whiten(t([1.0, 2.0, 100.0, 3.0]), t([1.0, 1.0, 0.0, 1.0]), eps=0.0)  # mean 2, var (1 + 0 + 1) / 2
    torch.testing.assert_close(masked, t([-1.0, 0.0, 0.0, 1.0]), **EXACT)
    with pytest.raises(ValueError, match="at least 2 response tokens"):
        whiten(t([1.0, 2.0]), t([1.0, 0.0]))


def test_kl_estimators():
    logp, ref = v([-1.0]), v([-1.5])  # d = logp - ref = 0.5
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), v([0.5]), **EXACT)
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), v([0.125]), **EXACT)
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), v([math.exp(-0.5) + 0.5 - 1.0]), **EXACT)
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(logp, ref, "k4")


def test_token_rewards_put_the_score_on_the_last_response_token():
    kl, mask = t([0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.5, 0.5]), t([0, 1, 1, 0], [0, 0, 0, 0])
    rewards = token_rewards(kl, v([2.0, 7.0]), mask, kl_coef=0.5)
    torch.testing.assert_close(rewards, t([0.0, -0.1, -0.15 + 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]), **EXACT)
    assert last_token_index(mask).tolist() == [2, -1]


def test_policy_loss_at_and_beyond_the_clip():
    clip = PolicyClip(low=0.2, high=0.2)
    ratios = v([1.5, 0.5, 3.0, 1.0, 1.2])
    advantages = v([2.0, -1.0, -1.0, 1.0, 2.0])
    logp, old, mask = ratios.log(), torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
    loss, terms = policy_loss(logp, old, advantages, mask, clip)
    expected = [
        -2.0 * 1.2,  # A > 0 beyond 1 + eps: the clipped (larger) loss
        -(-1.0) * 0.8,  # A < 0 below 1 - eps: clipped at 0.8
        -(-1.0) * 3.0,  # A < 0 above the clip: unclipped (the larger)
        -1.0,  # ratio 1
        -2.0 * 1.2,  # exactly at the clip: both branches equal
    ]
    torch.testing.assert_close(loss, v(expected), rtol=0.0, atol=1e-12)
    assert terms["clipped"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(terms["approx_kl"], 0.5 * ratios.log() ** 2, **EXACT)


def test_dual_clip_caps_negative_advantages():
    ratios, advantages = v([3.0, 0.5, 3.0]), v([-1.0, -1.0, 1.0])
    ones = torch.ones(3, dtype=torch.float64)
    loss, terms = policy_loss(ratios.log(), 0 * ones, advantages, ones, PolicyClip(0.2, 0.2, dual=2.0))
    torch.testing.assert_close(loss, v([2.0, 0.8, -1.2]), rtol=0.0, atol=1e-12)  # 3 capped at -c A = 2
    assert terms["dual_clipped"].tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="dual clip"):
        PolicyClip(0.2, 0.2, dual=0.5)


def test_clipped_value_loss():
    values, old, returns = v([1.0, 1.0, 0.0]), v([0.5, 0.9, 1.0]), v([2.0, 0.0, 0.0])
    loss, clipped = value_loss(values, old, returns, torch.ones(3, dtype=torch.float64), clip=0.2)
    expected = [
        0.5 * max((1.0 - 2.0) ** 2, (0.7 - 2.0) ** 2),  # V moved beyond V_old + 0.2: the clipped error is larger
        0.5 * (1.0 - 0.0) ** 2,  # inside the clip
        0.5 * max(0.0, (0.8 - 0.0) ** 2),  # clip(V) = 0.8 is further from R than V = 0
    ]
    torch.testing.assert_close(loss, v(expected), **EXACT)
    assert clipped.tolist() == [1.0, 0.0, 1.0]


def test_explained_variance():
    returns, mask = v([1.0, 2.0, 3.0, 4.0]), v([1.0, 1.0, 1.0, 1.0])
    assert explained_variance(returns, returns, mask) == 1.0
    values = v([1.0, 2.0, 3.0, 3.0])  # error [0, 0, 0, 1]: var 0.25, var(R) = 5/3
    assert explained_variance(values, returns, mask) == pytest.approx(1 - 0.25 / (5 / 3), abs=1e-15)
    assert math.isnan(explained_variance(values, v([2.0, 2.0, 2.0, 2.0]), mask))


def test_bradley_terry_with_margin_and_centering():
    loss, terms = bradley_terry(v([1.0, -1.0]), v([0.5, 0.0]), margin=0.2, center=0.1)
    expected = [math.log1p(math.exp(-0.3)) + 0.1 * 1.5**2, math.log1p(math.exp(1.2)) + 0.1 * 1.0]
    torch.testing.assert_close(loss, v(expected), **EXACT)
    assert terms["accuracy"].tolist() == [1.0, 0.0]
    torch.testing.assert_close(terms["margin"], v([0.5, -1.0]), **EXACT)
    per_pair, _ = bradley_terry(v([1.0]), v([0.5]), margin=v([0.3]))
    torch.testing.assert_close(per_pair, v([math.log1p(math.exp(-0.2))]), **EXACT)


def test_bradley_terry_gradient_by_hand():
    chosen, rejected = v([1.0]).requires_grad_(), v([0.5]).requires_grad_()
    loss, _ = bradley_terry(chosen, rejected, margin=0.2, center=0.1)
    loss.sum().backward()
    sig = 1.0 / (1.0 + math.exp(-0.3))
    torch.testing.assert_close(chosen.grad, v([-(1 - sig) + 2 * 0.1 * 1.5]), **EXACT)
    torch.testing.assert_close(rejected.grad, v([(1 - sig) + 2 * 0.1 * 1.5]), **EXACT)


def test_gradients_match_finite_differences():
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]], dtype=torch.float64)
    old = torch.randn(1, 4, dtype=torch.float64)
    advantages = torch.tensor([[0.7, -1.3, 0.4, 2.0]], dtype=torch.float64)
    logp = (old + torch.tensor([[0.05, -0.03, 0.4, 0.02]], dtype=torch.float64)).requires_grad_()  # inside the clip
    assert torch.autograd.gradcheck(
        lambda x: policy_loss(x, old, advantages, mask, PolicyClip(0.2, 0.28, dual=3.0))[0], (logp,))
    values = torch.tensor([[0.3, 0.1, 0.0, -0.2]], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda v: value_loss(v, torch.zeros_like(v), torch.ones_like(v), mask, clip=10.0)[0], (values,))
    scores = torch.tensor([0.3, -0.8], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: bradley_terry(s[:1], s[1:], margin=0.1, center=0.05)[0], (scores,))
    gae_values = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    gae_mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda v: gae(torch.ones_like(v), v, gae_mask, gamma=0.9, lam=0.7)[0], (gae_values,))


def test_adaptive_kl_coefficient():
    controller = AdaptiveKL(coef=0.1, target=6.0, horizon=10_000)
    controller.update(kl=9.0, samples=64)  # error 0.5, clipped to 0.2
    assert controller.coef == 0.1 * (1 + 0.2 * 64 / 10_000)
    controller.update(kl=5.4, samples=100)  # error -0.1
    assert controller.coef == pytest.approx(0.1 * (1 + 0.2 * 64 / 10_000) * (1 - 0.1 * 100 / 10_000), rel=1e-15)
    restored = AdaptiveKL(coef=0.0, target=6.0, horizon=10_000)
    restored.load_state_dict(controller.state_dict())
    assert restored.coef == controller.coef


def test_minibatch_order_is_keyed_by_seed_step_and_epoch_alone():
    first = minibatch_order(7, 12, 0, 64)
    assert sorted(first.tolist()) == list(range(64))
    np.testing.assert_array_equal(first, minibatch_order(7, 12, 0, 64))
    assert not np.array_equal(first, minibatch_order(7, 12, 1, 64))
    assert not np.array_equal(first, minibatch_order(7, 13, 0, 64))
    assert not np.array_equal(first, minibatch_order(8, 12, 0, 64))
