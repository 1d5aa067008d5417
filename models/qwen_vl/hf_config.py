"""The Qwen2.5-VL config.json: read (``config_from_hf``) and written (``config_to_hf``).

Read: transformers 5's layout (the language model under ``text_config``, RoPE under
``rope_parameters``) and the published checkpoints' (the language model's fields at the top level,
RoPE under ``rope_scaling`` with type ``mrope``); the vision tower from ``vision_config``. Only
what Qwen2_5_VLForConditionalGeneration computes the same way as our model is accepted: another
activation, sliding-window attention or a RoPE scaling is a ConfigError naming the file and the
field. Written: transformers 5's layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from core.config import ModelConfig
from core.model_families import ModelFamily
from models.hf_config import FieldReader, with_section
from models.qwen_vl.dims import VISION_ROPE_THETA, QwenVLDims
from models.qwen_vl.family import HF_ARCHITECTURE, NAME, QwenVLSettings, settings_of

_DEFAULT_ROPE_THETA = 1000000.0
_DEFAULT_RMS_EPS = 1e-6
_DEFAULT_MAX_POSITIONS = 128000


def config_from_hf(reader: FieldReader, family: ModelFamily, base: ModelConfig) -> ModelConfig:
    """``base`` with the shape of a Qwen2.5-VL config.json (``model.*`` and ``model.qwen2_5_vl``)."""
    text, vision = read_towers(reader)
    for where, fields in ((text, ("hidden_act",)), (vision, ("hidden_act",))):
        for name in fields:
            if where.get(name, "silu") != "silu":
                raise where.error(name, f"activation {where.get(name)!r} is not supported", hint="only silu is implemented")
    if text.get("use_sliding_window", False):
        raise text.error("use_sliding_window", "sliding-window attention is not supported",
                         hint="set use_sliding_window to false if the checkpoint was trained with full attention")
    num_heads, hidden_size = text.integer("num_attention_heads"), text.integer("hidden_size")
    if hidden_size % num_heads:
        raise text.error("num_attention_heads", f"hidden_size={hidden_size} is not divisible by {num_heads} heads")
    theta, section = rope(text, default_theta=_DEFAULT_ROPE_THETA, default_section=None,
                          missing_hint="a Qwen2.5-VL config.json gives the M-RoPE sections")
    vision_heads = vision.integer("num_heads")
    check_vision_rope(vision, VISION_ROPE_THETA, "Qwen2.5-VL")
    settings = QwenVLSettings(
        depth=vision.integer("depth"), hidden_size=vision.integer("hidden_size"), num_heads=vision_heads,
        intermediate_size=vision.integer("intermediate_size"), in_channels=vision.integer("in_channels", default=3),
        patch_size=vision.integer("patch_size"), temporal_patch_size=vision.integer("temporal_patch_size"),
        spatial_merge_size=vision.integer("spatial_merge_size"), window_size=vision.integer("window_size"),
        fullatt_block_indexes=tuple(int(i) for i in vision.get("fullatt_block_indexes", ())),
        out_hidden_size=vision.integer("out_hidden_size", default=hidden_size),
        mrope_section=section, tower=settings_of(base).tower,  # how it trains: the run's, not the file's
        **token_ids(reader, QwenVLSettings))
    tied = reader.flag("tie_word_embeddings", default=False) or text.flag("tie_word_embeddings", default=False)
    base = with_section(base, NAME)
    return dataclasses.replace(
        base, arch=family.name, vocab_size=text.integer("vocab_size"), hidden_size=hidden_size,
        intermediate_size=text.integer("intermediate_size"), num_layers=text.integer("num_hidden_layers"),
        num_heads=num_heads, num_kv_heads=text.integer("num_key_value_heads", default=num_heads), head_dim=None,
        rope_theta=theta, rms_norm_eps=text.number("rms_norm_eps", default=_DEFAULT_RMS_EPS), tie_embeddings=tied,
        qkv_bias=True, qk_norm=False,
        max_position_embeddings=text.integer("max_position_embeddings", default=_DEFAULT_MAX_POSITIONS),
        **{NAME: settings})


def config_to_hf(config: ModelConfig, dims: QwenVLDims, dtype_name: str) -> dict[str, Any]:
    """The config.json that transformers loads as Qwen2_5_VLForConditionalGeneration."""
    text, vision = dims.text, dims.vision
    return {
        **top_level(dims, HF_ARCHITECTURE, NAME, dtype_name),
        "text_config": {
            "model_type": "qwen2_5_vl_text", "vocab_size": text.vocab_size, "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size, "num_hidden_layers": text.num_layers,
            "num_attention_heads": text.num_heads, "num_key_value_heads": text.num_kv_heads, "hidden_act": "silu",
            "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": text.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": text.rope_theta,
                                "mrope_section": list(dims.mrope_section)},
            "use_sliding_window": False, "attention_dropout": 0.0, "initializer_range": text.init_std,
            "use_cache": True, "tie_word_embeddings": text.tie_embeddings,
        },
        "vision_config": {
            "model_type": "qwen2_5_vl_vision", "depth": vision.depth, "hidden_size": vision.hidden_size,
            "hidden_act": "silu", "intermediate_size": vision.intermediate_size, "num_heads": vision.num_heads,
            "in_channels": vision.in_channels, "patch_size": vision.patch_size,
            "spatial_merge_size": vision.spatial_merge_size, "temporal_patch_size": vision.temporal_patch_size,
            "window_size": vision.window_size, "out_hidden_size": vision.out_hidden_size,
            "fullatt_block_indexes": list(vision.fullatt_block_indexes), "initializer_range": text.init_std,
            "rope_parameters": {"rope_type": "axial", "rope_theta": VISION_ROPE_THETA},
        },
    }


def read_towers(reader: FieldReader) -> tuple[FieldReader, FieldReader]:
    """A VL config.json's language model (``text_config``, else the top level) and ``vision_config``."""
    nested = reader.get("text_config")
    if nested is not None and not isinstance(nested, dict):
        raise reader.error("text_config", f"text_config must be an object, got {nested!r}")
    text = FieldReader(nested, reader.file) if nested else reader
    vision_raw = reader.get("vision_config")
    if not isinstance(vision_raw, dict):
        raise reader.error("vision_config", f"vision_config must be an object, got {vision_raw!r}")
    return text, FieldReader(vision_raw, reader.file)


