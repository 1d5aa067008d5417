"""A plain local copy of a Qwen model's full weights, for the Sampler (``ModelFamily.generation_copy``).

The generic copy (models/generation_copy.py) with a fresh ``QwenForCausalLM`` of the model's config:
LoRA adapters folded into the base weights, an NF4 base refused, the model's own ``Numerics`` carried.
"""

from __future__ import annotations

from typing import Mapping

import torch

from models import generation_copy as generic
from models.qwen.model import QwenForCausalLM, empty_model


def generation_copy(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> QwenForCausalLM:
    """A plain local QwenForCausalLM with the full weights of ``model``, whose canonical state is ``state``
    (DTensor shards are gathered, a collective: call on every rank); ``model`` itself where it is a plain
    QwenForCausalLM already on ``device`` in ``dtype``."""
    return generic.generation_copy(model, state, model_class=QwenForCausalLM, build=empty_model, device=device,
                                   dtype=dtype)
