"""Qwen2.5-VL's parameter counts, training FLOPs per token (MFU) and block linears' shapes (NF4's
layout check), asked through the row (models/flops.py, models/nf4.py).

Parameters count both towers. FLOPs per token are the language model's, by Qwen's conventions
(models/qwen/flops.py): the vision tower's work depends on how many image patches a batch holds,
not on its token count, so it is not part of a per-token figure; ``vision_flops`` counts it per
batch of images (MFU over both towers: the text's per-token figure times the tokens, plus it).
"""

from __future__ import annotations

from typing import Callable

from core.config import ModelConfig
from models.qwen import flops as qwen_flops
from models.qwen_vl.dims import VisionDims, resolve_vl_dims


def vision_flops(config: ModelConfig, grids: list[tuple[int, int, int]]) -> int:
    """Training FLOPs (forward + backward) of the vision tower and merger over images of patch ``grids``
    (t, h, w), by the language model's conventions: 6 per matmul weight per patch (the patch embedding's
    Conv3d is one linear map per patch; the merger's per merged token), and per block 12 x width x the
    sum over its attention segments of length squared (scores and values, forward and backward, no
    mask discount): windows of window_tokens x window_tokens merged tokens cut from each frame's top
    left, or whole frames in ``fullatt_block_indexes``."""
    v = resolve_vl_dims(config).vision
    h, inner, width, merge, side = (v.hidden_size, v.intermediate_size, v.hidden_size * v.merge_unit,
                                    v.spatial_merge_size, v.window_tokens)
    patches = window_squares = frame_squares = 0
    for t, rows, columns in grids:
        if rows % merge or columns % merge:
            raise ValueError(f"an image grid {(t, rows, columns)} does not divide into {merge} x {merge} merged patches")
        patches += t * rows * columns
        frame_squares += t * (rows * columns) ** 2
        tall, wide = rows // merge, columns // merge
        for top in range(0, tall, side):
            for left in range(0, wide, side):
                window = min(side, tall - top) * min(side, wide - left) * v.merge_unit
                window_squares += t * window**2
    block_weights = 3 * h * h + h * h + 3 * h * inner
    full = len(v.fullatt_block_indexes)
    attention = 12 * h * ((v.depth - full) * window_squares + full * frame_squares)
    merger = (width * width + width * v.out_hidden_size) * (patches // v.merge_unit)
    return 6 * (v.patch_dim * h + v.depth * block_weights) * patches + 6 * merger + attention


def block_linears(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """{name in a block: (rows, columns)} of every linear's weight; the vision blocks' under ``visual.``."""
    vision = resolve_vl_dims(config).vision
    h, inner = vision.hidden_size, vision.intermediate_size
    return {**qwen_flops.block_linears(config), "visual.attn.qkv": (3 * h, h), "visual.attn.proj": (h, h),
            "visual.mlp.gate_proj": (inner, h), "visual.mlp.up_proj": (inner, h), "visual.mlp.down_proj": (h, inner)}


def _vision_params(v: VisionDims) -> int:
    h, inner, width = v.hidden_size, v.intermediate_size, v.hidden_size * v.merge_unit
    block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (2 * (h * inner + inner) + inner * h + h)
    merger = h + (width * width + width) + (width * v.out_hidden_size + v.out_hidden_size)
    return v.patch_dim * h + v.depth * block + merger


def counters(resolve: Callable, vision_params: Callable) -> tuple[Callable, Callable]:
    """The row's ``num_params`` and ``flops_per_token`` for a Qwen VL family whose shape ``resolve`` gives
    (refusing a config it cannot build) and whose tower has ``vision_params(dims.vision)`` parameters."""

    def num_params(config: ModelConfig, *, non_embedding: bool = False) -> int:
        """Parameters of both towers (a tied embedding/head counted once); ``non_embedding=True`` leaves
        out the token embedding and the output head."""
        return qwen_flops.num_params(config, non_embedding=non_embedding) + vision_params(resolve(config).vision)

    def flops_per_token(config: ModelConfig, seq_len: int, *, include_embedding_head: bool) -> int:
        """The language model's training FLOPs per token at ``seq_len`` (module docstring)."""
        resolve(config)
        return qwen_flops.flops_per_token(config, seq_len, include_embedding_head=include_embedding_head)

    return num_params, flops_per_token


num_params, flops_per_token = counters(resolve_vl_dims, _vision_params)
