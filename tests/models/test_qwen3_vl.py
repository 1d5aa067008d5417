"""model.arch qwen3_vl against transformers' Qwen3VLForConditionalGeneration (models/qwen3_vl/).

One tiny random model (a 2 x 2 merge, a 4 x 4 grid of learned positions resampled to larger and
smaller images, DeepStack from vision blocks 0 and 2 into language blocks 0 and 1, head_dim 16 so
the interleaved M-RoPE sections give height and width two pairs each), exported by us and loaded
by transformers: fp32 logits within 1e-5 for text alone, one image, several images per row and
images of different sizes in one batch; its M-RoPE positions equal transformers' get_rope_index;
a checkpoint transformers wrote loads in ours with the same logits and exports again with the same
tensors, tied or not; a published config.json reads; DeepStack and the learned positions reach the
logits; both stacks under activation checkpointing give the plain gradients; the section's checks
name their keys.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from core import config as config_lib
from core.config_schema import model_config_class
from core.exceptions import ConfigError, DataError
from models.forward import ModelInputs, model_forward
from models.hf_weights import load_pretrained, save_pretrained
from models.qwen3_vl.family import Qwen3VLSettings
from models.qwen3_vl.model import empty_model, interleaved_axes
from tests.models.vl_cases import (
    END, IMAGE, INPUT_CASES, START, VIDEO, assert_logits_equal, assert_logits_equal_transformers, export_pair,
    hf_inputs, rows_with_images,
)

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = Qwen3VLSettings(depth=3, hidden_size=32, num_heads=4, intermediate_size=48, patch_size=14,
                           temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=(0, 2), image_token_id=IMAGE, video_token_id=VIDEO,
                           vision_start_token_id=START, vision_end_token_id=END, mrope_section=(4, 2, 2))


def tiny_config(**changes):
    values = dict(arch="qwen3_vl", vocab_size=99, hidden_size=32, intermediate_size=37, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, tie_embeddings=False,
                  max_position_embeddings=512, qwen3_vl=SETTINGS)
    return model_config_class()(**{**values, **changes})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Our model (random, norms and biases moved off 1 and 0) and transformers' model loaded from its export."""
    return export_pair(empty_model(tiny_config()), tmp_path_factory.mktemp("qwen3_vl"), transformers.Qwen3VLForConditionalGeneration)


@pytest.mark.parametrize("grids", INPUT_CASES)
def test_logits_equal_transformers(pair, grids):
    assert_logits_equal_transformers(pair, grids)


def test_deepstack_and_the_learned_positions_reach_the_logits(pair):
    """Without DeepStack's features (their mergers' output zeroed), or with other learned positions, the
    logits of a row with an image move: both are part of the function transformers computes."""
    ours = pair[0]
    ids, media = rows_with_images([[(1, 8, 12)]], seed=1)
    copy = empty_model(tiny_config())
    copy.load_state_dict(ours.state_dict())
    copy.eval()
    with torch.no_grad():
        reference = model_forward(copy, ModelInputs(ids, media=media)).logits
        copy.visual.pos_embed.weight.add_(1.0)
        assert not torch.allclose(model_forward(copy, ModelInputs(ids, media=media)).logits, reference)
        copy.load_state_dict(ours.state_dict())
        for merger in copy.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
        without = model_forward(copy, ModelInputs(ids, media=media)).logits
    assert not torch.allclose(without, reference)
    text = ids[0] != IMAGE
    first_image = int((~text).nonzero()[0, 0])
    assert torch.equal(without[0, :first_image], reference[0, :first_image])  # before the image: causal, untouched


def test_interleaved_sections_give_height_and_width_every_third_pair():
    assert interleaved_axes(8, (4, 2, 2)).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    assert interleaved_axes(64, (24, 20, 20)).tolist()[:6] == [0, 1, 2, 0, 1, 2]
    assert interleaved_axes(64, (24, 20, 20)).tolist()[-6:] == [1, 2, 0, 0, 0, 0]
    assert interleaved_axes(64, (24, 20, 20)).bincount().tolist() == [24, 20, 20]


def test_mrope_positions_equal_transformers_get_rope_index(pair):
    ours, theirs, _ = pair
    ids, media = rows_with_images([[(1, 6, 10), (1, 4, 4)], [], [(1, 12, 8)]])
    grids = torch.stack([g for row in media["image_grid_thw"] for g in row])
    expected, _ = theirs.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=grids)
    assert torch.equal(ours.model_positions(ids, None, media), expected)


def test_placeholders_that_do_not_match_the_grids_name_the_row_and_the_arch(pair):
    ours = pair[0]
    ids, media = rows_with_images([[(1, 4, 4)], [(1, 8, 12)]])
    ids[1, (ids[1] == IMAGE).nonzero()[0, 0]] = 50
    with pytest.raises(DataError) as error:
        model_forward(ours, ModelInputs(ids, media=media))
    assert error.value.context["row"] == 1
    with pytest.raises(ConfigError) as error:
        model_forward(ours, ModelInputs(ids, media={"pixels": []}))
    assert "qwen3_vl" in error.value.message


