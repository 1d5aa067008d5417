"""configs/qwen2.5-vl-3b.yaml has the shape of Qwen2.5-VL-3B (the published config.json's sizes, the
vision tower's that transformers' Qwen2_5_VLVisionConfig defaults give), a layer-count override cuts
only the language model, and models/qwen_vl/flops.py's ``vision_flops`` is three times what a
forward of the vision tower multiplies (torch's FLOP counter), window edges and full blocks included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import models
from core import config as core_config
from core.config_schema import model_config_class
from models.hf_config import hf_config_dict
from models.hf_weights import empty_model
from models.qwen_vl.family import QwenVLSettings
from models.qwen_vl.flops import vision_flops

PRESET = Path(__file__).resolve().parents[2] / "configs" / "qwen2.5-vl-3b.yaml"

# Qwen2.5-VL-3B-Instruct's config.json: the language model and the vision tower's sizes.
TEXT_FIELDS = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
               "num_attention_heads": 16, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
               "max_position_embeddings": 128000, "tie_word_embeddings": True}
VISION_FIELDS = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 2048,
                 "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "patch_size": 14,
                 "spatial_merge_size": 2, "temporal_patch_size": 2}


def _hf_fields(model_config) -> dict:
    dims = empty_model(model_config, device="meta").dims  # the family's resolved shape, no storage
    return hf_config_dict(model_config, dims, "bfloat16")


def test_the_preset_has_the_published_shape():
    ours = _hf_fields(core_config.load(PRESET).model)
    assert ours["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert {k: ours["text_config"][k] for k in TEXT_FIELDS} == TEXT_FIELDS
    assert {k: ours["vision_config"][k] for k in VISION_FIELDS} == VISION_FIELDS
    assert ours["text_config"]["rope_parameters"]["rope_theta"] == 1e6
    assert ours["text_config"]["rope_parameters"]["mrope_section"] == [16, 24, 24]
    # Qwen's vocabulary's vision tokens (datasets/tokenizers/qwen).
    assert (ours["vision_start_token_id"], ours["vision_end_token_id"], ours["image_token_id"]) == (151652, 151653, 151655)
    # 3.75B parameters over both towers, 0.67B of them the vision tower's and merger's.
    config = core_config.load(PRESET).model
    assert round(models.num_params(config) / 1e9, 2) == 3.75


def test_the_vision_tower_is_transformers_default_but_for_its_widths():
    transformers = pytest.importorskip("transformers")
    reference = transformers.Qwen2_5_VLConfig().vision_config
    ours = _hf_fields(core_config.load(PRESET).model)["vision_config"]
    for field in ("depth", "intermediate_size", "num_heads", "window_size", "fullatt_block_indexes", "patch_size",
                  "spatial_merge_size", "temporal_patch_size", "in_channels"):
        assert ours[field] == (list(value) if isinstance(value := getattr(reference, field), tuple) else value), field


def test_a_layer_override_cuts_only_the_language_model():
    full = core_config.load(PRESET).model
    cut = core_config.load(PRESET, ["model.num_layers=8"]).model
    assert cut.num_layers == 8 and cut.qwen2_5_vl == full.qwen2_5_vl and cut.hidden_size == full.hidden_size
    model = empty_model(cut, device="meta")
    assert sum(p.numel() for p in model.parameters()) == models.num_params(cut)


@pytest.mark.parametrize("grids", [[(1, 8, 8)], [(1, 12, 8), (1, 4, 6)], [(2, 6, 10)]])
def test_vision_flops_are_three_forwards_of_the_tower(grids):
    """3 x the forward's multiply-adds (torch's counter: linears, the patch Conv3d, SDPA's two products), over
    windows cut at the grid's edges (12 x 8 patches: windows of 4 x 4 and 2 x 4) and a full-attention block."""
    settings = QwenVLSettings(depth=3, hidden_size=32, num_heads=4, intermediate_size=48, window_size=56,
                              fullatt_block_indexes=(1,), image_token_id=3, video_token_id=4, vision_start_token_id=5,
                              vision_end_token_id=6, mrope_section=(2, 1, 1))
    config = model_config_class()(arch="qwen2_5_vl", vocab_size=99, hidden_size=32, intermediate_size=37,
                                  num_layers=1, num_heads=4, num_kv_heads=2, qwen2_5_vl=settings)
    tower = empty_model(config).visual
    for param in tower.parameters():
        torch.nn.init.normal_(param, std=0.02)
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, 3 * 2 * 14 * 14)
    # SDPA's math backend: its two products are matmuls the counter sees (CPU's fused kernel it does not).
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        tower(pixels, grids)
    assert counter.get_flop_counts()["Global"].get(torch.ops.aten.bmm, 0) > 0  # the attention was counted
    assert vision_flops(config, grids) == 3 * counter.get_total_flops()
