"""Hugging Face checkpoint I/O: our model computes what transformers computes, both ways."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import models
from core.config import ModelConfig
from models.hf_weights import INDEX_NAME, WEIGHTS_NAME

TOLERANCE = 1e-5


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("fixture", ["qwen2_hf", "qwen3_hf"])
def test_load_pretrained_matches_transformers(fixture, token_ids, request):
    hf_model, directory = request.getfixturevalue(fixture)
    ours = models.load_pretrained(directory)
    with torch.no_grad():
        expected = hf_model(token_ids).logits
        got = ours(token_ids)
    assert got.shape == expected.shape
    assert _max_diff(got, expected) <= TOLERANCE


def test_loaded_config_reflects_each_family(qwen2_hf, qwen3_hf):
    q2 = models.load_pretrained(qwen2_hf[1]).config
    assert (q2.arch, q2.qkv_bias, q2.qk_norm, q2.tie_embeddings, q2.head_dim) == ("qwen2", True, False, False, 16)
    q3 = models.load_pretrained(qwen3_hf[1])
    assert (q3.config.arch, q3.config.qkv_bias, q3.config.qk_norm, q3.config.head_dim) == ("qwen3", False, True, 24)
    assert q3.config.rope_theta == 1000000.0
    assert q3.lm_head.weight is q3.embed_tokens.weight


def test_position_ids_match_transformers(qwen3_hf, token_ids):
    # Restarting positions (as packed documents have) must rotate exactly like transformers.
    hf_model, directory = qwen3_hf
    ours = models.load_pretrained(directory)
    position_ids = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, -1)
    with torch.no_grad():
        expected = hf_model(token_ids, position_ids=position_ids).logits
        got = ours(token_ids, position_ids=position_ids)
    assert _max_diff(got, expected) <= TOLERANCE


def _random_ours(config: ModelConfig, seed: int) -> models.QwenForCausalLM:
    model = models.build(config, generator=torch.Generator().manual_seed(seed))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # norms at 1 and biases at 0 would hide a misplaced tensor
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    return model.eval()


def _load_in_transformers(directory, expected_class: str):
    from transformers import AutoModelForCausalLM

    hf_model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert type(hf_model).__name__ == expected_class
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return hf_model.eval()


SHAPE = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize(
    "config, expected_class",
    [
        (ModelConfig(arch="qwen2", tie_embeddings=False, **SHAPE), "Qwen2ForCausalLM"),
        (ModelConfig(arch="qwen3", tie_embeddings=True, head_dim=16, **SHAPE), "Qwen3ForCausalLM"),
        # Combinations transformers has no flag for, exported with all-zero extra biases:
        (ModelConfig(arch="qwen2", qkv_bias=False, **SHAPE), "Qwen2ForCausalLM"),
        (ModelConfig(arch="qwen3", qkv_bias=True, **SHAPE), "Qwen3ForCausalLM"),
    ],
    ids=["qwen2-untied", "qwen3-tied", "qwen2-no-bias", "qwen3-qkv-bias"],
)
def test_save_pretrained_loads_in_transformers(config, expected_class, token_ids, tmp_path):
    ours = _random_ours(config, seed=11)
    models.save_pretrained(ours, tmp_path)
    hf_model = _load_in_transformers(tmp_path, expected_class)
    with torch.no_grad():
        assert _max_diff(hf_model(token_ids).logits, ours(token_ids)) <= TOLERANCE
    # ... and it comes back into our model with the same function.
    reloaded = models.load_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(reloaded(token_ids), ours(token_ids))


def test_tied_export_omits_lm_head(tmp_path):
    from safetensors import safe_open

    models.save_pretrained(_random_ours(ModelConfig(tie_embeddings=True, **SHAPE), seed=1), tmp_path)
    with safe_open(str(tmp_path / WEIGHTS_NAME), framework="pt") as reader:
        keys = set(reader.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True


def test_sharded_checkpoint_round_trip(tmp_path, token_ids):
    ours = _random_ours(ModelConfig(arch="qwen2", tie_embeddings=False, **SHAPE), seed=5)
    models.save_pretrained(ours, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (tmp_path / WEIGHTS_NAME).exists()
    reloaded = models.load_pretrained(tmp_path)
    hf_model = _load_in_transformers(tmp_path, "Qwen2ForCausalLM")
    with torch.no_grad():
        assert torch.equal(reloaded(token_ids), ours(token_ids))
        assert _max_diff(hf_model(token_ids).logits, ours(token_ids)) <= TOLERANCE
    # Saving again unsharded replaces the shards instead of leaving a stale index behind.
    models.save_pretrained(ours, tmp_path)
    assert not (tmp_path / INDEX_NAME).exists() and not list(tmp_path.glob("model-*-of-*.safetensors"))


def test_load_in_bfloat16(qwen3_hf):
    model = models.load_pretrained(qwen3_hf[1], dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.embed_tokens.weight


def test_build_honours_init_from_and_takes_shape_from_config_json(qwen2_hf, token_ids):
    hf_model, directory = qwen2_hf
    # The YAML's shape (defaults here) differs from the checkpoint's; config.json wins.
    config = ModelConfig(arch="qwen3", hidden_size=128, num_layers=4, attention="sdpa", init_from=str(directory))
    model = models.build(config, generator=torch.Generator().manual_seed(123))
    assert (model.config.arch, model.config.hidden_size, model.config.num_layers) == ("qwen2", 64, 2)
    assert model.config.attention == "sdpa" and model.config.init_from == str(directory)
    with torch.no_grad():
        assert _max_diff(model(token_ids), hf_model(token_ids).logits) <= TOLERANCE


def test_model_config_from_hf_keeps_non_shape_fields(qwen3_hf):
    base = dataclasses.replace(ModelConfig(), attention="flex", init_std=0.01, sdpa_backends="all")
    config = models.model_config_from_hf(qwen3_hf[1], base)
    assert (config.attention, config.init_std, config.sdpa_backends) == ("flex", 0.01, "all")
    assert (config.vocab_size, config.hidden_size, config.num_heads, config.num_kv_heads) == (96, 48, 4, 2)
