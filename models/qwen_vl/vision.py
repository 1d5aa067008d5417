"""The Qwen2.5-VL vision tower: patches in, merged features (one per merge x merge patches) out.

Per image, its flattened patches (t * h * w of them) are embedded by a Conv3d over (frames, rows,
columns) whose stride is its kernel, i.e. one linear map per patch. Patches are laid out
block-major: the merge x merge patches of one merged token are consecutive. The tower reorders
them window by window (``VisionLayout``): a window is window_tokens x window_tokens merged tokens
of one frame, cut from the top-left (the last row and column of windows may be smaller). Each
block is pre-RMSNorm attention with a fused, biased ``qkv`` and a 2-D rotary embedding (a
quarter of the rotated pairs by the patch's row, a quarter by its column, then both again),
and a biased SiLU-gated MLP. A block attends within its windows, or within its whole frame if
its index is one of ``fullatt_block_indexes``. The merger RMS-normalizes each patch, joins the
merge_unit patches of a merged token and maps them through Linear-GELU-Linear to the language
model's width; the features are put back in the images' own block-major order.

Attention over variable-length segments (windows or frames) runs as one non-causal SDPA call per
distinct segment length over all segments of that length (``Segments``), so no mask of the
whole patch sequence is built. Each block is callable alone, ``block(hidden, rope, segments)``,
with ``hidden`` its only floating-point tensor argument (the rotary table is an object FSDP's input
cast does not enter, models/qwen/rope.py): FSDP, activation checkpointing and compile wrap the
blocks of this stack as they wrap the language model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.numerics import Numerics
from models.qwen.model import RMSNorm
from models.qwen.rope import RotaryTable, apply_rope, inverse_frequencies
from models.qwen_vl.dims import VISION_NORM_EPS, VISION_ROPE_THETA, VisionDims


@dataclass(frozen=True)
class Segments:
    """Attention segments of the patch sequence: per distinct length, the (count, length) indices of
    the segments of that length, and the permutation that puts their outputs back in order."""

    groups: tuple[torch.Tensor, ...]
    """Per distinct segment length, a (segments, length) long tensor of token indices."""
    restore: torch.Tensor
    """(tokens,) long: position of each token in the concatenation of the groups' outputs."""

    @classmethod
    def of(cls, lengths: list[int], device: torch.device) -> "Segments":
        """Segments of ``lengths`` tokens each, back to back (empty segments skipped)."""
        starts, offset = [], 0
        for length in lengths:
            starts.append(offset)
            offset += length
        by_length: dict[int, list[int]] = {}
        for start, length in zip(starts, lengths):
            if length:
                by_length.setdefault(length, []).append(start)
        groups = tuple(torch.tensor(s, dtype=torch.long)[:, None] + torch.arange(n) for n, s in sorted(by_length.items()))
        order = torch.cat([g.reshape(-1) for g in groups])
        restore = torch.empty_like(order)
        restore[order] = torch.arange(order.numel())
        return cls(groups=tuple(g.to(device) for g in groups), restore=restore.to(device))


@dataclass(frozen=True)
class VisionLayout:
    """The window order of a batch's patches and its segments, computed once per forward from the grids."""

    window_index: torch.Tensor
    """(merged tokens,) long: the merged token at each place of the window order."""
    windows: Segments
    """The attention windows, in window order."""
    frames: Segments
    """Whole frames (the full-attention blocks' segments), in window order."""
    positions: torch.Tensor
    """(patches, 2) long: each patch's (row, column) in its frame, in the images' block-major order."""

    @classmethod
    def of(cls, grids: list[tuple[int, int, int]], dims: VisionDims, device: torch.device) -> "VisionLayout":
        merge, side = dims.spatial_merge_size, dims.window_tokens
        window_index, window_lengths, frame_lengths, positions, offset = [], [], [], [], 0
        for t, h, w in grids:
            gh, gw = h // merge, w // merge
            index = torch.arange(t * gh * gw).reshape(t, gh, gw)
            for frame in range(t):
                for top in range(0, gh, side):
                    for left in range(0, gw, side):
                        window = index[frame, top:top + side, left:left + side].reshape(-1)
                        window_index.append(window + offset)
                        window_lengths.append(window.numel() * dims.merge_unit)
                frame_lengths.append(h * w)
            offset += t * gh * gw
            positions.append(patch_positions((t, h, w), merge))
        return cls(window_index=torch.cat(window_index).to(device), windows=Segments.of(window_lengths, device),
                   frames=Segments.of(frame_lengths, device), positions=torch.cat(positions).to(device))


