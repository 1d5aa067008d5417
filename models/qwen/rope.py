"""Rotary position embedding, rotate-half layout, always computed in fp32.

Rotate-half pairs dimension ``i`` with ``i + head_dim/2`` (the layout of the Qwen
checkpoints), not adjacent dimensions. Nothing is cached in buffers (no buffer to re-create
after a meta-device ``to_empty``, no state_dict entry): the model computes a ``RotaryTable``
from the integer ``position_ids`` once per forward and hands it to every block. Computing
cos and sin inside each layer instead cost a few percent of a 0.5B step on an H200 (the
compiled kernels re-evaluate them for every head). The table travels in an object of a plain
class: FSDP2's mixed-precision input cast (``cast_forward_inputs``) enters tensors, dataclasses,
dicts, named tuples, lists and tuples (torch.distributed.utils' ``_apply_to_tensors``) and would
round the angles to bf16 at every block under a bf16 policy, but passes any other object as it is,
so the fp32 angles are never rounded (a frozen dataclass, as the table was before, was entered).
"""

from __future__ import annotations

import torch


def inverse_frequencies(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """theta^(-2i/head_dim) for i in [0, head_dim/2), fp32, shape (head_dim/2,)."""
    # Evaluated in fp32 in the same order as the reference checkpoints' code, so that
    # fp32 logits match theirs to the last bits rather than to 1e-7.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each (B or 1, T, head_dim/2) in fp32."""
    inv_freq = inverse_frequencies(head_dim, theta, position_ids.device)
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # (B, T, head_dim/2)
    return angles.cos(), angles.sin()


class RotaryTable:
    """cos and sin of the rotation angles of one batch, each (B or 1, T, head_dim/2), fp32.

    Not a dataclass nor a tuple, so that FSDP2's input cast leaves it fp32 (module docstring); set
    once, never written after."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos = cos
        """cos of the angles, (B or 1, T, head_dim/2) fp32."""
        self.sin = sin
        """sin of the angles, (B or 1, T, head_dim/2) fp32."""

    @classmethod
    def build(cls, position_ids: torch.Tensor, head_dim: int, theta: float) -> "RotaryTable":
        return cls(*rope_cos_sin(position_ids, head_dim, theta))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (B, T, n_head, head_dim) by the angles; math in fp32, result in x's dtype."""
    half = x.shape[-1] // 2
    x32 = x.to(torch.float32)
    x1, x2 = x32[..., :half], x32[..., half:]  # (B, T, n_head, head_dim/2) each
    cos = cos.unsqueeze(-2)  # (B, T, 1, head_dim/2): broadcast over heads
    sin = sin.unsqueeze(-2)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (B, T, n_head, head_dim)
    return rotated.to(x.dtype)
