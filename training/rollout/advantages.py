"""From a rollout's rewards to the advantages the policy loss weighs its completions by.

Notation: a prompt's group holds ``G`` completions ``o_1..o_G`` with scores ``r_i`` (the
environment's rewards).

- **Overlong shaping** (DAPO, objective.grpo.overlong_buffer ``B`` > 0): with ``L = max_new_tokens``,
  ``r_i += 0`` if ``|o_i| <= L - B``, else ``((L - B) - |o_i|) / B`` (-1 at ``|o_i| = L``), before
  the advantages.
- **Advantage** (group-normalized, one per completion):
  ``A_i = (r_i - mean(r)) / (std(r) + eps)``, ``eps`` = objective.grpo.std_eps, ``std`` per
  objective.grpo.advantage_std: ``population`` (the default) ``sqrt(sum((r - mean(r))^2) / G)``, no
  Bessel correction; ``unbiased`` ``sqrt(sum((r - mean(r))^2) / (G - 1))``, TRL's choice (torch's
  ``std``), larger by ``sqrt(G / (G - 1))`` (1.069 at G = 8), so its advantages are smaller by
  about that factor; ``none`` (Dr. GRPO) ``A_i = r_i - mean(r)``, not divided, so a group with a
  small spread of rewards is not scaled up. A group whose rewards are all equal has ``A = 0``: it
  teaches nothing.

Everything here is float64 on the host: the same numbers on every rank and world size.
"""

from __future__ import annotations

import numpy as np

STD_DIVISOR_OFFSET = {"population": 0, "unbiased": 1}  # std divides the squared deviations by G - offset
ADVANTAGE_SCALES = (*STD_DIVISOR_OFFSET, "none")


def group_advantages(rewards: np.ndarray, *, eps: float, std: str = "population") -> np.ndarray:
    """rewards (P, G) -> advantages (P, G), float64: ``(r - mean) / (std + eps)`` per row, ``std`` the
    ``population`` (divide by G) or ``unbiased`` (divide by G - 1) standard deviation; with
    ``std="none"`` (Dr. GRPO) ``r - mean``."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if std not in ADVANTAGE_SCALES:
        raise ValueError(f"std must be one of {sorted(ADVANTAGE_SCALES)}, got {std!r}")
    mean = rewards.mean(axis=1, keepdims=True)
    if std == "none":
        return rewards - mean
    group = rewards.shape[1]
    if group - STD_DIVISOR_OFFSET[std] < 1:
        raise ValueError(f"the {std} standard deviation needs groups of at least 2, got {group}")
    squares = ((rewards - mean) ** 2).sum(axis=1, keepdims=True)
    deviation = np.sqrt(squares / (group - STD_DIVISOR_OFFSET[std]))
    return (rewards - mean) / (deviation + eps)


def overlong_penalty(lengths: np.ndarray, *, max_new_tokens: int, buffer: int) -> np.ndarray:
    """DAPO's soft overlong penalty per completion length, float64: 0 up to ``max_new_tokens - buffer``
    tokens, then falling linearly by ``1 / buffer`` per token to -1 at ``max_new_tokens``; 0 everywhere
    when ``buffer`` is 0 (off)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if buffer == 0:
        return np.zeros_like(lengths)
    start = max_new_tokens - buffer
    return -np.clip(lengths - start, 0.0, None) / buffer