def patch_positions(grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """(t * h * w, 2) long: the (row, column) in its frame of each patch of an image of ``grid`` (t, h, w),
    in block-major order (the merge x merge patches of one merged token consecutive), frame after frame."""
    t, h, w = grid
    gh, gw = h // merge, w // merge
    rows = torch.arange(h)[:, None].expand(h, w).reshape(gh, merge, gw, merge).transpose(1, 2).reshape(-1)
    cols = torch.arange(w)[None, :].expand(h, w).reshape(gh, merge, gw, merge).transpose(1, 2).reshape(-1)
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def patch_rotary_table(positions: torch.Tensor, head_dim: int, theta: float) -> RotaryTable:
    """cos and sin (1, N, head_dim/2) in fp32 of the 2-D rotary embedding of patches at (row, column)
    ``positions`` (N, 2): the first head_dim/4 pairs rotate by the row, the next by the column."""
    inv_freq = inverse_frequencies(head_dim // 2, theta, positions.device)  # (head_dim/4,)
    angles = (positions.to(torch.float32)[..., None] * inv_freq).reshape(positions.shape[0], -1)  # rows', cols'
    return RotaryTable(angles.cos()[None], angles.sin()[None])


class PatchEmbed(nn.Module):
    """Flattened patches (N, channels * frames * patch * patch) -> (N, hidden) through a Conv3d, bias-free
    unless ``bias`` (Qwen3-VL's has one); ``dims`` is any tower's dims with these four sizes."""

    def __init__(self, dims: VisionDims, *, bias: bool = False) -> None:
        super().__init__()
        self.dims = dims
        kernel = (dims.temporal_patch_size, dims.patch_size, dims.patch_size)
        self.proj = nn.Conv3d(dims.in_channels, dims.hidden_size, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        d = self.dims
        patches = pixels.to(self.proj.weight.dtype).view(-1, d.in_channels, d.temporal_patch_size, d.patch_size,
                                                         d.patch_size)  # (N, C, frames, P, P)
        return self.proj(patches).view(-1, d.hidden_size)  # (N, hidden)


class VisionMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), every linear biased."""

    def __init__(self, dims: VisionDims) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dims.hidden_size, dims.intermediate_size)
        self.up_proj = nn.Linear(dims.hidden_size, dims.intermediate_size)
        self.down_proj = nn.Linear(dims.intermediate_size, dims.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionAttention(nn.Module):
    """Non-causal multi-head attention within segments, with the 2-D rotary embedding on q and k."""

    def __init__(self, dims: VisionDims, *, numerics: Numerics) -> None:
        super().__init__()
        self.head_dim = dims.head_dim
        self.numerics = numerics
        self.qkv = nn.Linear(dims.hidden_size, 3 * dims.hidden_size)
        self.proj = nn.Linear(dims.hidden_size, dims.hidden_size)

    def forward(self, x: torch.Tensor, rope: RotaryTable, segments: Segments) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, 3, -1, self.head_dim).unbind(1)  # each (N, heads, head_dim)
        q, k = apply_rope(q[None], rope.cos, rope.sin)[0], apply_rope(k[None], rope.cos, rope.sin)[0]
        backends = self.numerics.sdpa_backends_on(x.device)
        outs = []
        for index in segments.groups:  # (count, length): every segment of one length at once
            qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))  # (count, heads, length, head_dim)
            if backends is not None:
                with torch.nn.attention.sdpa_kernel(backends):
                    out = F.scaled_dot_product_attention(qs, ks, vs)
            else:
                out = F.scaled_dot_product_attention(qs, ks, vs)
            outs.append(out.transpose(1, 2).reshape(-1, q.shape[1] * self.head_dim))  # (count * length, width)
        return self.proj(torch.cat(outs)[segments.restore])  # (N, hidden)


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)); callable alone as ``block(hidden, rope, segments)``."""

    def __init__(self, dims: VisionDims, *, numerics: Numerics) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dims.hidden_size, VISION_NORM_EPS)
        self.norm2 = RMSNorm(dims.hidden_size, VISION_NORM_EPS)
        self.attn = VisionAttention(dims, numerics=numerics)
        self.mlp = VisionMLP(dims)

    def forward(self, hidden: torch.Tensor, rope: RotaryTable, segments: Segments) -> torch.Tensor:
        hidden = hidden + self.attn(self.norm1(hidden), rope, segments)
        return hidden + self.mlp(self.norm2(hidden))


class PatchMerger(nn.Module):
    """merge_unit consecutive patches -> one feature of the language model's width: ln_q, then Linear-GELU-Linear."""

    def __init__(self, dims: VisionDims) -> None:
        super().__init__()
        self.width = dims.hidden_size * dims.merge_unit
        self.ln_q = RMSNorm(dims.hidden_size, VISION_NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, dims.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))  # (N / merge_unit, out_hidden)


class VisionTower(nn.Module):
    """Patches of every image of a batch -> their merged features, in the images' order (module docstring)."""

    def __init__(self, dims: VisionDims, *, numerics: Numerics) -> None:
        super().__init__()
        self.dims = dims
        self.patch_embed = PatchEmbed(dims)
        self.blocks = nn.ModuleList(VisionBlock(dims, numerics=numerics) for _ in range(dims.depth))
        self.merger = PatchMerger(dims)

    def rotary_table(self, positions: torch.Tensor) -> RotaryTable:
        """cos and sin (1, N, head_dim/2) in fp32 of patches at (row, column) ``positions`` (N, 2)."""
        return patch_rotary_table(positions, self.dims.head_dim, VISION_ROPE_THETA)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixels (patches, patch values) of the images of ``grids`` -> (merged tokens, out_hidden)."""
        layout = VisionLayout.of(grids, self.dims, pixels.device)
        unit = self.dims.merge_unit
        hidden = self.patch_embed(pixels)  # (N, hidden)
        tokens = hidden.shape[0]
        order = (layout.window_index[:, None] * unit + torch.arange(unit, device=hidden.device)).reshape(-1)
        hidden = hidden[order]  # window order, merge groups kept together
        rope = self.rotary_table(layout.positions[order])
        full = set(self.dims.fullatt_block_indexes)
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, rope, layout.frames if index in full else layout.windows)
        merged = self.merger(hidden)  # (N / unit, out_hidden) in window order
        restore = torch.empty_like(layout.window_index)
        restore[layout.window_index] = torch.arange(tokens // unit, device=hidden.device)
        return merged[restore]
