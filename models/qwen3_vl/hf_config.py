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
from models.qwen3_vl.family import HF_ARCHITECTURE, NAME, Qwen3VLSettings

_DEFAULT_ROPE_THETA = 500000.0
_DEFAULT_RMS_EPS = 1e-6
_DEFAULT_MAX_POSITIONS = 128000
_DEFAULT_HEAD_DIM = 128
_DEFAULT_SECTION = (24, 20, 20)
_VISION_ACT = "gelu_pytorch_tanh"


def config_from_hf(reader: FieldReader, family: ModelFamily, base: ModelConfig) -> ModelConfig:
    """``base`` with the shape of a Qwen3-VL config.json (``model.*`` and ``model.qwen3_vl``)."""
    nested = reader.get("text_config")
    if nested is not None and not isinstance(nested, dict):
        raise reader.error("text_config", f"text_config must be an object, got {nested!r}")
    text = FieldReader(nested, reader.file) if nested else reader
    vision_raw = reader.get("vision_config")
    if not isinstance(vision_raw, dict):
        raise reader.error("vision_config", f"vision_config must be an object, got {vision_raw!r}")
    vision = FieldReader(vision_raw, reader.file)
    for where, expected in ((text, "silu"), (vision, _VISION_ACT)):
        if where.get("hidden_act", expected) != expected:
            raise where.error("hidden_act", f"activation {where.get('hidden_act')!r} is not supported",
                              hint=f"only {expected} is implemented here")
    if text.get("attention_bias", False):
        raise text.error("attention_bias", "attention biases are not supported (Qwen3-VL has none)",
                         hint="set attention_bias to false if the checkpoint has no q/k/v/o biases")
    theta, section = _rope(text)
    vision_theta = (vision.get("rope_parameters") or {}).get("rope_theta", VISION_ROPE_THETA)
    if vision_theta != VISION_ROPE_THETA:
        raise vision.error("rope_parameters.rope_theta", f"the vision rotary base {vision_theta} is not supported",
                           hint=f"only {VISION_ROPE_THETA} (Qwen3-VL's) is implemented")
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
        image_token_id=_token(reader, "image_token_id"), video_token_id=_token(reader, "video_token_id"),
        vision_start_token_id=_token(reader, "vision_start_token_id"),
        vision_end_token_id=_token(reader, "vision_end_token_id"), mrope_section=section)
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
        "architectures": [HF_ARCHITECTURE],
        "model_type": NAME,
        "dtype": dtype_name,
        "image_token_id": dims.image_token_id,
        "video_token_id": dims.video_token_id,
        "vision_start_token_id": dims.vision_start_token_id,
        "vision_end_token_id": dims.vision_end_token_id,
        "tie_word_embeddings": text.tie_embeddings,
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


def _rope(text: FieldReader) -> tuple[float, tuple[int, ...]]:
    """RoPE's base and M-RoPE sections from ``rope_parameters`` (transformers 5) or ``rope_scaling`` (the
    published checkpoints); a RoPE scaling of another kind is refused."""
    for field in ("rope_parameters", "rope_scaling"):
        params = text.get(field)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise text.error(field, f"{field} must be an object, got {params!r}")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", "mrope"):
            raise text.error(f"{field}.rope_type", f"RoPE scaling {kind!r} is not supported",
                             hint="only M-RoPE without scaling is implemented")
        section = params.get("mrope_section", list(_DEFAULT_SECTION))
        if (not isinstance(section, list) or len(section) != 3
                or not all(isinstance(p, int) and not isinstance(p, bool) for p in section)):
            raise text.error(f"{field}.mrope_section", f"mrope_section must list three integers, got {section!r}")
        theta = params.get("rope_theta", text.get("rope_theta", _DEFAULT_ROPE_THETA))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise text.error(f"{field}.rope_theta", f"rope_theta must be a positive number, got {theta!r}")
        return float(theta), tuple(section)
    theta = text.get("rope_theta", _DEFAULT_ROPE_THETA)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise text.error("rope_theta", f"rope_theta must be a positive number, got {theta!r}")
    return float(theta), _DEFAULT_SECTION


def _token(reader: FieldReader, key: str) -> int:
    value = reader.get(key, getattr(Qwen3VLSettings, key))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise reader.error(key, f"{key} must be a token id, got {value!r}")
    return value
