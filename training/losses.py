"""Losses as pluggable components.

A loss receives the model's logits and the batch and returns the *sum* of per-token losses
and the number of tokens it counted. The step normalizes by the target tokens of the whole
global batch, so neither accumulation nor world size changes the math. Later methods (SFT
masks, DPO, distillation) add their own ``Loss`` without touching the step.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


class Loss(Protocol):
    def __call__(self, logits: torch.Tensor, batch) -> torch.Tensor:
        """Sum of per-token losses over the batch (fp32 scalar)."""
        ...

    def num_targets(self, batch) -> int:
        """How many tokens the sum runs over."""
        ...


class CausalLMLoss:
    """Next-token cross entropy, computed in fp32 over labels that are not IGNORE_INDEX."""

    def __call__(self, logits: torch.Tensor, batch) -> torch.Tensor:
        labels = batch.labels.to(logits.device)
        return F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),  # (B*T, V)
            labels.reshape(-1),  # (B*T,)
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    def num_targets(self, batch) -> int:
        return int((batch.labels != IGNORE_INDEX).sum())
