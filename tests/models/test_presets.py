"""The preset configs have the published shapes of the Qwen checkpoints they are named after."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import models
from core import config as core_config
from models.qwen.model import QwenForCausalLM

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHAPE_KEYS = (
    "arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "head_dim", "rope_theta", "rms_norm_eps", "tie_embeddings", "qkv_bias", "qk_norm", "max_position_embeddings",
)

# Published sizes (model cards): total parameters and non-embedding parameters, in billions,
# to the precision the cards give them.
PUBLISHED = {
    "qwen2.5-0.5b": (0.49, 0.36),
    "qwen2.5-1.5b": (1.54, 1.31),
    "qwen3-0.6b": (0.6, 0.44),
    "qwen3-1.7b": (1.7, 1.4),
    "qwen3-8b": (8.2, 6.95),
}


def _model_section(name: str):
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    return core_config.from_dict({"model": raw["model"]}).model


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_has_published_size(name):
    config = _model_section(name)
    total, non_embedding = PUBLISHED[name]
    digits = len(str(total).split(".")[1])
    assert round(models.num_params(config) / 1e9, digits) == total
    digits = len(str(non_embedding).split(".")[1])
    assert round(models.num_params(config, non_embedding=True) / 1e9, digits) == non_embedding
    assert config.vocab_size == 151936
    with torch.device("meta"):  # the real shape builds (no memory is allocated on meta)
        model = QwenForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == models.num_params(config)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_loads_through_core_config(name):
    if not (CONFIGS / "tiny.yaml").exists():
        pytest.skip("configs/tiny.yaml (the presets' parent) is not in this tree yet")
    loaded = core_config.load(CONFIGS / f"{name}.yaml").model
    expected = _model_section(name)
    # Shape keys must come from the preset; the kernel and init settings may come from tiny.yaml.
    for key in SHAPE_KEYS:
        assert getattr(loaded, key) == getattr(expected, key), key


# FSDP settings of the presets, as measured on four H200s (docs/performance.md, 2026-11-27g and
# 2026-11-28): full fine-tuning keeps the gathered parameters (ZeRO-2) in a few large units;
# adapter training reshards after every block, one block gathered at a time, memory first.
FSDP_SETTINGS = {
    "qwen2.5-0.5b": dict(strategy="fsdp", reshard_after_forward=False, fsdp_unit_blocks=8),
    "qwen3-1.7b": dict(strategy="fsdp", reshard_after_forward=False, fsdp_unit_blocks=14),
    "qwen3-1.7b-lora": dict(strategy="fsdp", reshard_after_forward=True, fsdp_unit_blocks=1),
    "qwen3-1.7b-qlora": dict(strategy="none", reshard_after_forward=True, fsdp_unit_blocks=1),  # one GPU
}


@pytest.mark.parametrize("name", sorted(FSDP_SETTINGS))
def test_preset_fsdp_settings_are_the_measured_ones(name):
    loaded = core_config.load(CONFIGS / f"{name}.yaml")
    for key, value in FSDP_SETTINGS[name].items():
        assert getattr(loaded.parallel, key) == value, key
    # Whole units: every unit holds the same number of blocks.
    assert loaded.model.num_layers % loaded.parallel.fsdp_unit_blocks == 0
