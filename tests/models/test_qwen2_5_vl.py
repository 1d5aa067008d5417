"""model.arch qwen2_5_vl against transformers' Qwen2_5_VLForConditionalGeneration (models/qwen_vl/).

One tiny random model (the shapes of transformers' own Qwen2.5-VL tests, with a 2 x 2 merge and
windows of 2 x 2 merged tokens, so the window order, the edge windows and the full-attention
block all matter), exported by us and loaded by transformers: fp32 logits within 1e-5 for text
alone, one image, several images per row and images of different sizes in one batch; its M-RoPE
positions equal transformers' get_rope_index; a checkpoint transformers wrote loads in ours with
the same logits; placeholders that do not match the images are a DataError naming the row.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core import config as config_lib
from core.config_schema import model_config_class
from core.exceptions import ConfigError, DataError
from models.forward import ModelInputs, model_forward
from models.hf_weights import load_pretrained, save_pretrained
from models.qwen_vl.family import QwenVLSettings
from models.qwen_vl.model import empty_model
from tests.models.vl_cases import (
    END, IMAGE, INPUT_CASES, START, VIDEO, assert_logits_equal, assert_logits_equal_transformers, export_pair,
    hf_inputs, rows_with_images,
)

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = QwenVLSettings(depth=3, hidden_size=32, num_heads=4, intermediate_size=48, patch_size=14,
                          temporal_patch_size=2, spatial_merge_size=2, window_size=56, fullatt_block_indexes=(1,),
                          image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                          vision_end_token_id=END, mrope_section=(2, 1, 1))


def tiny_config(**changes):
    values = dict(arch="qwen2_5_vl", vocab_size=99, hidden_size=32, intermediate_size=37, num_layers=2, num_heads=4,
                  num_kv_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5, tie_embeddings=False,
                  max_position_embeddings=512, qwen2_5_vl=SETTINGS)
    return model_config_class()(**{**values, **changes})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Our model (random, norms and biases moved off 1 and 0) and transformers' model loaded from its export."""
    return export_pair(empty_model(tiny_config()), tmp_path_factory.mktemp("qwen_vl"), transformers.Qwen2_5_VLForConditionalGeneration)


@pytest.mark.parametrize("grids", INPUT_CASES)
def test_logits_equal_transformers(pair, grids):
    assert_logits_equal_transformers(pair, grids)


def test_mrope_positions_equal_transformers_get_rope_index(pair):
    ours, theirs, _ = pair
    ids, media = rows_with_images([[(1, 6, 10), (1, 4, 4)], [], [(1, 12, 8)]])
    grids = torch.stack([g for row in media["image_grid_thw"] for g in row])
    expected, _ = theirs.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=grids)
    positions = ours.model_positions(ids, None, media)
    assert positions.shape == (3, *ids.shape)
    assert torch.equal(positions, expected)


def test_a_packed_document_gets_the_positions_it_has_alone(pair):
    ours = pair[0]
    first, first_media = rows_with_images([[(1, 4, 4)]], seed=3)
    second, second_media = rows_with_images([[(1, 6, 10)]], seed=4)
    packed = torch.cat([first, second], dim=1)
    position_ids = torch.cat([torch.arange(first.shape[1]), torch.arange(second.shape[1])])[None]
    media = {k: [first_media[k][0] + second_media[k][0]] for k in first_media}
    positions = ours.model_positions(packed, position_ids, media)
    assert torch.equal(positions[:, :, first.shape[1]:], ours.model_positions(second, None, second_media))


@pytest.mark.parametrize("cut", ["one-placeholder-short", "no-image-for-the-run", "an-image-without-a-run"])
def test_placeholders_that_do_not_match_the_grids_name_the_row(pair, cut):
    ours = pair[0]
    ids, media = rows_with_images([[(1, 4, 4)], [(1, 8, 12)]])
    if cut == "one-placeholder-short":
        ids[1, (ids[1] == IMAGE).nonzero()[0, 0]] = 50
    elif cut == "no-image-for-the-run":
        media = {k: [v[0], []] for k, v in media.items()}
    else:
        ids[1][ids[1] == IMAGE] = 50
    with pytest.raises(DataError) as error:
        model_forward(ours, ModelInputs(ids, media=media))
    assert error.value.context["row"] == 1
    assert "row 1" in error.value.message


