"""Preference losses against values worked out from each paper's formula with ``math``."""

from __future__ import annotations

import math

import pytest
import torch

from core.exceptions import ConfigError, DataError
from training.objectives import preference_loss as pl
from training.objectives.preference_loss import SequenceLogps


def _t(*values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


# Two pairs: summed log-probs of chosen/rejected under the policy and the reference.
POLICY = SequenceLogps(_t(-4.0, -10.0), _t(-6.0, -9.0), _t(4, 5), _t(3, 6))
REFERENCE = SequenceLogps(_t(-5.0, -9.5), _t(-5.5, -9.0), _t(4, 5), _t(3, 6))


def test_dpo_sigmoid_by_hand():
    beta = 0.1
    losses, m = pl.sigmoid(POLICY, REFERENCE, beta=beta)
    # pair 0: h = (-4 + 5) - (-6 + 5.5) = 1.5; pair 1: h = (-10 + 9.5) - (-9 + 9) = -0.5
    expected = [-_logsig(beta * 1.5), -_logsig(beta * -0.5)]
    torch.testing.assert_close(losses, _t(*expected), rtol=0, atol=1e-15)
    torch.testing.assert_close(m.chosen_rewards, _t(0.1, -0.05))
    torch.testing.assert_close(m.rejected_rewards, _t(-0.05, 0.0))
    torch.testing.assert_close(m.margins, _t(0.15, -0.05))
    assert m.accuracies.tolist() == [1.0, 0.0]


def test_conservative_dpo_label_smoothing_by_hand():
    beta, eps = 0.5, 0.2
    losses, _ = pl.sigmoid(POLICY, REFERENCE, beta=beta, label_smoothing=eps)
    expected = [-(1 - eps) * _logsig(beta * h) - eps * _logsig(-beta * h) for h in (1.5, -0.5)]
    torch.testing.assert_close(losses, _t(*expected), rtol=0, atol=1e-15)


def test_ipo_by_hand_length_normalized_and_summed():
    beta = 0.25  # target gap 1 / (2 beta) = 2
    losses, m = pl.ipo(POLICY, REFERENCE, beta=beta)
    # pair 0: chosen (-4 + 5) / 4 = 0.25, rejected (-6 + 5.5) / 3 = -1/6
    # pair 1: chosen (-10 + 9.5) / 5 = -0.1, rejected 0 / 6 = 0
    h = [0.25 + 1 / 6, -0.1]
    torch.testing.assert_close(losses, _t(*[(x - 2.0) ** 2 for x in h]), rtol=0, atol=1e-15)
    torch.testing.assert_close(m.chosen_rewards, _t(0.25, -0.1))
    torch.testing.assert_close(m.rejected_rewards, _t(-1 / 6, 0.0))
    summed, _ = pl.ipo(POLICY, REFERENCE, beta=beta, length_normalized=False)
    torch.testing.assert_close(summed, _t((1.5 - 2.0) ** 2, (-0.5 - 2.0) ** 2), rtol=0, atol=1e-15)


def test_simpo_by_hand():
    beta, gamma = 2.0, 0.5
    losses, m = pl.simpo(POLICY, beta=beta, gamma=gamma)
    # pair 0: 2 * -4/4 = -2 vs 2 * -6/3 = -4; pair 1: 2 * -10/5 = -4 vs 2 * -9/6 = -3
    expected = [-_logsig(-2.0 + 4.0 - 0.5), -_logsig(-4.0 + 3.0 - 0.5)]
    torch.testing.assert_close(losses, _t(*expected), rtol=0, atol=1e-15)
    torch.testing.assert_close(m.margins, _t(2.0, -1.0))
    assert m.accuracies.tolist() == [1.0, 0.0]


def test_orpo_by_hand():
    lam = 0.3
    losses, m = pl.orpo(POLICY, lam=lam)

    def log_odds(mean_logp):
        p = math.exp(mean_logp)
        return math.log(p / (1 - p))

    expected = []
    for lc, lr in ((-1.0, -2.0), (-2.0, -1.5)):
        expected.append(-lc - lam * _logsig(log_odds(lc) - log_odds(lr)))
    torch.testing.assert_close(losses, _t(*expected), rtol=1e-13, atol=0)
    torch.testing.assert_close(m.chosen_rewards, _t(log_odds(-1.0), log_odds(-2.0)), rtol=1e-13, atol=0)


def test_orpo_log_odds_accurate_at_both_ends():
    # near 0: p = exp(-1e-8) -> odds ~ 1e8; far: p = exp(-40) -> log odds ~ -40
    policy = SequenceLogps(_t(-1e-8, -40.0), _t(-40.0, -1e-8), _t(1, 1), _t(1, 1))
    _, m = pl.orpo(policy, lam=1.0)
    near = -1e-8 - math.log(-math.expm1(-1e-8))
    far = -40.0 - math.log1p(-math.exp(-40.0))
    torch.testing.assert_close(m.chosen_rewards, _t(near, far), rtol=1e-12, atol=0)
    # probability 1 (mean log-prob 0) is clamped, not infinite
    edge = SequenceLogps(_t(0.0), _t(-1.0), _t(2), _t(2))
    losses, _ = pl.orpo(edge, lam=1.0)
    assert torch.isfinite(losses).all()


def test_identical_chosen_and_rejected():
    same = SequenceLogps(_t(-3.0, -7.0), _t(-3.0, -7.0), _t(3, 7), _t(3, 7))
    ref = SequenceLogps(_t(-2.0, -8.0), _t(-2.0, -8.0), _t(3, 7), _t(3, 7))
    beta = 0.1
    dpo, m = pl.sigmoid(same, ref, beta=beta)
    torch.testing.assert_close(dpo, torch.full((2,), math.log(2.0), dtype=torch.float64))
    assert m.margins.tolist() == [0.0, 0.0] and m.accuracies.tolist() == [0.0, 0.0]
    ipo_losses, _ = pl.ipo(same, ref, beta=beta)
    torch.testing.assert_close(ipo_losses, torch.full((2,), (1 / (2 * beta)) ** 2, dtype=torch.float64))
    simpo_losses, _ = pl.simpo(same, beta=2.0, gamma=0.5)
    torch.testing.assert_close(simpo_losses, torch.full((2,), -_logsig(-0.5), dtype=torch.float64))
    orpo_losses, _ = pl.orpo(same, lam=0.5)
    torch.testing.assert_close(orpo_losses, _t(1.0 + 0.5 * math.log(2), 1.0 + 0.5 * math.log(2)))


def _random_pairs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(4, 4, generator=gen, dtype=torch.float64) * 20 - 0.05
    counts = torch.randint(1, 12, (2, 4), generator=gen)
    return logps.requires_grad_(), counts


@pytest.mark.parametrize(
    "loss",
    [
        lambda p, r: pl.sigmoid(p, r, beta=0.3)[0],
        lambda p, r: pl.sigmoid(p, r, beta=0.3, label_smoothing=0.1)[0],
        lambda p, r: pl.ipo(p, r, beta=0.1)[0],
        lambda p, r: pl.ipo(p, r, beta=0.1, length_normalized=False)[0],
        lambda p, r: pl.simpo(p, beta=2.5, gamma=1.0)[0],
        lambda p, r: pl.orpo(p, lam=0.2)[0],
    ],
    ids=["dpo", "cdpo", "ipo", "ipo-summed", "simpo", "orpo"],
)
def test_gradcheck(loss):
    logps, counts = _random_pairs(1)

    def fn(values):
        policy = SequenceLogps(values[0], values[1], counts[0], counts[1])
        reference = SequenceLogps(values[2], values[3], counts[0], counts[1])
        return loss(policy, reference)

    assert torch.autograd.gradcheck(fn, (logps,))


def test_orpo_gradcheck_across_the_log1mexp_split():
    # mean log-probs on both sides of -log 2, and very close to 0
    values = _t(-0.01, -0.5, -0.8, -3.0, -1e-4, -30.0).reshape(2, 3).requires_grad_()
    ones = torch.ones(3, dtype=torch.int64)
    assert torch.autograd.gradcheck(lambda v: pl.orpo(SequenceLogps(v[0], v[1], ones, ones), lam=0.7)[0], (values,))


def test_bad_arguments_are_rejected():
    with pytest.raises(ConfigError, match="beta"):
        pl.sigmoid(POLICY, REFERENCE, beta=0.0)
    with pytest.raises(ConfigError, match="label_smoothing"):
        pl.sigmoid(POLICY, REFERENCE, beta=0.1, label_smoothing=0.5)
    empty = SequenceLogps(_t(-1.0), _t(-2.0), _t(0), _t(3))
    with pytest.raises(DataError, match="no tokens"):
        pl.simpo(empty, beta=1.0, gamma=0.0)
    with pytest.raises(ValueError, match="chosen_tokens"):
        pl.simpo(SequenceLogps(_t(-1.0), _t(-2.0)), beta=1.0, gamma=0.0)


def test_chosen_nll_by_hand_and_its_gradient():
    # RPO's term: per pair, minus the chosen completion's summed log-prob over its token count.
    nll = pl.chosen_nll(POLICY)
    torch.testing.assert_close(nll, _t(4.0 / 4, 10.0 / 5), rtol=0, atol=1e-15)
    # DPO + nll_coef * NLL, as objective.dpo.nll_coef adds it, and its gradient by hand:
    # d/dπc [-log σ(β h) + c (-πc / |c|)] = -β σ(-β h) - c / |c|; d/dπr = β σ(-β h); nothing else moves.
    beta, coef = 0.1, 2.0
    chosen = POLICY.chosen.clone().requires_grad_(True)
    rejected = POLICY.rejected.clone().requires_grad_(True)
    policy = SequenceLogps(chosen, rejected, POLICY.chosen_tokens, POLICY.rejected_tokens)
    losses, _ = pl.sigmoid(policy, REFERENCE, beta=beta)
    total = (losses + coef * pl.chosen_nll(policy)).mean()
    h = [1.5, -0.5]
    expected = sum(-_logsig(beta * x) for x in h) / 2 + coef * (1.0 + 2.0) / 2
    assert float(total.detach()) == pytest.approx(expected, abs=1e-14)
    total.backward()
    sig = [1.0 / (1.0 + math.exp(beta * x)) for x in h]  # σ(-β h)
    torch.testing.assert_close(chosen.grad, _t(*[(-beta * s - coef / n) / 2 for s, n in zip(sig, (4, 5))]),
                               rtol=0, atol=1e-15)
    torch.testing.assert_close(rejected.grad, _t(*[beta * s / 2 for s in sig]), rtol=0, atol=1e-15)
