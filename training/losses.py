"""Losses as pluggable components.

A loss receives the model's logits and the batch and returns the *sum* of per-token losses
and the number of tokens it counted. The step normalizes by the target tokens of the whole
global batch, so neither accumulation nor world size changes the math. Later methods (SFT
masks, DPO, distillation) add their own ``Loss`` without touching the step.

A loss that sets ``fuses_head`` also offers ``head_loss(hidden, weight, batch)``: the same
sum computed from the final hidden states and the output weight, so that it can apply the
output projection itself, chunk by chunk (training/linear_cross_entropy.py). The step uses
it where the output weight is a plain tensor (not under tensor parallelism or XLA).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from data.batch import IGNORE_INDEX
from training.linear_cross_entropy import linear_cross_entropy


class Loss(Protocol):
    def __call__(self, logits: torch.Tensor, batch) -> torch.Tensor:
        """Sum of per-token losses over the batch (fp32 scalar)."""
        ...

    def num_targets(self, batch) -> int:
        """How many tokens the sum runs over."""
        ...


class CausalLMLoss:
    """Next-token cross entropy, computed in fp32 over labels that are not IGNORE_INDEX.

    ``chunk_tokens > 0`` enables ``head_loss`` (the fused output projection) over chunks of
    that many tokens; ``compiled`` compiles its per-chunk kernel on CUDA. ``float8`` runs the
    head's matmuls in FP8 (``parallel.float8_head``).
    """

    def __init__(self, *, chunk_tokens: int = 0, compiled: bool = False, float8: bool = False) -> None:
        self.chunk_tokens = chunk_tokens
        self.compiled = compiled
        self.float8 = float8

    @property
    def fuses_head(self) -> bool:
        return self.chunk_tokens > 0

    def __call__(self, logits: torch.Tensor, batch) -> torch.Tensor:
        labels = batch.labels.to(logits.device)
        return F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),  # (B*T, V)
            labels.reshape(-1),  # (B*T,)
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    def head_loss(self, hidden: torch.Tensor, weight: torch.Tensor, batch) -> torch.Tensor:
        """The same sum from hidden (B, T, d) and the output weight (V, d)."""
        device_type = hidden.device.type
        autocast = torch.is_autocast_enabled(device_type)
        return linear_cross_entropy(
            hidden,
            weight,
            batch.labels.to(hidden.device, non_blocking=True),
            chunk_tokens=self.chunk_tokens,
            compute_dtype=torch.get_autocast_dtype(device_type) if autocast else None,
            compiled=self.compiled,
            float8=self.float8,
        )

    def num_targets(self, batch) -> int:
        return int((batch.labels != IGNORE_INDEX).sum())
