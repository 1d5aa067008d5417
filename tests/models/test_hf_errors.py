"""A Hugging Face directory we cannot load exactly is a ConfigError (exit 2) naming file and field."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import models
from core.config import ModelConfig
from core.exceptions import ConfigError, ExitCode, exit_code_for


def _copy(source, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    return target


def _edit_config(directory, **changes):
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def _expect_error(directory, *, file: str, key: str | None) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        models.load_pretrained(directory)
    error = caught.value
    assert error.exit_code == ExitCode.CONFIG == exit_code_for(error) == 2
    assert error.context["file"].endswith(file), error
    assert file in str(error)
    if key is not None:
        assert error.context["key"] == key, error
        assert key in str(error)
    return error


def test_missing_config_json(tmp_path):
    _expect_error(tmp_path, file="config.json", key=None)


def test_missing_directory_through_build(tmp_path):
    with pytest.raises(ConfigError) as caught:
        models.build(ModelConfig(init_from=str(tmp_path / "nowhere")))
    assert caught.value.exit_code == 2 and "config.json" in str(caught.value)


def test_unknown_architecture(qwen2_hf, tmp_path):
    directory = _copy(qwen2_hf[1], tmp_path)
    _edit_config(directory, architectures=["LlamaForCausalLM"], model_type="llama")
    error = _expect_error(directory, file="config.json", key="architectures")
    assert "LlamaForCausalLM" in str(error)


def test_missing_required_field(qwen2_hf, tmp_path):
    directory = _copy(qwen2_hf[1], tmp_path)
    _edit_config(directory, hidden_size=None)
    _expect_error(directory, file="config.json", key="hidden_size")


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters.rope_type"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"vocab_size": "96"}, "vocab_size"),
    ],
    ids=["rope-scaling", "rope-type", "sliding-window", "activation", "kv-heads", "wrong-type"],
)
def test_unsupported_or_invalid_field(qwen2_hf, tmp_path, changes, key):
    directory = _copy(qwen2_hf[1], tmp_path)
    _edit_config(directory, **changes)
    _expect_error(directory, file="config.json", key=key)


def test_shape_mismatch_between_config_and_weights(qwen2_hf, tmp_path):
    directory = _copy(qwen2_hf[1], tmp_path)
    _edit_config(directory, intermediate_size=128)  # the weights were saved with 112
    error = _expect_error(directory, file="model.safetensors", key=None)
    mlp_keys = {f"model.layers.0.mlp.{name}.weight" for name in ("down_proj", "gate_proj", "up_proj")}
    assert error.context["key"] in mlp_keys and error.context["key"] in str(error)
    assert "config.json" in str(error) and "112" in str(error) and "intermediate_size=128" in str(error)


def test_more_layers_in_config_than_in_weights(qwen2_hf, tmp_path):
    directory = _copy(qwen2_hf[1], tmp_path)
    _edit_config(directory, num_hidden_layers=3)
    error = _expect_error(directory, file="model.safetensors", key="model.layers.2.input_layernorm.weight")
    assert "more" in str(error)


def test_untied_config_without_lm_head(qwen3_hf, tmp_path):
    directory = _copy(qwen3_hf[1], tmp_path)  # a tied checkpoint: no lm_head.weight stored
    tensors = load_file(str(directory / "model.safetensors"))
    tensors.pop("lm_head.weight", None)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _edit_config(directory, tie_word_embeddings=False)
    _expect_error(directory, file="model.safetensors", key="lm_head.weight")


def test_missing_weights_file(qwen2_hf, tmp_path):
    directory = _copy(qwen2_hf[1], tmp_path)
    (directory / "model.safetensors").unlink()
    _expect_error(directory, file="model.safetensors", key=None)


def test_unexpected_tensor(qwen2_hf, tmp_path):
    directory = _copy(qwen2_hf[1], tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _expect_error(directory, file="model.safetensors", key="model.layers.0.mlp.extra.weight")


def test_nonzero_o_proj_bias_is_refused(qwen3_hf, tmp_path):
    # Qwen3 attention_bias=true also biases o_proj, which this model does not implement.
    directory = _copy(qwen3_hf[1], tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    for layer in range(2):
        prefix = f"model.layers.{layer}.self_attn"
        for proj in ("q_proj", "k_proj", "v_proj"):
            tensors[f"{prefix}.{proj}.bias"] = torch.zeros(tensors[f"{prefix}.{proj}.weight"].shape[0])
        tensors[f"{prefix}.o_proj.bias"] = torch.full((48,), 0.5)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _edit_config(directory, attention_bias=True)
    _expect_error(directory, file="model.safetensors", key="model.layers.0.self_attn.o_proj.bias")


def test_index_naming_a_missing_shard(qwen2_hf, tmp_path):
    directory = _copy(qwen2_hf[1], tmp_path)
    (directory / "model.safetensors").rename(directory / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_error(directory, file="model-00002-of-00002.safetensors", key="weight_map")


# A directory used as init_from, reference or teacher is data from elsewhere: the loader refuses
# what would read other files or poison the run, naming the file and the tensor or key.


@pytest.mark.parametrize("entry", ["../outside/model.safetensors", "/etc/model.safetensors", "sub/../../x.safetensors"])
def test_index_entry_outside_the_model_dir_is_refused(qwen2_hf, tmp_path, entry):
    directory = _copy(qwen2_hf[1], tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copyfile(directory / "model.safetensors", outside / "model.safetensors")  # a valid file: only the place is wrong
    (directory / "model.safetensors").unlink()
    names = load_file(str(outside / "model.safetensors"))
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, entry)}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    error = _expect_error(directory, file="model.safetensors.index.json", key="weight_map")
    assert entry in str(error) and "outside the model directory" in str(error)


def test_index_entry_through_a_symlink_leaving_the_dir_is_refused(qwen2_hf, tmp_path):
    directory = _copy(qwen2_hf[1], tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    (directory / "model.safetensors").rename(outside)
    (directory / "model-00001-of-00001.safetensors").symlink_to(outside)
    names = load_file(str(outside))
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect_error(directory, file="model.safetensors.index.json", key="weight_map")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_weight_is_refused(qwen3_hf, tmp_path, value):
    directory = _copy(qwen3_hf[1], tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    error = _expect_error(directory, file="model.safetensors", key="model.layers.1.mlp.up_proj.weight")
    assert "non-finite" in str(error)
    with pytest.raises(ConfigError, match="non-finite"):  # the same refusal where a run starts from it
        models.build(ModelConfig(init_from=str(directory)))


@pytest.mark.parametrize("changes, key", [
    ({"rope_theta": float("nan"), "rope_parameters": None}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, "rope_parameters.rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, "rope_parameters.rope_theta"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
], ids=["rope_theta-nan", "rope_parameters-nan", "rope_parameters-inf", "rms_norm_eps-nan"])
def test_non_finite_config_value_is_refused(qwen2_hf, tmp_path, changes, key):
    directory = _copy(qwen2_hf[1], tmp_path)
    _edit_config(directory, **changes)  # json writes NaN / Infinity, which Python's json reads back
    assert "NaN" in (directory / "config.json").read_text() or "Infinity" in (directory / "config.json").read_text()
    error = _expect_error(directory, file="config.json", key=key)
    assert "finite" in str(error)


def test_damaged_safetensors_file_is_a_one_line_config_error(qwen2_hf, tmp_path):
    directory = _copy(qwen2_hf[1], tmp_path)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated copy
    error = _expect_error(directory, file="model.safetensors", key=None)
    assert "not a readable safetensors file" in str(error) and "\n" not in str(error)
