"""Qwen3-VL's parameter counts, training FLOPs per token (MFU) and block linears' shapes (NF4's
layout check), asked through the row (models/flops.py, models/nf4.py).

Parameters count both towers. FLOPs per token are the language model's, by Qwen's conventions
(models/qwen/flops.py): the vision tower's work depends on how many image patches a batch holds,
not on its token count, so it is not part of a per-token figure (as for Qwen2.5-VL).
"""

from __future__ import annotations

from core.config import ModelConfig
from models.qwen import flops as qwen_flops
from models.qwen3_vl.dims import Qwen3VisionDims, resolve_qwen3_vl_dims
from models.qwen_vl.flops import counters


def block_linears(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """{name in a block: (rows, columns)} of every linear's weight; the vision blocks' under ``visual.``."""
    vision = resolve_qwen3_vl_dims(config).vision
    h, inner = vision.hidden_size, vision.intermediate_size
    return {**qwen_flops.block_linears(config), "visual.attn.qkv": (3 * h, h), "visual.attn.proj": (h, h),
            "visual.mlp.linear_fc1": (inner, h), "visual.mlp.linear_fc2": (h, inner)}


def _vision_params(v: Qwen3VisionDims) -> int:
    h, inner, width = v.hidden_size, v.intermediate_size, v.hidden_size * v.merge_unit
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)
    mlp = (width * width + width) + (width * v.out_hidden_size + v.out_hidden_size)
    mergers = (2 * h + mlp) + len(v.deepstack_visual_indexes) * (2 * width + mlp)
    return v.patch_dim * h + h + v.num_position_embeddings * h + v.depth * block + mergers


num_params, flops_per_token = counters(resolve_qwen3_vl_dims, _vision_params)
