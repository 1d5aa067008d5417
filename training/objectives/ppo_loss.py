"""PPO's and the reward model's formulas, as pure functions of tensors.

Notation: a rollout row holds a prompt and one sampled response; ``mask[t]`` is 1 on the
response's sampled tokens (the tokens the policy chose) and 0 elsewhere (prompt, padding, and
later the observations of a multi-turn episode). ``logp`` is the log-probability of token ``t``
under the policy being trained, ``old`` under the policy that sampled it, ``ref`` under the
frozen reference; ``V`` is the critic's value at token ``t``.

- **KL estimators** (per sampled token, ``d = logp - ref``): ``k1 = d``; ``k2 = d^2 / 2``;
  ``k3 = exp(-d) + d - 1`` (>= 0).
- **Per-token rewards**: ``r_t = -beta * kl_t`` on response tokens, plus the sequence score at
  the response's last token; 0 off the mask.
- **GAE** (gamma, lambda) over response tokens only, backwards in time:
  ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lambda * A_next``, where
  ``V_next`` and ``A_next`` are those of the next *response* token (0 after the last). A token
  off the mask is transparent: it gets ``A_next`` (the advantage of the next response token)
  and passes ``V_next`` and ``A_next`` on unchanged, so the tool observations of a multi-turn
  episode neither discount nor reward. Returns ``R_t = A_t + V_t``.
- **Whitening**: ``(A - mean) / sqrt(var + eps)`` over the response tokens, ``var`` the unbiased
  variance (divide by n - 1); ``shift_mean=False`` adds the mean back (scale only).
- **Policy loss**: ``rho = exp(logp - old)``; ``l = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))``;
  with a dual clip ``c > 1``, for ``A < 0`` the loss is capped at ``-c A``: ``min(l, -c A)``.
- **Value loss**: ``0.5 * max((V - R)^2, (clip(V, V_old - eps_v, V_old + eps_v) - R)^2)``.
- **Bradley-Terry** (reward model): ``-log sigmoid(r_chosen - r_rejected - m) + c (r_chosen + r_rejected)^2``,
  ``m`` the margin (per pair or fixed), ``c`` the centering coefficient.

Every function returns per-token (or per-pair) values; the objective sums them and the loop
divides by the global count, so neither micro-batches nor ranks change a loss.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from core.exceptions import ConfigError

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs."""
    d = logp - ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"KL estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 mask -> (B,) index of each row's last masked-in token (-1 for an empty row)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).amax(dim=1)