def test_a_checkpoint_transformers_wrote_loads_with_equal_logits(tmp_path):
    config = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=32, num_heads=4, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=9,
                           deepstack_visual_indexes=[1]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    theirs = transformers.Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers initializes norms to 1 and biases to 0: move them
        for name, param in theirs.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn(param.shape))
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf").eval()
    assert ours.config.qwen3_vl.deepstack_visual_indexes == (1,) and ours.config.head_dim == 8
    ids, media = rows_with_images([[(1, 8, 12)], [(1, 4, 4)]], seed=5)
    with torch.no_grad():
        assert_logits_equal(model_forward(ours, ModelInputs(ids, media=media)).logits,
                            theirs(**hf_inputs(ids, media)).logits)
    save_pretrained(ours, tmp_path / "again")  # the same tensor names, shapes and values as transformers wrote
    assert _tensors(tmp_path / "again").keys() == _tensors(tmp_path / "hf").keys()
    assert all(torch.equal(a, _tensors(tmp_path / "hf")[k]) for k, a in _tensors(tmp_path / "again").items())


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as reader:
        return {key: reader.get_tensor(key) for key in reader.keys()}


def test_the_export_config_reads_back_as_the_same_model_config(pair):
    ours, _, path = pair
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3VLForConditionalGeneration"]
    again = load_pretrained(path)
    assert again.config.qwen3_vl == dataclasses.replace(SETTINGS, out_hidden_size=32)
    assert dataclasses.replace(again.config, qwen3_vl=SETTINGS) == dataclasses.replace(ours.config, qkv_bias=False,
                                                                                         qk_norm=True)


def test_the_plan_has_the_vision_blocks_then_the_language_blocks_and_counts_every_parameter(pair):
    from models.flops import num_params

    ours = pair[0]
    plan = ours.parallel_plan
    assert [stack.path for stack in plan.stacks] == ["visual.blocks", "layers"]
    assert plan.in_blocks("visual.blocks.2.mlp.linear_fc1") and plan.in_blocks("layers.1.self_attn.q_norm")
    assert all(ours.get_submodule(name) is not None for name in plan.root_modules)
    assert num_params(ours.config) == sum(p.numel() for p in ours.parameters())


def test_a_text_only_batch_reaches_every_tower_parameter_with_zero_gradients():
    model = empty_model(tiny_config())
    model.init_weights(torch.Generator().manual_seed(3))
    ids = torch.randint(7, 99, (2, 5), generator=torch.Generator().manual_seed(4))
    model_forward(model, ModelInputs(ids)).logits.sum().backward()
    tower = dict(model.visual.named_parameters())
    assert all(p.grad is not None and not p.grad.any() for p in tower.values())
    assert "deepstack_merger_list.1.norm.weight" in tower


def test_the_cached_text_forward_gives_the_full_forwards_logits(pair):
    from models.generation.kv_cache import KVCache

    ours = pair[0]
    ids = torch.randint(7, 99, (2, 9), generator=torch.Generator().manual_seed(7))
    cache = KVCache.for_spec(ours.generation_spec(), batch=2, slots=16)
    positions = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        full = model_forward(ours, ModelInputs(ids)).logits
        model_forward(ours, ModelInputs(ids[:, :5], position_ids=positions[:, :5]), cache=cache)
        chunk = model_forward(ours, ModelInputs(ids[:, 5:8], position_ids=positions[:, 5:8]), cache=cache).logits
    assert torch.allclose(chunk, full[:, 7], rtol=1e-5, atol=1e-6)


def test_the_section_is_read_from_yaml_and_checked_against_model_keys():
    tiny = ROOT / "configs" / "tiny.yaml"
    base = ["model.arch=qwen3_vl", "model.vocab_size=99", "model.hidden_size=32", "model.head_dim=16",
            "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=37", "model.num_layers=3",
            "model.qwen3_vl.depth=3", "model.qwen3_vl.hidden_size=32", "model.qwen3_vl.num_heads=4",
            "model.qwen3_vl.num_position_embeddings=16", "model.qwen3_vl.deepstack_visual_indexes=[0,2]",
            "model.qwen3_vl.mrope_section=[4,2,2]", f"model.qwen3_vl.image_token_id={IMAGE}",
            f"model.qwen3_vl.video_token_id={VIDEO}", f"model.qwen3_vl.vision_start_token_id={START}",
            f"model.qwen3_vl.vision_end_token_id={END}"]
    config = config_lib.load(tiny, base)
    assert config.model.qwen3_vl.deepstack_visual_indexes == (0, 2)
    assert config_lib.config_hash(config) != config_lib.config_hash(
        config_lib.load(tiny, base + ["model.qwen3_vl.mrope_section=[3,3,2]"]))
    for override, key in [("model.qwen3_vl.mrope_section=[2,2,2]", "model.qwen3_vl.mrope_section"),
                          ("model.qwen3_vl.mrope_section=[0,4,4]", "model.qwen3_vl.mrope_section"),
                          ("model.qwen3_vl.deepstack_visual_indexes=[2,0]", "model.qwen3_vl.deepstack_visual_indexes"),
                          ("model.qwen3_vl.deepstack_visual_indexes=[3]", "model.qwen3_vl.deepstack_visual_indexes"),
                          ("model.qwen3_vl.num_position_embeddings=12", "model.qwen3_vl.num_position_embeddings"),
                          ("model.qk_norm=false", "model.qk_norm"),
                          ("model.qwen3_vl.image_token_id=151655", "model.qwen3_vl.image_token_id")]:
        with pytest.raises(ConfigError) as error:
            config_lib.load(tiny, base + [override])
        assert error.value.context["key"] == key, override


