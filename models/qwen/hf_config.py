"""The Qwen family's config.json: read (``config_from_hf``) and written (``config_to_hf``), the
``ModelFamily.config_from_hf`` / ``config_to_hf`` of the qwen2 and qwen3 rows (models/qwen/family.py).

Only what the Qwen2ForCausalLM / Qwen3ForCausalLM classes of transformers can express is
accepted; anything else (RoPE scaling, sliding-window attention, a non-SiLU activation) is a
ConfigError that names the file and the field.

Family mapping: Qwen2 always has q/k/v bias and no q/k norm. Qwen3 always has q/k norm, and
its ``attention_bias`` switches a bias on q, k, v *and* o; our model has no o_proj bias, so
a Qwen3 export with q/k/v bias writes an all-zero o_proj bias (models/qwen/weights.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from core.config import ModelConfig
from core.model_families import ModelFamily
from models.hf_config import FieldReader, read_rope_theta
from models.qwen.dims import QwenDims
from models.qwen.family import QWEN2, QWEN3

# transformers' class defaults for keys a config.json may omit.
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_EPS = 1e-6
_DEFAULT_MAX_POSITIONS = 32768
_QWEN3_DEFAULT_HEAD_DIM = 128


def config_from_hf(reader: FieldReader, family: ModelFamily, base: ModelConfig) -> ModelConfig:
    """``base`` with the shape ``reader``'s config.json gives a model of ``family`` (qwen2 or qwen3)."""
    if family.default("qk_norm"):  # Qwen3
        head_dim = reader.integer("head_dim", default=_QWEN3_DEFAULT_HEAD_DIM)
        qkv_bias = reader.flag("attention_bias", default=False)
    else:
        # Qwen2's modeling code uses config.head_dim when present, else hidden / heads.
        num_heads, hidden_size = reader.integer("num_attention_heads"), reader.integer("hidden_size")
        if "head_dim" not in reader.raw and hidden_size % num_heads:
            raise reader.error(
                "num_attention_heads", f"hidden_size={hidden_size} is not divisible by {num_heads} heads"
            )
        head_dim = reader.integer("head_dim", default=hidden_size // num_heads)
        qkv_bias = True
    fields = decoder_fields(reader, head_dim=head_dim, qkv_bias=qkv_bias, qk_norm=family.default("qk_norm"))
    return dataclasses.replace(base, arch=family.name, **fields)


def decoder_fields(reader: FieldReader, *, head_dim: int, qkv_bias: bool, qk_norm: bool) -> dict[str, Any]:
    """The ``model.*`` fields of a Qwen decoder's config.json (Qwen2, Qwen3 and Qwen3-MoE read them
    alike; ``head_dim`` and the attention's switches are the caller's): sizes, heads, RoPE, norms,
    tying. ConfigError naming the field where the heads do not group, ``head_dim`` is odd, or the
    file asks for what the model does not compute (``_reject_unsupported``)."""
    num_heads = reader.integer("num_attention_heads")
    num_kv_heads = reader.integer("num_key_value_heads", default=num_heads)
    if num_heads % num_kv_heads:
        raise reader.error(
            "num_key_value_heads",
            f"num_attention_heads={num_heads} is not divisible by num_key_value_heads={num_kv_heads}",
        )
    if head_dim % 2:
        raise reader.error("head_dim", f"head_dim must be even for rotary embeddings, got {head_dim}")
    _reject_unsupported(reader)
    return dict(
        vocab_size=reader.integer("vocab_size"),
        hidden_size=reader.integer("hidden_size"),
        intermediate_size=reader.integer("intermediate_size"),
        num_layers=reader.integer("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=read_rope_theta(reader, _DEFAULT_ROPE_THETA),
        rms_norm_eps=reader.number("rms_norm_eps", default=_DEFAULT_RMS_EPS),
        tie_embeddings=reader.flag("tie_word_embeddings", default=False),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        max_position_embeddings=reader.integer("max_position_embeddings", default=_DEFAULT_MAX_POSITIONS),
    )


def config_to_hf(config: ModelConfig, dims: QwenDims, dtype_name: str) -> dict[str, Any]:
    """The config.json that transformers loads as Qwen2ForCausalLM or Qwen3ForCausalLM.

    The HF class is chosen by qk_norm (only Qwen3 has it), not by ``config.arch``, so every
    combination of our switches is exported to a class that computes the same function.
    """
    family = QWEN3 if dims.qk_norm else QWEN2
    out = decoder_config(config, dims, family, dtype_name)
    if family is QWEN3:
        out["attention_bias"] = dims.qkv_bias
    return out


def decoder_config(config: ModelConfig, dims: Any, family: ModelFamily, dtype_name: str) -> dict[str, Any]:
    """The config.json fields of a Qwen decoder (``dims``: a ``QwenDims`` or one with its fields) that
    ``family``'s first Hugging Face class reads; a family adds its own (attention_bias, experts)."""
    return {
        "architectures": [family.hf_architectures[0]],
        "model_type": family.hf_model_type,
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": dims.rms_norm_eps,
        # rope_theta for transformers 4.x readers, rope_parameters for 5.x.
        "rope_theta": dims.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": dims.rope_theta},
        "tie_word_embeddings": dims.tie_embeddings,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "initializer_range": dims.init_std,
        "use_cache": True,
        "dtype": dtype_name,
    }


def _reject_unsupported(reader: FieldReader) -> None:
    scaling = reader.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind != "default":
            raise reader.error(
                "rope_scaling",
                f"RoPE scaling {kind!r} is not supported",
                hint="only plain RoPE is implemented; remove rope_scaling or use another checkpoint",
            )
    act = reader.get("hidden_act", "silu")
    if act != "silu":
        raise reader.error("hidden_act", f"activation {act!r} is not supported", hint="only silu is implemented")
    if reader.get("use_sliding_window", False):
        raise reader.error(
            "use_sliding_window",
            "sliding-window attention is not supported",
            hint="set use_sliding_window to false if the checkpoint was trained with full attention",
        )
