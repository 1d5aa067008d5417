"""The Qwen3-VL vision tower: patches in, merged features and DeepStack features out.

Per image, its flattened patches (t * h * w of them, block-major: the merge x merge patches of one
merged token consecutive) are embedded by a biased Conv3d whose stride is its kernel (Qwen2.5-VL's
``PatchEmbed``), plus a learned position: the ``pos_embed`` table is a square grid of
grid_side x grid_side positions, resampled bilinearly to the image's h x w grid with the corners
aligned (row i reads the table at i * (grid_side - 1) / (h - 1), between its two nearest rows,
and likewise for columns), each patch summing its four taps' rows times their weights. Each block
is pre-LayerNorm attention with Qwen2.5-VL's fused, biased ``qkv`` and 2-D rotary embedding
(``VisionAttention``), over the patch's whole frame (no windows), and a biased GELU (tanh) MLP.
The merger LayerNorms each patch, joins the merge_unit patches of a merged token and maps them
through Linear-GELU-Linear to the language model's width. Each block named in
``deepstack_visual_indexes`` feeds one DeepStack merger, which joins the patches first and then
LayerNorms the joined vector; its features go to the language model (models/qwen3_vl/model.py).

Each block is callable alone, ``block(hidden, rope, segments)``, with ``hidden`` its only
floating-point tensor argument, so FSDP, activation checkpointing and compile wrap the blocks of
this stack as they wrap the language model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.numerics import Numerics
from models.qwen.rope import RotaryTable
from models.qwen3_vl.dims import VISION_NORM_EPS, VISION_ROPE_THETA, Qwen3VisionDims
from models.qwen_vl.vision import PatchEmbed, Segments, VisionAttention, patch_positions, patch_rotary_table


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (N, 2) long into a ``side``-long axis and their fp32 weights for positions ``index``
    (N,) of an axis of ``size``, the two axes' ends aligned."""
    source = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(source)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(grids: list[tuple[int, int, int]], positions: torch.Tensor,
                  side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(patches, 4) rows of the ``side`` x ``side`` position table and their fp32 weights for every patch
    at (row, column) ``positions`` (patches, 2) of the images of ``grids`` (module docstring)."""
    taps, weights, start = [], [], 0
    for t, h, w in grids:
        rows, cols = positions[start:start + t * h * w].unbind(-1)
        start += t * h * w
        row_taps, row_weights = _axis_taps(rows, h, side)
        col_taps, col_weights = _axis_taps(cols, w, side)
        taps.append((row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4))
        weights.append((row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4))
    return torch.cat(taps), torch.cat(weights)


class Qwen3VisionMLP(nn.Module):
    """linear_fc2(gelu_tanh(linear_fc1(x))), both linears biased."""

    def __init__(self, dims: Qwen3VisionDims) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dims.hidden_size, dims.intermediate_size)
        self.linear_fc2 = nn.Linear(dims.intermediate_size, dims.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class Qwen3VisionBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)), LayerNorms; callable alone as ``block(hidden, rope, segments)``."""

    def __init__(self, dims: Qwen3VisionDims, *, numerics: Numerics) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dims.hidden_size, eps=VISION_NORM_EPS)
        self.norm2 = nn.LayerNorm(dims.hidden_size, eps=VISION_NORM_EPS)
        self.attn = VisionAttention(dims, numerics=numerics)
        self.mlp = Qwen3VisionMLP(dims)

    def forward(self, hidden: torch.Tensor, rope: RotaryTable, segments: Segments) -> torch.Tensor:
        hidden = hidden + self.attn(self.norm1(hidden), rope, segments)
        return hidden + self.mlp(self.norm2(hidden))


class Qwen3PatchMerger(nn.Module):
    """merge_unit consecutive patches -> one feature of the language model's width: a LayerNorm (of each patch,
    or of the joined patches where ``postshuffle``), then Linear-GELU-Linear."""

    def __init__(self, dims: Qwen3VisionDims, *, postshuffle: bool) -> None:
        super().__init__()
        self.width = dims.hidden_size * dims.merge_unit
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else dims.hidden_size, eps=VISION_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, dims.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(joined)))  # (N / merge_unit, out_hidden)


class Qwen3VisionTower(nn.Module):
    """Patches of every image of a batch -> their merged features and DeepStack features, in the images' order."""

    def __init__(self, dims: Qwen3VisionDims, *, numerics: Numerics) -> None:
        super().__init__()
        self.dims = dims
        self.patch_embed = PatchEmbed(dims, bias=True)
        self.pos_embed = nn.Embedding(dims.num_position_embeddings, dims.hidden_size)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(dims, numerics=numerics) for _ in range(dims.depth))
        self.merger = Qwen3PatchMerger(dims, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(Qwen3PatchMerger(dims, postshuffle=True)
                                                   for _ in dims.deepstack_visual_indexes)

    def forward(self, pixels: torch.Tensor,
                grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """pixels (patches, patch values) of the images of ``grids`` -> (merged tokens, out_hidden), and one
        (merged tokens, out_hidden) DeepStack feature per ``deepstack_visual_indexes`` entry, in its order."""
        d = self.dims
        positions = torch.cat([patch_positions(grid, d.spatial_merge_size) for grid in grids]).to(pixels.device)
        taps, weights = position_taps(grids, positions, d.grid_side)
        hidden = self.patch_embed(pixels)  # (N, hidden)
        hidden = hidden + (self.pos_embed(taps) * weights[..., None]).sum(1).to(hidden.dtype)
        rope = patch_rotary_table(positions, d.head_dim, VISION_ROPE_THETA)
        frames = Segments.of([h * w for t, h, w in grids for _ in range(t)], pixels.device)
        deepstack = dict(zip(d.deepstack_visual_indexes, self.deepstack_merger_list))
        features = []
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, rope, frames)
            if index in deepstack:
                features.append(deepstack[index](hidden))
        return self.merger(hidden), tuple(features)
