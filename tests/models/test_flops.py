"""Parameter counts and FLOPs per token (models/flops.py) for a shape worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import models
from core.config import ModelConfig
from models.qwen.model import QwenForCausalLM

# qwen2 => q/k/v bias, no q/k norm; head_dim = 32 / 4 = 8; q width 32, k/v width 16.
SMALL = ModelConfig(
    arch="qwen2", vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, tie_embeddings=False,
)
# Per layer: attention matmuls 32*(32+16+16) + 32*32 = 3072, MLP 3*32*64 = 6144 -> 9216;
# biases 32+16+16 = 64; two norms 64 -> 9344. Body: 2*9344 + final norm 32 = 18720.
# Embedding and head: 100*32 = 3200 each.


def test_num_params_by_hand():
    assert models.num_params(SMALL, non_embedding=True) == 18720
    assert models.num_params(SMALL) == 18720 + 3200 + 3200
    tied = dataclasses.replace(SMALL, tie_embeddings=True)
    assert models.num_params(tied) == 18720 + 3200


def test_flops_per_token_by_hand():
    attention = 12 * 2 * 4 * 8 * 16  # 12 * layers * heads * head_dim * seq_len = 12288
    # torchtitan's convention: 6 x non-embedding parameters (norms and biases included).
    assert models.flops_per_token(SMALL, 16, include_embedding_head=False) == 6 * 18720 + attention
    # Every matmul weight including lm_head: 6 * (2 * 9216 + 3200); no norms or biases.
    assert models.flops_per_token(SMALL, 16, include_embedding_head=True) == 6 * 21632 + attention
    # The head's matmul runs whether or not it shares its weight with the embedding.
    tied = dataclasses.replace(SMALL, tie_embeddings=True)
    assert models.flops_per_token(tied, 16, include_embedding_head=True) == 6 * 21632 + attention


def test_attention_term_uses_head_dim_not_hidden_over_heads():
    wide_heads = dataclasses.replace(SMALL, arch="qwen3", head_dim=16)  # 4 heads x 16 != 32
    base = models.flops_per_token(wide_heads, 0, include_embedding_head=True)
    assert models.flops_per_token(wide_heads, 100, include_embedding_head=True) - base == 12 * 2 * 4 * 16 * 100


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_num_params_counts_the_built_module(arch, tie):
    config = dataclasses.replace(SMALL, arch=arch, tie_embeddings=tie, head_dim=12)
    with torch.device("meta"):
        model = QwenForCausalLM(config)
    assert models.num_params(config) == sum(p.numel() for p in model.parameters())
