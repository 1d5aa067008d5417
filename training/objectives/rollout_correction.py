"""Rollout correction for GRPO and PPO: truncated (TIS) and masked (MIS) importance sampling
between the sampler's log-probs and the trainer's, as pure functions of tensors.

Where the sampler's log-probs are the trainer's bit for bit (``determinism.mode: bitwise``) the
rollouts are on-policy and nothing needs correcting. Where they are not (``fast`` mode's
kernels, rollouts sampled by another engine) every sampled token comes from ``pi_rollout`` while
the loss assumes ``pi_train``; the settings (``objective.<grpo|ppo>.rollout_correction``,
rollout_correction_settings.py) turn on the corrections below. grpo.py and ppo.py call them:
``prepare`` computes ``pi_train`` (the trainer's forward with the weights that sampled) and
``correction_extras``; ``loss`` multiplies the policy-gradient term by ``policy_weights`` and
adds ``mismatch_sums`` to its metrics; ``ledger_fields`` turns those into ``correction_fields``.

Notation, per completion ``i`` and sampled token ``t`` (``mask``): ``train_{i,t}`` the
trainer's log-prob (the old policy of the clipped ratio), ``rollout_{i,t}`` the sampler's, and
``d_{i,t} = train_{i,t} - rollout_{i,t}`` (0 off the mask).

- **TIS** (``tis_cap = C``): ``w_{i,t} = min(exp(d_{i,t}), C)``, detached; a token is *clipped*
  where ``exp(d) > C``.
- **MIS** (``mis``, ``[low, high]``): the completion's log-ratio ``s_i = sum_t d_{i,t}``
  (``product``: the sequence's likelihood ratio) or ``(1 / |o_i|) sum_t d_{i,t}`` (``geometric``:
  the geometric mean of its token ratios); it is kept where ``log low <= s_i <= log high``
  (``keep_i``; a completion without sampled tokens has ``s_i = 0`` and is kept). ``s_i`` is
  summed on the host in exact arithmetic (``math.fsum``), so the decision depends on the
  completion's own log-probs only, not on its neighbours or the world size.
- The policy-gradient term of token ``t`` of completion ``i`` is multiplied by
  ``w_{i,t} keep_i`` (``w = 1`` without TIS, ``keep = 1`` without MIS). GRPO's KL penalty and
  PPO's value loss are not weighted, and the loss's normalizer is not changed: a masked
  completion still counts in it, contributing nothing to the policy gradient.

The ledger gets, only with a correction on: ``rollout_logp_diff_mean`` and
``rollout_logp_diff_max`` (mean and max ``|d|`` over the sampled tokens), with TIS
``tis_clipped_fraction`` (of the sampled tokens) and with MIS ``mis_masked_fraction`` (of the
completions with sampled tokens).
"""

from __future__ import annotations

import math

import torch

from training.objectives.rollout_correction_settings import RolloutCorrectionSettings

ROLLOUT_LOGPS = "rollout_logps"  # the extra holding the sampler's log-probs (B, T)
KEEP = "rollout_keep"  # the extra holding MIS's decision per completion (B,) float32, 1 kept, 0 masked
ABS_DIFF, TOKENS, CLIPPED, MASKED, ROWS = ("rollout_abs_diff", "rollout_tokens", "tis_clipped", "mis_masked",
                                           "rollout_rows")  # the metric sums (LossOutput.metrics)
DIFF_MAX = "rollout_logp_diff_max"  # the maximum (LossOutput.maxima), also its ledger field


