"""The trained model as the Sampler takes it: unwrapped here, where the wrappers were applied.

``generation_model(model)`` takes the model as the loop trains it (plain, DDP-wrapped, with
compiled or checkpointed blocks, sharded by FSDP2 / tensor parallelism, with LoRA adapters),
removes the wrappers distributed/ put around it and reads its state under canonical names
(``distributed.params.canonical_state``), and hands both to the model family's
``generation_copy`` (models/qwen/generation_copy.py), which gathers the full weights into a
plain local model and folds the adapters in. Under sharding it is a collective: call it on
every rank.
"""

from __future__ import annotations

import torch

from distributed.params import canonical_state, unwrap
from models.qwen.generation_copy import generation_copy
from models.qwen.model import QwenForCausalLM


def generation_model(
    model: torch.nn.Module, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> QwenForCausalLM:
    """A plain local QwenForCausalLM with the full weights of ``model`` (the model itself where it
    is plain and already on ``device`` in ``dtype``; default: the parameters' own)."""
    inner = unwrap(model)
    return generation_copy(inner, canonical_state(inner), device=device, dtype=dtype)