def check_vision_rope(vision: FieldReader, expected: float, label: str) -> None:
    """Refuse a vision rotary base other than ``expected`` (``label``'s, the one implemented)."""
    vision_theta = (vision.get("rope_parameters") or {}).get("rope_theta", expected)
    if vision_theta != expected:
        raise vision.error("rope_parameters.rope_theta", f"the vision rotary base {vision_theta} is not supported",
                           hint=f"only {expected} ({label}'s) is implemented")


def rope(text: FieldReader, *, default_theta: float, default_section: tuple[int, ...] | None,
         missing_hint: str = "") -> tuple[float, tuple[int, ...]]:
    """RoPE's base and M-RoPE sections from ``rope_parameters`` (transformers 5) or ``rope_scaling`` (the
    published checkpoints, type mrope or default); a RoPE scaling of another kind is refused. Where neither
    is given: ``rope_theta`` and ``default_section``, or (``default_section`` None) an error with
    ``missing_hint``."""
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
        section = params.get("mrope_section", None if default_section is None else list(default_section))
        if (not isinstance(section, list) or len(section) != 3
                or not all(isinstance(p, int) and not isinstance(p, bool) for p in section)):
            raise text.error(f"{field}.mrope_section", f"mrope_section must list three integers, got {section!r}")
        theta = params.get("rope_theta", text.get("rope_theta", default_theta))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise text.error(f"{field}.rope_theta", f"rope_theta must be a positive number, got {theta!r}")
        return float(theta), tuple(section)
    if default_section is None:
        raise text.error("rope_parameters", "rope_parameters.mrope_section is missing", hint=missing_hint)
    theta = text.get("rope_theta", default_theta)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise text.error("rope_theta", f"rope_theta must be a positive number, got {theta!r}")
    return float(theta), default_section


def token_ids(reader: FieldReader, settings: type) -> dict[str, int]:
    """A config.json's special token ids by their settings' names (``settings``' defaults where it has none)."""
    ids = {}
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        value = reader.get(key, getattr(settings, key))
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise reader.error(key, f"{key} must be a token id, got {value!r}")
        ids[key] = value
    return ids


def top_level(dims: QwenVLDims, architecture: str, model_type: str, dtype_name: str) -> dict[str, Any]:
    """A VL config.json's top-level fields before its ``text_config``: class, type, dtype, special tokens, tying."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "dtype": dtype_name,
        "image_token_id": dims.image_token_id,
        "video_token_id": dims.video_token_id,
        "vision_start_token_id": dims.vision_start_token_id,
        "vision_end_token_id": dims.vision_end_token_id,
        "tie_word_embeddings": dims.text.tie_embeddings,
    }
