"""A plain local copy of a Qwen VL model's full weights, for the sampler (``ModelFamily.generation_copy``).

The generic copy (models/generation_copy.py) with a fresh model of the family's class
(``QwenVLForConditionalGeneration`` here, Qwen3-VL's subclass in models/qwen3_vl/) of the model's
config, carrying the model's ``Numerics``. Adapters are not folded here: a model with LoRA adapters
is refused (export it merged).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from models import generation_copy as generic
from models.qwen_vl.model import QwenVLForConditionalGeneration, empty_model


def copier(model_class: type[QwenVLForConditionalGeneration], build: Callable) -> Callable:
    """The family row's ``generation_copy`` for ``model_class``, whose fresh models ``build`` makes."""

    def generation_copy(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *,
                        device: torch.device | str | None = None,
                        dtype: torch.dtype | None = None) -> QwenVLForConditionalGeneration:
        """A plain local model with ``model``'s full weights (``state``: its canonical state; DTensor shards
        are gathered, a collective: call on every rank); ``model`` itself where it is plain and already on
        ``device`` in ``dtype``."""
        return generic.generation_copy(model, state, model_class=model_class, build=build,
                                       device=device, dtype=dtype, fold_lora=False)

    return generation_copy


generation_copy = copier(QwenVLForConditionalGeneration, empty_model)
"""Qwen2.5-VL's copy (the row's ``generation_copy``)."""
