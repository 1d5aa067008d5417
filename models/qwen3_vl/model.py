"""Qwen3-VL: token ids and images -> next-token logits (models/qwen3_vl/__init__.py).

A Qwen2.5-VL model (models/qwen_vl/model.py, whose forward, M-RoPE positions, masks, cached text
forward, numerics and generation spec it inherits; it gives its own shape, ``resolve_shape``, and
tower, ``tower_class``) with three differences. The language blocks are Qwen3's (the
family's defaults: RMSNorm on each head of q and k, no q/k/v bias, model.head_dim). The M-RoPE
sections are interleaved: frequency pair i rotates by the height position where i % 3 == 1 and
i < 3 * section[1], by the width where i % 3 == 2 and i < 3 * section[2], else by the temporal
position. The vision tower is Qwen3-VL's (models/qwen3_vl/vision.py), and DeepStack adds its k-th
feature to the output of language block k at the image placeholders, after the merged features
replaced the placeholders' embeddings. Module names follow the Hugging Face model with
``model.language_model.`` and ``model.`` removed, so weight I/O is a rename
(models/qwen3_vl/weights.py).

Every forward without a cache runs the vision tower, on a one-image stand-in of zeros where the
batch has no image, and adds 0 x the sum of all its outputs (DeepStack's included) to the residual
stream: each rank then runs the same collectives of a sharded tower whatever its rows hold, every
tower parameter gets a gradient, and the logits are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from core.config import ModelConfig
from core.exceptions import DataError
from models import init
from models.attention import AttentionMask
from models.qwen.model import RMSNorm
from models.qwen.rope import RotaryTable
from models.qwen3_vl.dims import resolve_qwen3_vl_dims
from models.qwen3_vl.vision import Qwen3VisionTower
from models.qwen_vl.model import QwenVLForConditionalGeneration
from models.qwen_vl.positions import ImageBatch, axis_rope_table


def interleaved_axes(half: int, section: tuple[int, ...], device: torch.device | None = None) -> torch.Tensor:
    """(half,) long: the M-RoPE axis (0 temporal, 1 height, 2 width) of each frequency pair (module docstring)."""
    axis = torch.zeros(half, dtype=torch.long, device=device)
    axis[1:3 * section[1]:3] = 1
    axis[2:3 * section[2]:3] = 2
    return axis


class Qwen3VLForConditionalGeneration(QwenVLForConditionalGeneration):
    """Token ids (and images) -> logits (B, T, vocab). Parameters hold meaningless values until
    ``init_weights(generator)`` or a checkpoint load fills them (``models.build`` does one)."""

    resolve_shape = staticmethod(resolve_qwen3_vl_dims)
    tower_class = Qwen3VisionTower

    def rotary_table(self, positions: torch.Tensor) -> RotaryTable:
        """The interleaved M-RoPE angles of (3, B, T) positions every language block receives."""
        text = self.dims.text
        axis = interleaved_axes(text.head_dim // 2, self.dims.mrope_section, positions.device)
        return axis_rope_table(positions, text.head_dim, text.rope_theta, axis)

    def embed(self, input_ids: torch.Tensor, images: ImageBatch | None) -> torch.Tensor:
        """Token embeddings (B, T, hidden) with each image placeholder replaced by its merged feature."""
        return self.embed_with_deepstack(input_ids, images)[0]

    def embed_with_deepstack(self, input_ids: torch.Tensor, images: ImageBatch | None
                             ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """The embeddings (``embed``), the (B, T) image placeholder mask and the DeepStack features (each
        (image tokens, hidden)); no mask and no features without images."""
        hidden = self.embed_tokens(input_ids)
        if images is None:  # the tower still runs: the same collectives on every rank (module docstring)
            vision = self.dims.vision
            side = vision.spatial_merge_size
            stand_in = torch.zeros(side * side, vision.patch_dim, device=hidden.device, dtype=hidden.dtype)
            merged, deepstack = self.visual(stand_in, [(1, side, side)])
            touched = merged.sum() + sum(feature.sum() for feature in deepstack)
            return hidden + 0.0 * touched.to(hidden.dtype), None, ()
        pixels, grids = images.flat()
        with self.numerics.kernels():  # batch_invariant's linears: an image's features whatever the batch
            merged, deepstack = self.visual(pixels, grids)  # (image tokens, hidden) each
        placeholders = input_ids == self.dims.image_token_id
        if int(placeholders.sum()) != merged.shape[0]:  # the positions' row-by-row check runs first
            raise DataError(f"{int(placeholders.sum())} image placeholders for {merged.shape[0]} merged features")
        hidden = hidden.masked_scatter(placeholders[..., None], merged.to(hidden.dtype))
        return hidden, placeholders, tuple(feature.to(hidden.dtype) for feature in deepstack)

    def language_blocks(self, input_ids: torch.Tensor, images: ImageBatch | None, rope: RotaryTable,
                        mask: AttentionMask) -> torch.Tensor:
        """The embeddings through every language block, DeepStack's k-th feature added to block k's output at
        the image tokens: (B, T, hidden) before the final norm (the parent's forward calls it)."""
        hidden, placeholders, deepstack = self.embed_with_deepstack(input_ids, images)  # (B, T, hidden)
        for index, block in enumerate(self.layers):
            hidden = block(hidden, rope, mask)
            if index < len(deepstack):
                hidden = hidden + torch.zeros_like(hidden).masked_scatter(placeholders[..., None], deepstack[index])
        return hidden

    def init_weights(self, generator: torch.Generator) -> None:
        """Every parameter from ``generator`` (CPU), drawn in fp32 in registration order and copied to the
        parameter's device and dtype (its shard, for a DTensor; models/init.py): RMSNorm and LayerNorm weights 1,
        biases 0, the rest (linears, the patch Conv3d, the embeddings) N(0, init_std). Equal generators give
        equal models."""
        init.init_weights(self, generator, std=self.dims.text.init_std, norms=(RMSNorm, nn.LayerNorm))


def empty_model(config: ModelConfig, *, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32) -> Qwen3VLForConditionalGeneration:
    """``ModelFamily.build``: the model with storage on ``device`` and undefined values (models/init.py)."""
    return init.empty_model(lambda: Qwen3VLForConditionalGeneration(config), device=device, dtype=dtype)
