"""The resolved shape of a Qwen3-VL model: the language model's ``QwenDims`` and the vision tower's.

Computed once from a ModelConfig (``model.*`` for the language model, ``model.qwen3_vl`` for the
rest) and handed to the model, the FLOP counter, the plan and the exporter, so all of them read
the same answer; a shape the model cannot build is a ConfigError naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.config import ModelConfig
from models.qwen.dims import QwenDims, resolve_dims
from models.qwen3_vl.family import check_settings, settings_of

VISION_NORM_EPS = 1e-6
"""Epsilon of every LayerNorm of the vision tower and the mergers (fixed in Qwen3-VL)."""
VISION_ROPE_THETA = 10000.0
"""Base frequency of the vision tower's 2-D rotary embedding (Qwen3-VL's default)."""


@dataclass(frozen=True)
class Qwen3VisionDims:
    """Concrete sizes of the vision tower and its mergers."""

    depth: int
    """Vision blocks."""
    hidden_size: int
    """Width of the tower's residual stream."""
    num_heads: int
    """Attention heads per block."""
    intermediate_size: int
    """Hidden width of a block's GELU MLP."""
    in_channels: int
    """Colour channels of a patch."""
    patch_size: int
    """Side of a patch, in pixels."""
    temporal_patch_size: int
    """Frames per patch."""
    spatial_merge_size: int
    """Patches per side of one merged token."""
    num_position_embeddings: int
    """Learned positions (a square grid of them)."""
    deepstack_visual_indexes: tuple[int, ...]
    """Blocks whose outputs a DeepStack merger turns into features for the language model, ascending."""
    out_hidden_size: int
    """Width of a merged feature (the language model's hidden size)."""

    @property
    def head_dim(self) -> int:
        """Width of one vision attention head."""
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened pixel patch: channels x frames x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches joined into one merged token."""
        return self.spatial_merge_size**2

    @property
    def grid_side(self) -> int:
        """Side of the square grid of learned positions."""
        return math.isqrt(self.num_position_embeddings)


@dataclass(frozen=True)
class Qwen3VLDims:
    """Concrete sizes of one Qwen3-VL model."""

    text: QwenDims
    """The language model (a Qwen3 decoder: q/k RMSNorm, no q/k/v bias)."""
    vision: Qwen3VisionDims
    """The vision tower and mergers."""
    image_token_id: int
    """The image placeholder token."""
    video_token_id: int
    """The video placeholder token (exported only)."""
    vision_start_token_id: int
    """The token before an image's placeholders (exported only)."""
    vision_end_token_id: int
    """The token after an image's placeholders (exported only)."""
    mrope_section: tuple[int, ...]
    """Rotary frequency pairs given to the temporal, height and width positions (interleaved)."""

    @property
    def vocab_size(self) -> int:
        """The language model's vocabulary."""
        return self.text.vocab_size

    @property
    def num_layers(self) -> int:
        """Blocks of the language model (the KV cache's layers)."""
        return self.text.num_layers


def resolve_qwen3_vl_dims(config: ModelConfig) -> Qwen3VLDims:
    """``config``'s shape; ConfigError naming the key where it cannot be built."""
    check_settings(config)
    s = settings_of(config)
    vision = Qwen3VisionDims(depth=s.depth, hidden_size=s.hidden_size, num_heads=s.num_heads,
                             intermediate_size=s.intermediate_size, in_channels=s.in_channels,
                             patch_size=s.patch_size, temporal_patch_size=s.temporal_patch_size,
                             spatial_merge_size=s.spatial_merge_size,
                             num_position_embeddings=s.num_position_embeddings,
                             deepstack_visual_indexes=tuple(s.deepstack_visual_indexes),
                             out_hidden_size=config.hidden_size)
    return Qwen3VLDims(text=resolve_dims(config), vision=vision, image_token_id=s.image_token_id,
                       video_token_id=s.video_token_id, vision_start_token_id=s.vision_start_token_id,
                       vision_end_token_id=s.vision_end_token_id, mrope_section=tuple(s.mrope_section))