def token_weights(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                  cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TIS: (B, T) weights ``min(exp(train - rollout), cap)`` (0 off the mask) and the clipped
    indicator (``exp(d) > cap``, 0 off the mask), both without gradient."""
    mask_f = mask.to(train.dtype)
    ratio = torch.exp((train.detach() - rollout) * mask_f)
    return torch.clamp(ratio, max=cap) * mask_f, (ratio > cap).to(train.dtype) * mask_f


def sequence_log_ratios(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, kind: str) -> list[float]:
    """MIS: each completion's log-ratio ``s_i`` (module docstring), summed exactly on the host."""
    delta = (train.detach().double().cpu() - rollout.double().cpu())
    mask = mask.cpu()
    out = []
    for row, keep in zip(delta, mask):
        values = row[keep].tolist()
        total = math.fsum(values)
        out.append(total / len(values) if kind == "geometric" and values else total)
    return out


def sequence_keep(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                  settings: RolloutCorrectionSettings) -> torch.Tensor:
    """MIS: (B,) float32, 1 where the completion's ratio lies in [mis_low, mis_high], 0 where it leaves it."""
    low, high = math.log(settings.mis_low), math.log(settings.mis_high)
    ratios = sequence_log_ratios(train, rollout, mask, settings.mis)
    return torch.tensor([1.0 if low <= s <= high else 0.0 for s in ratios], dtype=torch.float32)


def correction_extras(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                      settings: RolloutCorrectionSettings) -> dict[str, torch.Tensor]:
    """What ``prepare`` adds to the rollout batch: ``old_logps`` (the trainer's: the clipped
    ratio's old policy), ``rollout_logps`` (the sampler's) and, with MIS, ``rollout_keep``."""
    extras = {"old_logps": train, ROLLOUT_LOGPS: rollout}
    if settings.mis is not None:
        extras[KEEP] = sequence_keep(train, rollout, mask, settings)
    return extras


def policy_weights(extras: dict[str, torch.Tensor], mask: torch.Tensor,
                   settings: RolloutCorrectionSettings) -> torch.Tensor:
    """(B, T) ``w keep`` multiplying each token's policy-gradient term (0 off the mask), from the
    placed batch's extras (``old_logps``, ``rollout_logps``, ``rollout_keep``)."""
    train, rollout = extras["old_logps"], extras[ROLLOUT_LOGPS]
    if settings.tis_cap is not None:
        weights, _ = token_weights(train, rollout, mask, settings.tis_cap)
    else:
        weights = mask.to(train.dtype)
    if settings.mis is not None:
        weights = weights * extras[KEEP].to(weights.dtype)[:, None]
    return weights


def mismatch_sums(extras: dict[str, torch.Tensor], mask: torch.Tensor,
                  settings: RolloutCorrectionSettings) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The micro-batch's metric sums (|d| summed over the sampled tokens and their count, the
    clipped tokens, the masked completions and the completions with sampled tokens) and its
    maximum ``|d|``, which the loop sums (maxes) over micro-batches and ranks."""
    train, rollout = extras["old_logps"].detach(), extras[ROLLOUT_LOGPS]
    mask_f = mask.to(train.dtype)
    diff = ((train - rollout) * mask_f).abs()
    sums = {ABS_DIFF: diff.sum(), TOKENS: mask_f.sum()}
    if settings.tis_cap is not None:
        sums[CLIPPED] = token_weights(train, rollout, mask, settings.tis_cap)[1].sum()
    if settings.mis is not None:
        rows = mask.any(dim=1).to(train.dtype)
        sums[MASKED] = (rows * (1.0 - extras[KEEP].to(train.dtype))).sum()
        sums[ROWS] = rows.sum()
    return sums, {DIFF_MAX: diff.max() if diff.numel() else diff.new_zeros(())}


def correction_fields(totals: dict[str, float], settings: RolloutCorrectionSettings) -> dict[str, float]:
    """The ledger fields from the step's summed metrics and maxima (module docstring)."""
    tokens = max(totals[TOKENS], 1.0)
    fields = {"rollout_logp_diff_mean": totals[ABS_DIFF] / tokens, DIFF_MAX: totals[DIFF_MAX]}
    if settings.tis_cap is not None:
        fields["tis_clipped_fraction"] = totals[CLIPPED] / tokens
    if settings.mis is not None:
        fields["mis_masked_fraction"] = totals[MASKED] / max(totals[ROWS], 1.0)
    return fields
