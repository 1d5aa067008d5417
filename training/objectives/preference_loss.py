"""Preference losses over per-sequence log-probabilities: DPO (sigmoid), IPO, SimPO and ORPO.

Every function takes the *summed* log-probability of each pair's chosen and rejected
completion (only the completion's tokens, never the prompt's) and, where the formula needs
it, the number of those tokens. Nothing here sees logits, so the same functions serve a
plain forward, a chunked one, or log-probs of a reference computed ahead of time.

Notation, per pair: ``πc``/``πr`` the policy's summed log-probs of chosen/rejected,
``ρc``/``ρr`` the reference's, ``|c|``/``|r|`` the completion lengths in tokens, σ the
logistic function.

Each returns ``(losses, metrics)``: ``losses`` is (B,) with one loss per pair (the caller
reduces, e.g. the mean over the global batch's pairs), ``metrics`` holds per-pair detached
tensors (``chosen_rewards``, ``rejected_rewards``, ``margins``, ``accuracies``) so they can
be summed over micro-batches and ranks before dividing. A variant's *reward* is the
per-sequence score whose chosen-minus-rejected difference its loss acts on (given for each
below); ``accuracies`` is 1 where the chosen reward is strictly larger, ties count as 0.

All arithmetic is in the inputs' dtype; pass fp32 (or fp64) log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.exceptions import ConfigError, DataError


@dataclass(frozen=True)
class SequenceLogps:
    """Summed completion log-probs of a batch of pairs under one model, (B,) each."""

    chosen: torch.Tensor
    """Sum over the chosen completion's tokens of log p(token | prefix)."""
    rejected: torch.Tensor
    """Same for the rejected completion."""
    chosen_tokens: torch.Tensor | None = None
    """Number of chosen completion tokens (needed by the length-normalized variants)."""
    rejected_tokens: torch.Tensor | None = None
    """Number of rejected completion tokens."""

    def mean_per_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) log-probs divided by their token counts."""
        if self.chosen_tokens is None or self.rejected_tokens is None:
            raise ValueError("this preference loss needs chosen_tokens and rejected_tokens")
        counts = torch.stack([self.chosen_tokens, self.rejected_tokens])
        if bool((counts <= 0).any()):
            raise DataError(
                "a preference pair has a completion with no tokens",
                hint="check that prompts leave room for the completion within data.seq_len",
            )
        counts = counts.to(self.chosen.dtype)
        return self.chosen / counts[0], self.rejected / counts[1]


@dataclass(frozen=True)
class PreferenceMetrics:
    """Per-pair statistics, detached, (B,) each."""

    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracies(self) -> torch.Tensor:
        return (self.chosen_rewards > self.rejected_rewards).to(self.chosen_rewards.dtype)


def sigmoid(
    policy: SequenceLogps, reference: SequenceLogps, *, beta: float, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, PreferenceMetrics]:
    """DPO (Rafailov et al. 2023), with the conservative variant's label smoothing ε.

    ``h = (πc - ρc) - (πr - ρr)``;
    ``loss = -(1 - ε) · log σ(β·h) - ε · log σ(-β·h)`` (ε = 0 is plain DPO: the preference
    label is taken as flipped with probability ε). Reward: ``β · (π - ρ)`` of each completion.
    Summed (not length-normalized) log-probs, as in the paper.
    """
    _check_beta(beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ConfigError(
            f"label_smoothing must be in [0, 0.5), got {label_smoothing}",
            hint="it is the assumed probability that a preference label is flipped",
        )
    chosen = beta * (policy.chosen - reference.chosen)
    rejected = beta * (policy.rejected - reference.rejected)
    logits = chosen - rejected
    losses = -(1.0 - label_smoothing) * F.logsigmoid(logits)
    if label_smoothing:
        losses = losses - label_smoothing * F.logsigmoid(-logits)
    return losses, PreferenceMetrics(chosen.detach(), rejected.detach())


def ipo(
    policy: SequenceLogps, reference: SequenceLogps, *, beta: float, length_normalized: bool = True
) -> tuple[torch.Tensor, PreferenceMetrics]:
    """IPO (Azar et al. 2023): a squared loss that pulls the log-ratio gap to ``1 / (2β)``.

    ``h = (πc - ρc) - (πr - ρr)``, ``loss = (h - 1 / (2β))²``, β the paper's τ.
    With ``length_normalized`` (the default) every log-prob is first divided by its
    completion's token count (``πc/|c|``, ``ρc/|c|``, ...), as common implementations do:
    with summed log-probs the fixed target ``1/(2β)`` would mean a different per-token gap
    for every length. ``length_normalized=False`` is the paper's formula on summed log-probs.
    Reward: the (normalized) log-ratio ``π - ρ`` of each completion.
    """
    _check_beta(beta)
    if length_normalized:
        pc, pr = policy.mean_per_token()
        rc, rr = reference.mean_per_token()
    else:
        pc, pr, rc, rr = policy.chosen, policy.rejected, reference.chosen, reference.rejected
    chosen, rejected = pc - rc, pr - rr
    losses = (chosen - rejected - 1.0 / (2.0 * beta)) ** 2
    return losses, PreferenceMetrics(chosen.detach(), rejected.detach())


def simpo(policy: SequenceLogps, *, beta: float, gamma: float) -> tuple[torch.Tensor, PreferenceMetrics]:
    """SimPO (Meng et al. 2024): reference-free, on length-normalized log-probs, with a margin.

    ``loss = -log σ(β·πc/|c| - β·πr/|r| - γ)``, γ the target reward margin.
    Reward: ``β · π / |y|`` of each completion (so the margin metric excludes γ).
    """
    _check_beta(beta)
    mean_c, mean_r = policy.mean_per_token()
    chosen, rejected = beta * mean_c, beta * mean_r
    losses = -F.logsigmoid(chosen - rejected - gamma)
    return losses, PreferenceMetrics(chosen.detach(), rejected.detach())


def orpo(policy: SequenceLogps, *, lam: float) -> tuple[torch.Tensor, PreferenceMetrics]:
    """ORPO (Hong et al. 2024): chosen NLL plus λ times an odds-ratio term, no reference model.

    With ``ℓ = π / |y|`` a completion's mean per-token log-prob and ``p = exp(ℓ)``,
    ``log odds = log(p / (1 - p)) = ℓ - log(1 - exp(ℓ))`` (computed as ``log(-expm1(ℓ))`` or
    ``log1p(-exp(ℓ))``, whichever is accurate for ℓ, so it stays finite for ℓ → 0⁻ and
    ℓ → -∞). ``loss = -ℓc + λ · (-log σ(log odds_c - log odds_r))``: the first term is the
    chosen completion's mean per-token NLL, per pair (average the per-pair losses, not the
    tokens, to reduce). A completion with probability 1 (ℓ = 0) has infinite odds; ℓ is
    clamped to ``-1e-6`` (fp32) or ``-1e-12`` (fp64) below 0 before taking them.
    Reward: the log odds of each completion.
    """
    if lam < 0:
        raise ConfigError(f"ORPO's lambda must be >= 0, got {lam}")
    mean_c, mean_r = policy.mean_per_token()
    odds_c, odds_r = _log_odds(mean_c), _log_odds(mean_r)
    losses = -mean_c - lam * F.logsigmoid(odds_c - odds_r)
    return losses, PreferenceMetrics(odds_c.detach(), odds_r.detach())


def chosen_nll(policy: SequenceLogps) -> torch.Tensor:
    """The chosen completion's mean per-token negative log-likelihood, per pair: ``-πc / |c|``.

    RPO (Pang et al. 2024) adds ``nll_coef`` times this to each pair's preference loss, so that
    the preference term cannot buy its margin by pushing the chosen answer's probability down
    too (it anchors the chosen log-prob; objective.dpo.nll_coef). Normalized by the chosen
    completion's own length, so a long and a short answer weigh the same.
    """
    mean_c, _ = policy.mean_per_token()
    return -mean_c


def _log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) for p = exp(mean_logp) < 1."""
    ceiling = -1e-12 if mean_logp.dtype == torch.float64 else -1e-6
    x = mean_logp.clamp(max=ceiling)
    return x - _log1mexp(x)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0 (Mächler's split at -log 2: expm1 near 0, log1p far from it)."""
    near_zero = x > -math.log(2.0)
    # Each branch sees only inputs it is accurate (and finite) for, so neither the value
    # nor the gradient of the branch torch.where discards can be inf/nan.
    safe_near = torch.where(near_zero, x, torch.full_like(x, -1.0))
    safe_far = torch.where(near_zero, torch.full_like(x, -1.0), x)
    return torch.where(near_zero, torch.log(-torch.expm1(safe_near)), torch.log1p(-torch.exp(safe_far)))


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ConfigError(f"beta must be > 0, got {beta}", hint="typical values are 0.01 to 0.5 (DPO), 2 to 10 (SimPO)")
