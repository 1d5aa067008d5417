"""The resolved shape of a Qwen3-VL model: the language model's ``QwenDims`` and the vision tower's.

Computed once from a ModelConfig (``model.*`` for the language model, ``model.qwen3_vl`` for the
rest) and handed to the model, the FLOP counter, the plan and the exporter, so all of them read
the same answer; a shape the model cannot build is a ConfigError naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.config import ModelConfig
from models.qwen3_vl.family import check_settings, settings_of
from models.qwen_vl.dims import QwenVLDims, TowerDims, language_fields, tower_sizes

VISION_NORM_EPS = 1e-6
"""Epsilon of every LayerNorm of the vision tower and the mergers (fixed in Qwen3-VL)."""
VISION_ROPE_THETA = 10000.0
"""Base frequency of the vision tower's 2-D rotary embedding (Qwen3-VL's default)."""


@dataclass(frozen=True)
class Qwen3VisionDims(TowerDims):
    """Concrete sizes of the Qwen3-VL vision tower (GELU MLPs, learned positions) and its mergers."""

    num_position_embeddings: int
    """Learned positions (a square grid of them)."""
    deepstack_visual_indexes: tuple[int, ...]
    """Blocks whose outputs a DeepStack merger turns into features for the language model, ascending."""

    @property
    def grid_side(self) -> int:
        """Side of the square grid of learned positions."""
        return math.isqrt(self.num_position_embeddings)


@dataclass(frozen=True)
class Qwen3VLDims(QwenVLDims):
    """Concrete sizes of one Qwen3-VL model: Qwen2.5-VL's fields, a Qwen3 decoder (q/k RMSNorm, no q/k/v
    bias) as ``text``, Qwen3-VL's tower and mergers as ``vision``, interleaved M-RoPE sections."""

    vision: Qwen3VisionDims
    """The vision tower and mergers."""


def resolve_qwen3_vl_dims(config: ModelConfig) -> Qwen3VLDims:
    """``config``'s shape; ConfigError naming the key where it cannot be built."""
    check_settings(config)
    s = settings_of(config)
    vision = Qwen3VisionDims(**tower_sizes(config, s), num_position_embeddings=s.num_position_embeddings,
                             deepstack_visual_indexes=tuple(s.deepstack_visual_indexes))
    return Qwen3VLDims(vision=vision, **language_fields(config, s))
