"""The resolved shape of a Qwen2.5-VL model: the language model's ``QwenDims`` and the vision tower's.

Computed once from a ModelConfig (``model.*`` for the language model, ``model.qwen2_5_vl`` for the
rest) and handed to the model, the FLOP counter, the plan and the exporter, so all of them read
the same answer; a shape the model cannot build is a ConfigError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ModelConfig
from models.qwen.dims import QwenDims, resolve_dims
from models.qwen_vl.family import check_settings, settings_of

VISION_NORM_EPS = 1e-6
"""Epsilon of every RMSNorm of the vision tower and the merger (fixed in Qwen2.5-VL)."""
VISION_ROPE_THETA = 10000.0
"""Base frequency of the vision tower's 2-D rotary embedding (fixed in Qwen2.5-VL)."""


@dataclass(frozen=True)
class TowerDims:
    """Concrete sizes every Qwen VL vision tower has (Qwen2.5-VL's and Qwen3-VL's add their own)."""

    depth: int
    """Vision blocks."""
    hidden_size: int
    """Width of the tower's residual stream."""
    num_heads: int
    """Attention heads per block."""
    intermediate_size: int
    """Hidden width of a block's MLP."""
    in_channels: int
    """Colour channels of a patch."""
    patch_size: int
    """Side of a patch, in pixels."""
    temporal_patch_size: int
    """Frames per patch."""
    spatial_merge_size: int
    """Patches per side of one merged token."""
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


def tower_sizes(config: ModelConfig, s) -> dict[str, int]:
    """``TowerDims``' fields from a vision section ``s`` of ``config``."""
    return dict(depth=s.depth, hidden_size=s.hidden_size, num_heads=s.num_heads, intermediate_size=s.intermediate_size,
                in_channels=s.in_channels, patch_size=s.patch_size, temporal_patch_size=s.temporal_patch_size,
                spatial_merge_size=s.spatial_merge_size, out_hidden_size=config.hidden_size)


def language_fields(config: ModelConfig, s) -> dict:
    """The fields of a VL model's dims beside its vision tower: the language model's, the special tokens, M-RoPE."""
    return dict(text=resolve_dims(config), image_token_id=s.image_token_id, video_token_id=s.video_token_id,
                vision_start_token_id=s.vision_start_token_id, vision_end_token_id=s.vision_end_token_id,
                mrope_section=tuple(s.mrope_section))


@dataclass(frozen=True)
class VisionDims(TowerDims):
    """Concrete sizes of the Qwen2.5-VL vision tower (SiLU-gated MLPs, windowed attention) and its merger."""

    window_size: int
    """Side of an attention window, in pixels."""
    fullatt_block_indexes: tuple[int, ...]
    """Blocks that attend over the whole image."""

    @property
    def window_tokens(self) -> int:
        """Merged tokens per side of an attention window."""
        return self.window_size // self.spatial_merge_size // self.patch_size


@dataclass(frozen=True)
class QwenVLDims:
    """Concrete sizes of one Qwen2.5-VL model."""

    text: QwenDims
    """The language model (a Qwen2 decoder: q/k/v bias, no q/k norm)."""
    vision: VisionDims
    """The vision tower and merger."""
    image_token_id: int
    """The image placeholder token."""
    video_token_id: int
    """The video placeholder token (exported only)."""
    vision_start_token_id: int
    """The token before an image's placeholders (exported only)."""
    vision_end_token_id: int
    """The token after an image's placeholders (exported only)."""
    mrope_section: tuple[int, ...]
    """Rotary frequency pairs given to the temporal, height and width positions."""

    @property
    def vocab_size(self) -> int:
        """The language model's vocabulary."""
        return self.text.vocab_size

    @property
    def num_layers(self) -> int:
        """Blocks of the language model (the KV cache's layers)."""
        return self.text.num_layers


def resolve_vl_dims(config: ModelConfig) -> QwenVLDims:
    """``config``'s shape; ConfigError naming the key where it cannot be built."""
    check_settings(config)
    s = settings_of(config)
    vision = VisionDims(**tower_sizes(config, s), window_size=s.window_size,
                        fullatt_block_indexes=tuple(s.fullatt_block_indexes))
    return QwenVLDims(vision=vision, **language_fields(config, s))