def test_both_stacks_checkpointed_give_the_gradients_of_the_plain_model(pair):
    """Activation checkpointing wraps the blocks of both stacks (the plan's), DeepStack's additions sitting
    between checkpointed language blocks, and the gradients of both towers are the unwrapped model's."""
    from distributed.activation_checkpoint import apply_activation_checkpointing
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    ids, media = rows_with_images([[(1, 8, 12)], [(1, 4, 4), (1, 6, 6)]], seed=6)

    def gradients(model):
        model.zero_grad(set_to_none=True)
        model_forward(model, ModelInputs(ids, media=media)).logits.pow(2).mean().backward()
        return {name.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for name, p in model.named_parameters()}

    plain = empty_model(tiny_config())
    plain.load_state_dict(pair[0].state_dict())
    expected = gradients(plain)
    assert expected["visual.deepstack_merger_list.0.linear_fc1.weight"].abs().sum() > 0
    wrapped = empty_model(tiny_config())
    wrapped.load_state_dict(pair[0].state_dict())
    apply_activation_checkpointing(wrapped, "full")
    assert all(isinstance(b, CheckpointWrapper) for b in (*wrapped.visual.blocks, *wrapped.layers))
    got = gradients(wrapped)
    assert got.keys() == expected.keys()
    assert all(torch.allclose(got[k], expected[k], rtol=1e-5, atol=1e-7) for k in expected)


def _published_config() -> dict:
    """A config.json in the published checkpoints' layout (rope_scaling, rope_theta beside it), tiny sizes."""
    return {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "image_token_id": IMAGE,
            "video_token_id": VIDEO, "vision_start_token_id": START, "vision_end_token_id": END,
            "tie_word_embeddings": True,
            "text_config": {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
                            "attention_bias": False, "rope_theta": 5000000, "tie_word_embeddings": True,
                            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [4, 2, 2],
                                             "rope_type": "default"}},
            "vision_config": {"model_type": "qwen3_vl", "depth": 2, "hidden_size": 32, "hidden_act": "gelu_pytorch_tanh",
                              "intermediate_size": 48, "num_heads": 4, "in_channels": 3, "patch_size": 16,
                              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 32,
                              "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]}}


def test_a_published_config_reads_and_fields_it_cannot_express_name_themselves(tmp_path):
    from models.hf_config import model_config_from_hf

    (tmp_path / "config.json").write_text(json.dumps(_published_config()))
    config = model_config_from_hf(tmp_path)
    assert (config.arch, config.rope_theta, config.head_dim, config.tie_embeddings) == ("qwen3_vl", 5e6, 16, True)
    assert config.qwen3_vl.mrope_section == (4, 2, 2) and config.qwen3_vl.deepstack_visual_indexes == (0, 1)
    for where, field, value in [("text_config", "attention_bias", True), ("vision_config", "hidden_act", "gelu"),
                                ("text_config", "rope_scaling", {"rope_type": "yarn", "factor": 2.0})]:
        raw = _published_config()
        raw[where][field] = value
        (tmp_path / "config.json").write_text(json.dumps(raw))
        with pytest.raises(ConfigError) as error:
            model_config_from_hf(tmp_path)
        assert error.value.context["key"].startswith(field), (field, error.value.context)


def test_a_tied_model_exports_and_reads_back_with_equal_logits(tmp_path):
    """Qwen3-VL's small checkpoints tie the output head to the embedding: transformers loads our tied export,
    and its own save of it reads back tied, the logits equal throughout."""
    ours = empty_model(tiny_config(tie_embeddings=True))
    ours.init_weights(torch.Generator().manual_seed(8))
    save_pretrained(ours, tmp_path / "ours")
    theirs = transformers.Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "ours").eval()
    theirs.save_pretrained(tmp_path / "theirs")
    again = load_pretrained(tmp_path / "theirs").eval()
    ids, media = rows_with_images([[(1, 4, 8)]], seed=9)
    with torch.no_grad():
        reference = theirs(**hf_inputs(ids, media)).logits
        assert_logits_equal(model_forward(ours.eval(), ModelInputs(ids, media=media)).logits, reference)
        assert_logits_equal(model_forward(again, ModelInputs(ids, media=media)).logits, reference)
    assert again.config.tie_embeddings and again.lm_head.weight is again.embed_tokens.weight
