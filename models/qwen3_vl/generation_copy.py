"""A plain local copy of a Qwen3-VL model's full weights, for the sampler (``ModelFamily.generation_copy``).

The generic copy (models/generation_copy.py) with a fresh ``Qwen3VLForConditionalGeneration`` of the
model's config, carrying the model's ``Numerics``. Adapters are not folded here: a model with LoRA
adapters is refused (export it merged), as for Qwen2.5-VL.
"""

from __future__ import annotations

from typing import Mapping

import torch

from models import generation_copy as generic
from models.qwen3_vl.model import Qwen3VLForConditionalGeneration, empty_model


def generation_copy(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *,
                    device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> Qwen3VLForConditionalGeneration:
    """A plain local model with ``model``'s full weights (``state``: its canonical state; DTensor shards are
    gathered, a collective: call on every rank); ``model`` itself where it is plain and already on
    ``device`` in ``dtype``."""
    return generic.generation_copy(model, state, model_class=Qwen3VLForConditionalGeneration, build=empty_model,
                                   device=device, dtype=dtype, fold_lora=False)