def test_a_checkpoint_transformers_wrote_loads_with_equal_logits(tmp_path):
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=32, num_heads=4, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[0]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    theirs = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf").eval()
    assert ours.config.qwen2_5_vl.fullatt_block_indexes == (0,) and ours.config.qwen2_5_vl.depth == 2
    ids, media = rows_with_images([[(1, 8, 12)], [(1, 4, 4)]], seed=5)
    with torch.no_grad():
        assert_logits_equal(model_forward(ours, ModelInputs(ids, media=media)).logits, theirs(**hf_inputs(ids, media)).logits)
    # Exported again: the same tensor names and shapes as the file transformers wrote.
    save_pretrained(ours, tmp_path / "again")
    assert _shapes(tmp_path / "again") == _shapes(tmp_path / "hf")
    # A tensor of a shape config.json does not imply is refused, naming it.
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as reader:
        tensors = {key: reader.get_tensor(key) for key in reader.keys()}
    tensors["visual.merger.mlp.2.weight"] = tensors["visual.merger.mlp.2.weight"][:, :-1].contiguous()
    save_file(tensors, str(tmp_path / "again" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError) as error:
        load_pretrained(tmp_path / "again")
    assert error.value.context["key"] == "visual.merger.mlp.2.weight"


def _shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as reader:
        return {key: tuple(reader.get_slice(key).get_shape()) for key in reader.keys()}


def test_the_export_config_reads_back_as_the_same_model_config(pair):
    ours, _, path = pair
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    again = load_pretrained(path)
    assert again.config.qwen2_5_vl == dataclasses.replace(SETTINGS, out_hidden_size=32)
    assert dataclasses.replace(again.config, qwen2_5_vl=SETTINGS) == dataclasses.replace(ours.config, qkv_bias=True,
                                                                                           qk_norm=False)


def test_the_plan_has_the_vision_blocks_then_the_language_blocks(pair):
    plan = pair[0].parallel_plan
    assert [stack.path for stack in plan.stacks] == ["visual.blocks", "layers"]
    assert plan.in_blocks("visual.blocks.2.attn.qkv") and plan.in_blocks("layers.1.mlp.up_proj")
    from models.flops import num_params
    assert num_params(pair[0].config) == sum(p.numel() for p in pair[0].parameters())


def test_use_numerics_reaches_both_towers():
    from models.numerics import Numerics

    model = empty_model(tiny_config())
    numerics = Numerics.for_model(model.config)
    model.use_numerics(numerics)
    assert model.numerics is numerics
    assert all(b.attn.numerics is numerics for b in model.visual.blocks)
    assert all(b.self_attn.numerics is numerics for b in model.layers)


def test_the_section_is_read_from_yaml_and_checked_against_model_keys():
    tiny = ROOT / "configs" / "tiny.yaml"
    base = ["model.arch=qwen2_5_vl", "model.qwen2_5_vl.mrope_section=[2,1,1]", "model.vocab_size=99",
            "model.hidden_size=32", "model.head_dim=8", "model.num_heads=4", "model.num_kv_heads=2", "model.intermediate_size=37",
            "model.qwen2_5_vl.depth=2", "model.qwen2_5_vl.hidden_size=32", "model.qwen2_5_vl.num_heads=4",
            "model.qwen2_5_vl.fullatt_block_indexes=[1]", "model.qwen2_5_vl.window_size=56",
            f"model.qwen2_5_vl.image_token_id={IMAGE}", f"model.qwen2_5_vl.video_token_id={VIDEO}",
            f"model.qwen2_5_vl.vision_start_token_id={START}", f"model.qwen2_5_vl.vision_end_token_id={END}"]
    config = config_lib.load(tiny, base)
    assert config.model.qwen2_5_vl.mrope_section == (2, 1, 1)
    assert config_lib.config_hash(config) != config_lib.config_hash(config_lib.load(tiny, base[:1] + base[2:]
                                                                                     + ["model.qwen2_5_vl.mrope_section=[1,2,1]"]))
    with pytest.raises(ConfigError) as error:
        config_lib.load(tiny, base + ["model.qwen2_5_vl.mrope_section=[2,2,2]"])
    assert error.value.context["key"] == "model.qwen2_5_vl.mrope_section"
    with pytest.raises(ConfigError) as error:
        config_lib.load(tiny, base + ["model.qwen2_5_vl.image_token_id=151655"])
    assert error.value.context["key"] == "model.qwen2_5_vl.image_token_id"


def test_both_stacks_checkpointed_give_the_gradients_of_the_plain_model(pair):
    """Activation checkpointing wraps the blocks of both stacks (the plan's), and the gradients of both towers
    are those of the unwrapped model; a batch without images still reaches the tower (zero gradients)."""
    from distributed.activation_checkpoint import apply_activation_checkpointing
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    ids, media = rows_with_images([[(1, 8, 12)], [(1, 4, 4), (1, 6, 6)]], seed=6)

    def gradients(model):
        model.zero_grad(set_to_none=True)
        model_forward(model, ModelInputs(ids, media=media)).logits.pow(2).mean().backward()
        return {name: param.grad.clone() for name, param in model.named_parameters()}

    plain = empty_model(tiny_config())
    plain.load_state_dict(pair[0].state_dict())
    expected = gradients(plain)
    assert expected["visual.patch_embed.proj.weight"].abs().sum() > 0
    wrapped = empty_model(tiny_config())
    wrapped.load_state_dict(pair[0].state_dict())
    apply_activation_checkpointing(wrapped, "full")
    assert all(isinstance(b, CheckpointWrapper) for b in (*wrapped.visual.blocks, *wrapped.layers))
    got = {name.replace("._checkpoint_wrapped_module", ""): g for name, g in gradients(wrapped).items()}
    assert got.keys() == expected.keys()
    assert all(torch.allclose(got[k], expected[k], rtol=1e-5, atol=1e-7) for k in expected)

    plain.zero_grad(set_to_none=True)
    model_forward(plain, ModelInputs(ids[:, :3])).logits.sum().backward()  # text only
    assert plain.visual.blocks[0].attn.qkv.weight.grad is not None
    assert not plain.visual.blocks[0].attn.qkv.weight.grad.any()


def test_the_cached_text_forward_gives_the_full_forwards_logits(pair):
    """The sampler's path (text only): a prompt fed in two chunks, then a token, gives each step's logits
    of the full forward; images there are refused."""
    from models.generation.kv_cache import KVCache

    ours = pair[0]
    ids = torch.randint(7, 99, (2, 9), generator=torch.Generator().manual_seed(7))
    cache = KVCache.for_spec(ours.generation_spec(), batch=2, slots=16)
    positions = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        full = model_forward(ours, ModelInputs(ids)).logits
        model_forward(ours, ModelInputs(ids[:, :5], position_ids=positions[:, :5]), cache=cache)
        chunk = model_forward(ours, ModelInputs(ids[:, 5:8], position_ids=positions[:, 5:8]), cache=cache).logits
        last = model_forward(ours, ModelInputs(ids[:, 8:], position_ids=positions[:, 8:]), cache=cache).logits
    assert torch.allclose(chunk, full[:, 7], rtol=1e-5, atol=1e-6) and torch.allclose(last, full[:, 8], rtol=1e-5, atol=1e-6)
    image_ids, media = rows_with_images([[(1, 4, 4)]])
    with pytest.raises(ConfigError):
        model_forward(ours, ModelInputs(image_ids, position_ids=torch.arange(image_ids.shape[1])[None], media=media),
                      cache=KVCache.for_spec(ours.generation_spec(), batch=1, slots=64))
