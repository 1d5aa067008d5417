"""GRPO's policy loss, as pure functions of tensors (training/objectives/grpo.py drives them; the
advantages it weighs completions by come from training/rollout/advantages.py).

Notation: a prompt's group holds ``G`` completions ``o_1..o_G`` with advantages ``A_i``; completion
``i`` has ``|o_i|`` tokens, ``logp_{i,t}`` under the policy being trained, ``old_{i,t}`` under the
policy that sampled it (the sampler's log-probs) and ``ref_{i,t}`` under the frozen reference.

- **Ratio**: ``token``: ``rho_{i,t} = exp(logp_{i,t} - old_{i,t})``; ``sequence`` (GSPO):
  ``s_i = exp(mean_t(logp_{i,t} - old_{i,t}))``, one length-normalized ratio per completion,
  used for each of its tokens.
- **Per-token loss**: ``l_{i,t} = -min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i) + beta k3_{i,t}``,
  ``k3_{i,t} = exp(ref - logp) - (ref - logp) - 1`` (>= 0, an unbiased estimate of
  KL(policy || reference) per sampled token), ``beta`` = objective.grpo.kl_coef.
- **Normalization** (objective.grpo.loss_norm): ``sequence``: ``L = (1/N) sum_i (1/|o_i|) sum_t l_{i,t}``
  over the N completions of the global batch (GRPO as published: long and short completions
  weigh the same); ``token``: ``L = (1 / sum_i |o_i|) sum_i sum_t l_{i,t}`` (DAPO, TRL's ``dapo``:
  each token weighs the same, so long completions are not under-weighted); ``dr_grpo``:
  ``L = (1 / (N * max_new_tokens)) sum_i sum_t l_{i,t}`` (a constant normalizer: no length bias
  at all). The functions here return the *sum* and the loop divides by the global count
  (completions, tokens or completions x max_new_tokens), so micro-batches and ranks do not change L.
  A completion masked as truncated (objective.grpo.mask_truncated) has no loss tokens and is
  not counted among the N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SurrogateSettings:
    clip_low: float
    clip_high: float
    kl_coef: float
    importance: str  # token | sequence
    loss_norm: str  # sequence | token


def per_token_loss(logps: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None, advantages: torch.Tensor,
                   mask: torch.Tensor, s: SurrogateSettings,
                   weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """logps, old, ref, mask (B, T); advantages (B,) -> per-token loss (B, T) (0 off the mask) and
    per-token terms for metrics: ``clipped`` (the clipped branch was taken), ``kl`` (k3).
    ``weights`` (B, T), detached, multiply the surrogate term only, not the KL penalty (rollout
    correction's importance weights, rollout_correction.py); None: unweighted."""
    mask_f = mask.to(logps.dtype)
    delta = (logps - old) * mask_f
    if s.importance == "sequence":
        lengths = mask_f.sum(dim=1).clamp_min(1.0)
        log_ratio = (delta.sum(dim=1) / lengths)[:, None].expand_as(logps)  # (B, T), one value per row
    else:
        log_ratio = delta
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logps.dtype)[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - s.clip_low, 1.0 + s.clip_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    loss = -surrogate if weights is None else -surrogate * weights
    terms = {"clipped": (clipped < unclipped).to(logps.dtype) * mask_f}
    if ref is not None and s.kl_coef > 0:
        diff = (ref - logps) * mask_f
        k3 = torch.exp(diff) - diff - 1.0
        loss = loss + s.kl_coef * k3
        terms["kl"] = k3 * mask_f
    return loss * mask_f, terms


def loss_count(mask: torch.Tensor, loss_norm: str, *, max_new_tokens: int) -> int:
    """The units this micro-batch adds to the global normalizer: completions with loss tokens
    (``sequence``), loss tokens (``token``) or completions with loss tokens x ``max_new_tokens``
    (``dr_grpo``). A completion without loss tokens (masked as truncated) counts nowhere."""
    if loss_norm == "token":
        return int(mask.sum())
    completions = int(mask.any(dim=1).sum())
    return completions * max_new_tokens if loss_norm == "dr_grpo" else completions


def reduce_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_norm: str) -> torch.Tensor:
    """The loss *sum* over this micro-batch: per-completion means summed (``sequence``) or token
    losses summed (``token``, ``dr_grpo``); the loop divides by the global ``loss_count``."""
    if loss_norm == "sequence":
        lengths = mask.sum(dim=1).clamp_min(1).to(per_token.dtype)
        return (per_token.sum(dim=1) / lengths).sum()
    return per_token.sum()


def reduce_metric(values: torch.Tensor, mask: torch.Tensor, loss_norm: str, *, max_new_tokens: int) -> torch.Tensor:
    """A per-token metric summed so that sum / count (``loss_count``) is its mean per token
    (``token``) or per completion of its token means (``sequence``, and ``dr_grpo``, whose count
    holds max_new_tokens slots per completion: a mean per slot would shrink with short completions)."""
    if loss_norm == "token":
        return values.sum()
    lengths = mask.sum(dim=1).clamp_min(1).to(values.dtype)
    per_completion = values.sum(dim=1) / lengths
    return (per_completion * max_new_tokens).sum() if loss_norm == "dr_grpo" else per_completion.sum()