def token_rewards(kl: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """kl, mask (B, T); scores (B,) -> r (B, T): ``-kl_coef * kl`` on response tokens, plus each
    row's score at its last response token. A row without response tokens gets nothing."""
    mask_f = mask.to(kl.dtype)
    rewards = -kl_coef * kl * mask_f
    last = last_token_index(mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    return rewards.index_put((rows, last[rows]), scores.to(kl.dtype)[rows], accumulate=True)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards, values, mask (B, T) -> (advantages, returns), each (B, T), 0 where no response
    token follows. Tokens off the mask are transparent (see the module's docstring)."""
    keep = mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_adv = torch.where(keep[:, t], adv, next_adv)
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        advantages[:, t] = next_adv
    returns = advantages + values * mask.to(values.dtype)
    return advantages, returns


def masked_mean_var(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased variance (divide by n - 1) of x over the masked-in entries."""
    mask_f = mask.to(x.dtype)
    n = mask_f.sum()
    if n < 2:
        raise ValueError(f"whitening needs at least 2 response tokens, got {int(n)}")
    mean = (x * mask_f).sum() / n
    var = (((x - mean) * mask_f) ** 2).sum() / (n - 1)
    return mean, var


def whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the response tokens (unbiased var); 0 off the mask.
    ``shift_mean=False`` keeps the mean: x scaled only."""
    mean, var = masked_mean_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)


@dataclass(frozen=True)
class PolicyClip:
    low: float  # eps_low: ratios below 1 - low are clipped
    high: float  # eps_high
    dual: float = 0.0  # c > 1 caps the loss of negative advantages at -c A; 0 is off

    def __post_init__(self) -> None:
        if self.dual and self.dual <= 1.0:
            raise ValueError(f"the dual clip must be > 1 (or 0 for off), got {self.dual}")


def policy_loss(logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip: PolicyClip) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate per token (0 off the mask) and per-token indicators for metrics:
    ``clipped`` (the clipped branch was taken), ``dual_clipped`` and ``approx_kl``
    (``0.5 (logp - old)^2``)."""
    mask_f = mask.to(logp.dtype)
    log_ratio = (logp - old) * mask_f
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip.low, 1.0 + clip.high)
    loss = torch.maximum(unclipped, clipped)
    terms = {"clipped": (clipped > unclipped).to(logp.dtype) * mask_f}
    if clip.dual:
        cap = -clip.dual * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        terms["dual_clipped"] = dual.to(logp.dtype) * mask_f
    terms["approx_kl"] = 0.5 * log_ratio * log_ratio
    return loss * mask_f, terms


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss per token (0 off the mask) and the per-token clipped indicator."""
    mask_f = mask.to(values.dtype)
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    plain = (values - returns) ** 2
    capped = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(plain, capped)
    return loss * mask_f, (capped > plain).to(values.dtype) * mask_f


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - var(R - V) / var(R)`` over the response tokens (nan when the returns do not vary)."""
    _, var_returns = masked_mean_var(returns, mask)
    _, var_error = masked_mean_var(returns - values, mask)
    if float(var_returns) == 0.0:
        return math.nan
    return float(1.0 - var_error / var_returns)


@dataclass
class AdaptiveKL:
    """The KL coefficient that steers the measured KL toward ``target`` (Ziegler et al.'s rule):
    ``e = clip(kl / target - 1, -0.2, 0.2)``, ``coef *= 1 + e * n / horizon`` after ``n`` samples.
    With ``n <= horizon`` (checked: ``objective.ppo.kl_horizon`` against the completions per step)
    the factor lies in [0.8, 1.2], so the coefficient stays positive; it is held inside the
    positive normal floats, so a long run of steps at one clip bound neither rounds it to 0 nor
    to inf, and a step whose KL is not finite (a skipped step) leaves it as it was.
    Its state (one float) goes into the checkpoint with the objective's state."""

    coef: float
    target: float
    horizon: int

    def update(self, kl: float, samples: int) -> None:
        if samples > self.horizon:  # validate() refuses such a config; a factor could reach <= 0
            raise ConfigError(
                f"objective.ppo.kl_horizon={self.horizon} is below the {samples} completions of a step: "
                f"the adaptive KL coefficient's factor 1 + e * {samples} / {self.horizon} can reach <= 0",
                key="objective.ppo.kl_horizon", hint=f"set objective.ppo.kl_horizon >= {samples}")
        if not math.isfinite(kl):
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.coef = min(max(self.coef * (1.0 + error * samples / self.horizon), sys.float_info.min),
                        sys.float_info.max)

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])


def minibatch_order(seed: int, step: int, epoch: int, rows: int) -> np.ndarray:
    """The order of a rollout batch's rows in PPO epoch ``epoch`` of step ``step``: a permutation
    keyed by (seed, step, epoch) alone, so it depends on neither the number of ranks nor a resume."""
    generator = np.random.Generator(np.random.Philox(key=np.array([seed, step * 65_537 + epoch], dtype=np.uint64)))
    return generator.permutation(rows)


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor, *, margin: torch.Tensor | float = 0.0,
                  center: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scores (P,) -> per-pair loss ``-log sigmoid(chosen - rejected - margin) + center (chosen + rejected)^2``
    and per-pair ``accuracy`` (chosen scored strictly higher) and ``margin`` (chosen - rejected)."""
    gap = chosen - rejected
    loss = -F.logsigmoid(gap - margin)
    if center:
        loss = loss + center * (chosen + rejected) ** 2
    return loss, {"accuracy": (gap > 0).to(chosen.dtype), "margin": gap.detach()}
