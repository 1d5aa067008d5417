"""The Qwen3-VL config.json: read (``config_from_hf``) and written (``config_to_hf``).

Read: the language model under ``text_config``, its RoPE under ``rope_parameters`` (transformers 5)
or ``rope_scaling`` (the published checkpoints, with ``rope_theta`` beside it); the vision tower
from ``vision_config``. Missing fields take Qwen3VLConfig's defaults where transformers fills one
(head_dim 128, the M-RoPE sections [24, 20, 20]; ``mrope_interleaved`` is not read: Qwen3-VL
always interleaves). Only what Qwen3VLForConditionalGeneration computes the same way as our model
is accepted: another activation, attention biases, a RoPE scaling or another vision rotary base
is a ConfigError naming the file and the field. Written: transformers 5's layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from core.config import ModelConfig
from core.model_families import ModelFamily
from models.hf_config import FieldReader, with_section
from models.qwen3_vl.dims import VISION_ROPE_THETA, Qwen3VLDims
from models.qwen3_vl.family import HF_ARCHITECTURE, NAME, Qwen3VLSettings, settings_of
from models.qwen_vl.hf_config import check_vision_rope, read_towers, rope, token_ids, top_level

_DEFAULT_ROPE_THETA = 500000.0
_DEFAULT_RMS_EPS = 1e-6
_DEFAULT_MAX_POSITIONS = 128000
_DEFAULT_HEAD_DIM = 128
_DEFAULT_SECTION = (24, 20, 20)
_VISION_ACT = "gelu_pytorch_tanh"


def config_from_hf(reader: FieldReader, family: ModelFamily, base: ModelConfig) -> ModelConfig:
    """``base`` with the shape of a Qwen3-VL config.json (``model.*`` and ``model.qwen3_vl``)."""
    text, vision = read_towers(reader)
    for where, expected in ((text, "silu"), (vision, _VISION_ACT)):
        if where.get("hidden_act", expected) != expected:
            raise where.error("hidden_act", f"activation {where.get('hidden_act')!r} is not supported",
                              hint=f"only {expected} is implemented here")
    if text.get("attention_bias", False):
        raise text.error("attention_bias", "attention biases are not supported (Qwen3-VL has none)",
                         hint="set attention_bias to false if the checkpoint has no q/k/v/o biases")
    theta, section = rope(text, default_theta=_DEFAULT_ROPE_THETA,
                          default_section=_DEFAULT_SECTION)
    check_vision_rope(vision, VISION_ROPE_THETA, "Qwen3-VL")
    hidden_size = text.integer("hidden_size")
    indexes = vision.get("deepstack_visual_indexes", list(Qwen3VLSettings.deepstack_visual_indexes))
    if not isinstance(indexes, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in indexes):
        raise vision.error("deepstack_visual_indexes", f"deepstack_visual_indexes must list integers, got {indexes!r}")
    settings = Qwen3VLSettings(
        depth=vision.integer("depth"), hidden_size=vision.integer("hidden_size"), num_heads=vision.integer("num_heads"),
        intermediate_size=vision.integer("intermediate_size"), in_channels=vision.integer("in_channels", default=3),
        patch_size=vision.integer("patch_size"), temporal_patch_size=vision.integer("temporal_patch_size"),
        spatial_merge_size=vision.integer("spatial_merge_size"),
        num_position_embeddings=vision.integer("num_position_embeddings"),
        deepstack_visual_indexes=tuple(indexes),
        out_hidden_size=vision.integer("out_hidden_size", default=hidden_size),
        mrope_section=section, tower=settings_of(base).tower,  # how it trains: the run's, not the file's
        **token_ids(reader, Qwen3VLSettings))
    tied = reader.flag("tie_word_embeddings", default=False) or text.flag("tie_word_embeddings", default=False)
    num_heads = text.integer("num_attention_heads")
    base = with_section(base, NAME)
    return dataclasses.replace(
        base, arch=family.name, vocab_size=text.integer("vocab_size"), hidden_size=hidden_size,
        intermediate_size=text.integer("intermediate_size"), num_layers=text.integer("num_hidden_layers"),
        num_heads=num_heads, num_kv_heads=text.integer("num_key_value_heads", default=num_heads),
        head_dim=text.integer("head_dim", default=_DEFAULT_HEAD_DIM), rope_theta=theta,
        rms_norm_eps=text.number("rms_norm_eps", default=_DEFAULT_RMS_EPS), tie_embeddings=tied,
        qkv_bias=False, qk_norm=True,
        max_position_embeddings=text.integer("max_position_embeddings", default=_DEFAULT_MAX_POSITIONS),
        **{NAME: settings})


def config_to_hf(config: ModelConfig, dims: Qwen3VLDims, dtype_name: str) -> dict[str, Any]:
    """The config.json that transformers loads as Qwen3VLForConditionalGeneration."""
    text, vision = dims.text, dims.vision
    return {
        **top_level(dims, HF_ARCHITECTURE, NAME, dtype_name),
        "text_config": {
            "model_type": "qwen3_vl_text", "vocab_size": text.vocab_size, "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size, "num_hidden_layers": text.num_layers,
            "num_attention_heads": text.num_heads, "num_key_value_heads": text.num_kv_heads,
            "head_dim": text.head_dim, "hidden_act": "silu", "attention_bias": False,
            "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": text.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": text.rope_theta,
                                "mrope_section": list(dims.mrope_section), "mrope_interleaved": True},
            "attention_dropout": 0.0, "initializer_range": text.init_std, "use_cache": True,
            "tie_word_embeddings": text.tie_embeddings,
        },
        "vision_config": {
            "model_type": "qwen3_vl_vision", "depth": vision.depth, "hidden_size": vision.hidden_size,
            "hidden_act": _VISION_ACT, "intermediate_size": vision.intermediate_size, "num_heads": vision.num_heads,
            "in_channels": vision.in_channels, "patch_size": vision.patch_size,
            "spatial_merge_size": vision.spatial_merge_size, "temporal_patch_size": vision.temporal_patch_size,
            "out_hidden_size": vision.out_hidden_size, "num_position_embeddings": vision.num_position_embeddings,
            "deepstack_visual_indexes": list(vision.deepstack_visual_indexes), "initializer_range": text.init_std,
            "rope_parameters": {"rope_type": "axial", "rope_theta": VISION_ROPE_THETA},
        },
    }
