"""How a vision-language model's tower trains, by ``model.<arch>.tower`` (models/qwen_vl/family.py,
models/qwen_vl/model.py ``tower_training``, models/lora.py): in process, on a tiny Qwen2.5-VL and Qwen3-VL.

frozen: after an optimizer step on a batch with an image the tower's parameters are bitwise what they were,
none of them is in the optimizer (no group, no state) and the language model trained; under LoRA the tower
takes no adapter. lora: every linear of the tower's blocks carries adapters, the rest of the tower is frozen,
and the merged export read back gives the adapted model's logits. full under LoRA: the tower trains beside
the language model's adapters. Unset: today's LoRA (the targets by name). The key: hashed only when set,
checked against model.lora and model.quantize_base, kept by a config.json read over the run's config.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import models
from core import config as config_lib
from core import seeding
from core.config_schema import model_config_class
from core.exceptions import ConfigError
from core.config_sections import LoRAConfig
from models.forward import ModelInputs, model_forward
from models.hf_config import model_config_from_hf
from models.hf_weights import load_pretrained, save_pretrained
from models.lora import LoRALinear, apply_lora, merge_lora
from models.qwen_vl.family import QwenVLSettings
from tests.models.vl_cases import END, IMAGE, PATCH_VALUES, START, VIDEO
from training.optimizers.build import build_optimizer

SETTINGS = QwenVLSettings(depth=2, hidden_size=32, num_heads=4, intermediate_size=48, window_size=56,
                          fullatt_block_indexes=(1,), image_token_id=IMAGE, video_token_id=VIDEO,
                          vision_start_token_id=START, vision_end_token_id=END, mrope_section=(2, 1, 1))


def _config(tower, *, lora_rank=0):
    return model_config_class()(arch="qwen2_5_vl", vocab_size=64, hidden_size=32, intermediate_size=40,
                                num_layers=2, num_heads=4, num_kv_heads=2, tie_embeddings=False,
                                max_position_embeddings=128, lora=LoRAConfig(rank=lora_rank, alpha=8.0),
                                qwen2_5_vl=dataclasses.replace(SETTINGS, tower=tower))


def _qwen3_config(tower):
    from models.qwen3_vl.family import Qwen3VLSettings

    settings = Qwen3VLSettings(depth=2, hidden_size=32, num_heads=4, intermediate_size=48, num_position_embeddings=16,
                               patch_size=14, deepstack_visual_indexes=(0,), image_token_id=IMAGE,
                               video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                               mrope_section=(4, 2, 2), tower=tower)
    return model_config_class()(arch="qwen3_vl", vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=16, tie_embeddings=False,
                                max_position_embeddings=128, qwen3_vl=settings)


def _batch():
    """One row of text, an image of a (1, 4, 4) grid (4 merged tokens), text; its next-token labels."""
    ids = torch.tensor([[7, 8, START, IMAGE, IMAGE, IMAGE, IMAGE, END, 9, 10, 11, 12]])
    patches = torch.randn(16, PATCH_VALUES, generator=torch.Generator().manual_seed(0))
    return ModelInputs(ids, None, media={"pixel_values": [[patches]], "image_grid_thw": [[torch.tensor([1, 4, 4])]]})


def _step(model):
    """One AdamW step of the next-token loss on ``_batch``; the optimizer."""
    train = config_lib.Config().train
    optimizer = build_optimizer(model, dataclasses.replace(train, lr=1e-2, weight_decay=0.1), torch.device("cpu"))
    inputs = _batch()
    logits = model_forward(model, inputs).logits[0, :-1]
    torch.nn.functional.cross_entropy(logits, inputs.input_ids[0, 1:]).backward()
    optimizer.step()
    return optimizer


def _tower_params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if name.startswith("visual.")}


@pytest.mark.parametrize("config", [_config("frozen"), _qwen3_config("frozen")], ids=["qwen2_5_vl", "qwen3_vl"])
def test_a_frozen_tower_gets_no_gradient_no_optimizer_state_and_stays_bitwise(config):
    model = models.build(config, generator=seeding.generator(1, "model_init"))
    before, head = _tower_params(model), model.lm_head.weight.detach().clone()
    optimizer = _step(model)
    tower = {id(p) for name, p in model.named_parameters() if name.startswith("visual.")}
    assert tower and all(not p.requires_grad and p.grad is None for n, p in model.named_parameters()
                         if n.startswith("visual."))
    assert not tower & {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert not tower & {id(p) for p in optimizer.state}
    after = _tower_params(model)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert not torch.equal(head, model.lm_head.weight)  # the language model trained


def test_a_frozen_tower_takes_no_adapter_under_lora():
    model = models.build(_config("frozen", lora_rank=4), generator=seeding.generator(1, "model_init"))
    trainable = apply_lora(model, model.config.lora, seed=0)
    assert trainable and not any(name.startswith("visual.") for name in trainable)
    assert not any(isinstance(m, LoRALinear) for m in model.visual.modules())
    assert isinstance(model.layers[0].mlp.gate_proj, LoRALinear)


def test_lora_on_the_tower_wraps_every_block_linear_and_merges_on_export(tmp_path):
    config = _config("lora", lora_rank=4)
    model = models.build(config, generator=seeding.generator(1, "model_init"))
    apply_lora(model, config.lora, seed=0)
    for block in model.visual.blocks:
        for linear in (block.attn.qkv, block.attn.proj, block.mlp.gate_proj, block.mlp.up_proj, block.mlp.down_proj):
            assert isinstance(linear, LoRALinear) and linear.lora_A.weight.requires_grad
    frozen = [n for n, p in model.named_parameters() if n.startswith("visual.") and not p.requires_grad]
    assert any(n.startswith("visual.merger.") for n in frozen) and any("base_layer" in n for n in frozen)
    _step(model)  # B moves off 0: the adapters change the tower's output
    assert any(m.lora_B.weight.abs().sum() > 0 for m in model.visual.modules() if isinstance(m, LoRALinear))
    model.eval()
    with torch.no_grad():
        adapted = model_forward(model, _batch()).logits
    merged = merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    save_pretrained(merged, tmp_path / "export")
    exported = load_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        read_back = model_forward(exported, _batch()).logits
    torch.testing.assert_close(read_back, adapted, rtol=0, atol=1e-5)


def test_a_fully_trained_tower_under_lora_trains_beside_the_adapters():
    model = models.build(_config("full", lora_rank=4), generator=seeding.generator(1, "model_init"))
    trainable = apply_lora(model, model.config.lora, seed=0)
    tower = [n for n, _ in model.named_parameters() if n.startswith("visual.")]
    assert set(tower) <= set(trainable) and not any(isinstance(m, LoRALinear) for m in model.visual.modules())
    before = _tower_params(model)
    _step(model)
    assert not torch.equal(before["visual.blocks.0.attn.qkv.weight"], model.visual.blocks[0].attn.qkv.weight)


def test_unset_the_targets_adapt_the_tower_by_name_as_before():
    model = models.build(_config(None, lora_rank=4), generator=seeding.generator(1, "model_init"))
    apply_lora(model, model.config.lora, seed=0)  # the default targets: Qwen's block linears
    block = model.visual.blocks[0]
    assert isinstance(block.mlp.gate_proj, LoRALinear) and not isinstance(block.attn.qkv, LoRALinear)
    assert not block.norm1.weight.requires_grad


def test_the_key_is_hashed_only_when_set_and_checked():
    base = config_lib.load("configs/tiny-vl-sft.yaml")
    frozen = config_lib.load("configs/tiny-vl-sft.yaml", ["model.qwen2_5_vl.tower=frozen"])
    assert frozen.model.qwen2_5_vl.tower == "frozen"
    assert config_lib.config_hash(frozen) != config_lib.config_hash(base)
    assert config_lib.config_hash(config_lib.load("configs/tiny-vl-sft.yaml", ["model.qwen2_5_vl.tower=null"])) == \
        config_lib.config_hash(base)
    with pytest.raises(ConfigError, match="model.lora.rank") as refused:
        config_lib.load("configs/tiny-vl-sft.yaml", ["model.qwen2_5_vl.tower=lora"])
    assert refused.value.context["key"] == "model.qwen2_5_vl.tower"
    with pytest.raises(ConfigError, match="quantize_base") as refused:
        config_lib.load("configs/tiny-vl-sft.yaml", ["model.qwen2_5_vl.tower=full", "model.lora.rank=4",
                                                     "model.quantize_base=nf4"])
    assert refused.value.context["key"] == "model.qwen2_5_vl.tower"


def test_a_config_json_read_over_the_runs_config_keeps_how_the_tower_trains(tmp_path):
    save_pretrained(models.build(_config(None), generator=seeding.generator(1, "model_init")), tmp_path)
    read = model_config_from_hf(tmp_path, base=_config("frozen"))
    assert read.qwen2_5_vl.tower == "frozen"
    assert not any(p.requires_grad for p in load_pretrained(tmp_path, base=_config("frozen")).visual.parameters())


def test_a_frozen_towers_start_is_recorded_so_a_resume_from_another_start_is_refused():
    """A frozen tower is not in the checkpoint (a resume rebuilds it from the run's start): the run's
    plan records that start's identity, and the checkpoint's frozen models' check compares it."""
    from core.distributed_context import DistributedContext
    from core.exceptions import CheckpointError
    from training.builders import build_model
    from training.checkpoint.state import check_frozen

    def start(*overrides):
        config = config_lib.load("configs/tiny-vl-sft.yaml", ["parallel.device=cpu", "parallel.strategy=none",
                                                              *overrides])
        with DistributedContext.from_env(config.parallel) as dist:
            return build_model(config, dist)[1].base_identity

    assert start() is None  # nothing frozen: nothing to record
    frozen = start("model.qwen2_5_vl.tower=frozen")
    assert frozen["path"] == "init:seed" and frozen == start("model.qwen2_5_vl.tower=frozen")
    other = start("model.qwen2_5_vl.tower=frozen", "train.seed=7")  # another seeded start
    assert other["sha256"] != frozen["sha256"]
    check_frozen({"base": frozen}, {"base": frozen})
    with pytest.raises(CheckpointError, match="frozen base model differs"):
        check_frozen({"base": other}, {"base": frozen})
