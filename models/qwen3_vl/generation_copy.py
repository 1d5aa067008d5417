"""A plain local copy of a Qwen3-VL model's full weights, for the sampler (``ModelFamily.generation_copy``):
Qwen2.5-VL's copy (models/qwen_vl/generation_copy.py) with a fresh ``Qwen3VLForConditionalGeneration``;
a model with LoRA adapters is refused (export it merged), as for Qwen2.5-VL.
"""

from __future__ import annotations

from models.qwen3_vl.model import Qwen3VLForConditionalGeneration, empty_model
from models.qwen_vl.generation_copy import copier

generation_copy = copier(Qwen3VLForConditionalGeneration, empty_model)
"""Qwen3-VL's copy (the row's ``generation_copy``)."""
