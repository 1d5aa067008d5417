"""configs/qwen3-30b-a3b.yaml has the shape of Qwen3-30B-A3B: transformers' Qwen3MoeConfig defaults
(which are that model's but for five fields), its published sizes, and a layer-count override that leaves the rest."""

from __future__ import annotations

from pathlib import Path

import pytest
import models
from core import config as core_config
from models.flops import flops_per_token
from models.hf_config import hf_config_dict
from models.hf_weights import empty_model

PRESET = Path(__file__).resolve().parents[2] / "configs" / "qwen3-30b-a3b.yaml"

# The fields of the preset's config.json that Qwen3MoeConfig's defaults fix.
SHAPE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "rms_norm_eps", "tie_word_embeddings", "attention_bias", "decoder_sparse_step", "moe_intermediate_size",
    "num_experts_per_tok", "num_experts", "router_aux_loss_coef", "mlp_only_layers",
)
# Where Qwen3-30B-A3B's config.json differs from the class's defaults (in parentheses): 48 layers (24),
# head_dim 128 (none: hidden_size / heads = 64), RoPE base 1e6 (1e4), norm_topk_prob true (false),
# max_position_embeddings 40960 (32768; every Qwen3 preset's).
CHECKPOINT_FIELDS = {"num_hidden_layers": 48, "head_dim": 128, "norm_topk_prob": True,
                     "max_position_embeddings": 40960}


def _hf_fields(model_config) -> dict:
    dims = empty_model(model_config, device="meta").dims  # the family's resolved shape, no storage
    return hf_config_dict(model_config, dims, "bfloat16")


def test_the_preset_is_qwen3_moe_config_defaults():
    transformers = pytest.importorskip("transformers")
    reference = transformers.Qwen3MoeConfig()
    ours = _hf_fields(core_config.load(PRESET).model)
    assert ours["architectures"] == ["Qwen3MoeForCausalLM"]
    for field in SHAPE_FIELDS:
        assert ours[field] == getattr(reference, field), field
    assert {field: ours[field] for field in CHECKPOINT_FIELDS} == CHECKPOINT_FIELDS
    assert ours["rope_parameters"]["rope_theta"] == 1e6


def test_the_preset_has_the_published_sizes_and_active_flops():
    """30.5B parameters, 29.9B without the embedding and head, 3.3B of them active per token (the model card's)."""
    config = core_config.load(PRESET).model
    assert round(models.num_params(config) / 1e9, 1) == 30.5
    assert round(models.num_params(config, non_embedding=True) / 1e9, 1) == 29.9
    # All matmuls at seq 0: 6 x the active weights (embedding lookup aside, the head counted).
    active = flops_per_token(config, 0, include_embedding_head=True) // 6 + config.vocab_size * config.hidden_size
    assert int(active / 1e8) == 33  # 3.35B, which the card gives as 3.3B


def test_a_layer_override_cuts_only_the_depth():
    full = core_config.load(PRESET).model
    cut = core_config.load(PRESET, ["model.num_layers=4"]).model
    assert cut.num_layers == 4
    assert cut.qwen3_moe == full.qwen3_moe and cut.hidden_size == full.hidden_size
    model = empty_model(cut, device="meta")
    assert sum(p.numel() for p in model.parameters()) == models.num_params(cut)
