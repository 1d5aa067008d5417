"""The Qwen3-MoE family's config.json: read (``config_from_hf``) and written (``config_to_hf``), the
fields of transformers' Qwen3MoeConfig.

The attention's fields are Qwen3's (head_dim, attention_bias, RoPE, norms); the experts' fill the
``model.qwen3_moe`` section (num_experts, num_experts_per_tok, moe_intermediate_size,
norm_topk_prob, decoder_sparse_step, mlp_only_layers, router_aux_loss_coef), a key a config.json
omits taking transformers' class default. What the class cannot express in our model (RoPE
scaling, sliding windows, another activation) is a ConfigError naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from core.config import ModelConfig
from core.model_families import ModelFamily
from models.hf_config import FieldReader, with_section
from models.qwen.hf_config import decoder_config, decoder_fields
from models.qwen3_moe.dims import MoeDims
from models.qwen3_moe.family import NAME, QWEN3_MOE, settings_of

# transformers' Qwen3MoeConfig defaults for keys a config.json may omit.
# RoPE's base, the norms' epsilon and max_position_embeddings default as Qwen's (models/qwen/hf_config.py).
_DEFAULTS = dict(head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                 decoder_sparse_step=1, router_aux_loss_coef=0.001)


def config_from_hf(reader: FieldReader, family: ModelFamily, base: ModelConfig) -> ModelConfig:
    """``base`` with the shape (and the model.qwen3_moe section) of ``reader``'s config.json."""
    fields = decoder_fields(reader, head_dim=reader.integer("head_dim", default=_DEFAULTS["head_dim"]),
                            qkv_bias=reader.flag("attention_bias", default=False), qk_norm=True)
    num_layers = fields["num_layers"]
    only = reader.get("mlp_only_layers", [])
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers
                                             for i in only):
        raise reader.error("mlp_only_layers", f"mlp_only_layers must list layers in [0, {num_layers}), got {only!r}")
    coef = reader.get("router_aux_loss_coef", _DEFAULTS["router_aux_loss_coef"])
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
        raise reader.error("router_aux_loss_coef", f"router_aux_loss_coef must be a finite number >= 0, got {coef!r}")
    base = with_section(base, NAME)
    settings = dataclasses.replace(
        settings_of(base),
        num_experts=_num_experts(reader),
        num_experts_per_tok=reader.integer("num_experts_per_tok", default=_DEFAULTS["num_experts_per_tok"]),
        moe_intermediate_size=reader.integer("moe_intermediate_size", default=_DEFAULTS["moe_intermediate_size"]),
        norm_topk_prob=reader.flag("norm_topk_prob", default=_DEFAULTS["norm_topk_prob"]),
        decoder_sparse_step=reader.integer("decoder_sparse_step", default=_DEFAULTS["decoder_sparse_step"]),
        mlp_only_layers=tuple(only),
        router_aux_loss_coef=float(coef),
        # written by Lockstep's export only; a config.json without it keeps the run's own setting
        bias_update_rate=(reader.number("bias_update_rate", default=0.0) if reader.get("bias_update_rate") is not None
                          else settings_of(base).bias_update_rate),
    )
    return dataclasses.replace(base, arch=family.name, **fields, **{NAME: settings})


def config_to_hf(config: ModelConfig, dims: MoeDims, dtype_name: str) -> dict[str, Any]:
    """The config.json that transformers loads as Qwen3MoeForCausalLM."""
    s = settings_of(config)
    return {
        **decoder_config(config, dims, QWEN3_MOE, dtype_name),
        "attention_bias": dims.qkv_bias,
        "num_experts": dims.num_experts,
        "num_experts_per_tok": dims.top_k,
        "moe_intermediate_size": dims.moe_intermediate_size,
        "norm_topk_prob": dims.norm_topk_prob,
        "decoder_sparse_step": s.decoder_sparse_step,
        "mlp_only_layers": list(s.mlp_only_layers),
        "router_aux_loss_coef": dims.router_aux_loss_coef,
        "output_router_logits": False,
        # Lockstep's auxiliary-loss-free balancing: the routers' mlp.gate.e_score_correction_bias are
        # in the weights; transformers' class ignores both (its routing leaves the bias out)
        **({"bias_update_rate": s.bias_update_rate} if s.bias_update_rate > 0 else {}),
    }


def _num_experts(reader: FieldReader) -> int:
    """``num_experts`` (the Hub's checkpoints), or ``num_local_experts`` (transformers 5's save_pretrained)."""
    hub, local = reader.get("num_experts"), reader.get("num_local_experts")
    if hub is not None and local is not None and hub != local:
        raise reader.error("num_local_experts", f"num_experts={hub!r} and num_local_experts={local!r} disagree",
                           hint="keep one of the two fields")
    return reader.integer("num_experts" if hub is not None else "num_local_experts", default=_DEFAULTS["num_experts"])
