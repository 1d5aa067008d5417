"""Activation checkpointing: recompute a block's activations in backward instead of storing them.

- ``full``: every block of every stack of the model's plan; activation memory becomes ~one
  block's worth plus the block inputs, for about one extra forward of compute.
- ``selective``: every other block of each stack (0, 2, 4, ... of each): roughly half the
  saving for half the recompute. This is block-level selection, not per-op selective
  checkpointing.

Non-reentrant checkpointing (``use_reentrant=False``) supports keyword arguments, nested
autograd and compile, and it preserves the RNG state, so recomputation reproduces the
forward bit for bit. The wrapper adds ``_checkpoint_wrapped_module`` to parameter names;
its own state_dict hooks remove that from state_dict keys, and ``distributed.params``
removes it from names used elsewhere.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from distributed.model_structure import plan_stacks


def blocks_to_checkpoint(num_blocks: int, mode: str) -> list[int]:
    """Indices of the blocks that ``mode`` recomputes."""
    if mode == "none":
        return []
    if mode == "full":
        return list(range(num_blocks))
    if mode == "selective":
        return list(range(0, num_blocks, 2))
    raise ValueError(f"unknown activation checkpointing mode {mode!r}")


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap the chosen blocks of each stack in place (the wrappers replace them in the stack's list)."""
    for _, blocks in plan_stacks(model):
        for index in blocks_to_checkpoint(len(blocks), mode):
            blocks[index] = checkpoint_wrapper(
                blocks[index], checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True
            )
