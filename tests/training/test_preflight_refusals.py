"""Configs that would fail deep inside training are refused up front (exit 2, key named):
a vocabulary smaller than the tokenizer's, a model whose training state cannot fit."""

from __future__ import annotations

import psutil
import pytest
import torch

from core import config as config_lib
from core.distributed_context import ProcessInfo
from core.exceptions import ConfigError, ExitCode
from tests import launch
from training import session


def test_vocab_smaller_than_the_tokenizer_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        session.check_vocab_covers_tokenizer(100, "byte")
    assert info.value.context["key"] == "model.vocab_size" and "258" in str(info.value)
    session.check_vocab_covers_tokenizer(258, "byte")


def test_a_model_that_cannot_fit_host_memory_is_refused_with_the_estimate():
    config = config_lib.load(launch.ROOT / "configs" / "tiny.yaml", ["model.hidden_size=1000000", "parallel.device=cpu"])
    with pytest.raises(ConfigError) as info:
        session.check_model_fits(config, torch.device("cpu"), ProcessInfo(rank=0, world_size=1, local_rank=0))
    text = str(info.value)
    assert "GiB" in text and "available" in text and info.value.context["key"] == "model"


def test_ranks_on_one_host_share_its_memory():
    config = config_lib.load(launch.ROOT / "configs" / "tiny.yaml", ["parallel.device=cpu"])
    one = ProcessInfo(rank=0, world_size=1, local_rank=0)
    session.check_model_fits(config, torch.device("cpu"), one)  # the tiny model fits
    # As many local ranks as it takes for their copies to exceed the host's memory.
    from models.flops import num_params

    many = psutil.virtual_memory().total // (num_params(config.model) * 16) + 1
    with pytest.raises(ConfigError):
        session.check_model_fits(config, torch.device("cpu"), ProcessInfo(0, int(many), 0, int(many)))


def test_train_refuses_a_huge_model_before_writing_anything(tmp_path):
    root = tmp_path / "runs"
    proc = launch.train(tmp_path, ["--config", str(launch.ROOT / "configs" / "tiny.yaml"), "model.hidden_size=1000000",
                                   f"run.root={root}"], nproc=1, timeout=120)
    assert proc.returncode == ExitCode.CONFIG, proc.stderr
    assert "model" in proc.stderr and "GiB" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not root.exists()


# --------------------------------------------------------------------------- frozen models and sources
# Every model a run builds is in the estimate, and every bad frozen-model source is a config error,
# all before the run dir exists (issue 44 item 4).

def _teacher_dir(tmp_path, **shape) -> str:
    """A Hugging Face directory holding only a config.json: the tiny model's shape with ``shape``."""
    import dataclasses
    import json

    from models.hf_config import hf_config_dict
    from models.qwen.dims import resolve_dims

    tiny = config_lib.load(launch.ROOT / "configs" / "tiny.yaml", []).model
    model = dataclasses.replace(tiny, **shape)
    directory = tmp_path / "teacher"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config_dict(model, resolve_dims(model), "float32")))
    return str(directory)


def _distill(teacher: str, *extra: str):
    return config_lib.load(launch.ROOT / "configs" / "tiny-distill.yaml",
                           [f"objective.distill.teacher={teacher}", "parallel.device=cpu", *extra])


ONE = ProcessInfo(rank=0, world_size=1, local_rank=0)


@pytest.mark.parametrize("shape", [{"hidden_size": 10_000_000}, {"num_layers": 1_000_000}])
def test_a_huge_distillation_teacher_is_in_the_memory_estimate(tmp_path, shape):
    config = _distill(_teacher_dir(tmp_path, **shape))
    with pytest.raises(ConfigError) as info:
        session.check_model_fits(config, torch.device("cpu"), ONE)
    assert info.value.context["key"] == "objective.distill.teacher"
    assert "a teacher of" in str(info.value) and "GiB" in str(info.value)


@pytest.mark.parametrize("key", ["objective.distill.teacher", "model.init_from"])
def test_a_model_directory_without_its_weights_is_a_config_error_before_the_run_dir(tmp_path, key):
    directory = _teacher_dir(tmp_path)  # the tiny model's config.json and no safetensors file
    if key == "model.init_from":
        config = config_lib.load(launch.ROOT / "configs" / "tiny.yaml", [f"model.init_from={directory}",
                                                                         "parallel.device=cpu"])
    else:
        config = _distill(directory)
    with pytest.raises(ConfigError) as info:
        session.check_model_fits(config, torch.device("cpu"), ONE)
    assert info.value.context["key"] == key and "has neither model.safetensors" in info.value.message


def test_a_frozen_reference_counts_as_much_as_its_weights():
    from training.memory_estimate import run_footprints

    config = config_lib.load(launch.ROOT / "configs" / "tiny-dpo.yaml", ["parallel.device=cpu"])
    model, reference = run_footprints(config)
    assert reference.key == "objective.dpo.reference" and reference.params == model.params
    assert reference.bytes == 4 * model.params and model.bytes == 16 * model.params  # fp32 weights; AdamW state
    off = config_lib.load(launch.ROOT / "configs" / "tiny-dpo.yaml", ["objective.dpo.loss=simpo"])
    assert [m.key for m in run_footprints(off)] == ["model"]  # reference-free: no second model


@pytest.mark.parametrize("source, says", [
    ("run:nonexistent", "no run 'nonexistent'"),
    ("/no/such/model", "is neither 'init'"),
])
def test_a_bad_reference_source_is_a_config_error_naming_the_key(source, says):
    config = config_lib.load(launch.ROOT / "configs" / "tiny-dpo.yaml",
                             [f"objective.dpo.reference={source}", "parallel.device=cpu"])
    with pytest.raises(ConfigError) as info:
        session.check_model_fits(config, torch.device("cpu"), ONE)
    assert info.value.exit_code == ExitCode.CONFIG and "resume error" not in str(info.value)
    assert info.value.context["key"] == "objective.dpo.reference" and says in info.value.message


def test_a_lora_init_from_that_is_no_adapter_is_a_config_error(tmp_path):
    args = session.Args(config=str(launch.ROOT / "configs" / "tiny-lora.yaml"), resume=None, replay=None, step=None,
                        dump=None, overrides=(f"model.lora.init_from={tmp_path}", "parallel.device=cpu"))
    with pytest.raises(ConfigError) as info:
        session.resolve_config(args)
    assert info.value.context["key"] == "model.lora.init_from" and "adapter_config.json" in info.value.message


@pytest.mark.slow  # starts train.py
@pytest.mark.parametrize("override, key", [
    ("objective.distill.teacher={teacher}", "objective.distill.teacher"),
    ("objective.distill.teacher=run:nonexistent", "objective.distill.teacher"),
])
def test_train_refuses_a_huge_or_missing_teacher_before_writing_anything(tmp_path, override, key):
    root = tmp_path / "runs"
    teacher = _teacher_dir(tmp_path, hidden_size=10_000_000)
    proc = launch.train(tmp_path, ["--config", str(launch.ROOT / "configs" / "tiny-distill.yaml"),
                                   override.format(teacher=teacher), "parallel.device=cpu", f"run.root={root}"],
                        nproc=1, timeout=120)
    assert proc.returncode == ExitCode.CONFIG, proc.stderr
    assert f"key={key}" in proc.stderr and "config error" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not root.exists()


def test_generate_refuses_a_model_that_cannot_fit_before_reading_weights(tmp_path, capsys):
    from training.__main__ import main

    model = _teacher_dir(tmp_path, hidden_size=10_000_000)  # a config.json and no weights at all
    code = main(["generate", "--from", model, "--prompt", "Hi", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == ExitCode.CONFIG and "GiB" in err and "key=--from" in err
    assert len(err.splitlines()) == 1


def _ppo(*extra: str):
    return config_lib.load(launch.ROOT / "configs" / "tiny-ppo.yaml", ["parallel.device=cpu", *extra])


def test_ppo_counts_its_critic_as_trained_and_its_reference_and_reward_model_as_frozen(tmp_path):
    from models.flops import num_params
    from training.memory_estimate import run_footprints

    reward = _teacher_dir(tmp_path, num_layers=3)  # a reward model's shape: 3 layers
    config = _ppo(f"objective.ppo.rewards=[{{name: model, path: '{reward}'}}]")
    model, reference, reward_model, critic = run_footprints(config)
    params, hidden = model.params, config.model.hidden_size
    assert [m.key for m in (model, reference, reward_model, critic)] == [
        "model", "objective.ppo.reference", "objective.ppo.rewards[0].path", "objective.ppo.critic"]
    assert reference.bytes == 4 * params and model.bytes == 16 * params  # fp32 weights; + grads and AdamW state
    shape = config_lib.load(launch.ROOT / "configs" / "tiny.yaml", ["model.num_layers=3"]).model
    assert reward_model.role == "a reward model" and reward_model.bytes == 4 * num_params(shape)
    # the critic: the policy's trunk and a value head Linear(hidden, 1), trained (weights, grads, AdamW)
    assert critic.role == "a critic" and critic.bytes == 16 * (params + hidden + 1) and not critic.sharded
    untied = run_footprints(_ppo("model.tie_embeddings=false", "objective.ppo.kl_coef=0"))
    policy, critic = untied
    output = config.model.vocab_size * hidden  # never used by the critic: weights only
    assert critic.bytes == 16 * (policy.params - output + hidden + 1) + 4 * output


def test_a_huge_critic_is_refused_before_the_run_dir_naming_its_key(tmp_path):
    config = _ppo(f"objective.ppo.critic={_teacher_dir(tmp_path, hidden_size=10_000_000)}")
    with pytest.raises(ConfigError) as info:
        session.check_model_fits(config, torch.device("cpu"), ONE)
    assert info.value.context["key"] == "objective.ppo.critic"
    assert "a critic of" in str(info.value) and "GiB" in str(info.value)


def test_under_fsdp_the_critic_is_not_divided_over_the_ranks(monkeypatch):
    from training import memory_estimate

    seen = []
    monkeypatch.setattr(memory_estimate, "check_training_state_fits", lambda total, *a, **k: seen.append(total))
    config = _ppo("parallel.strategy=fsdp")
    model, reference, critic = memory_estimate.run_footprints(config)
    memory_estimate.check_run_fits(config, torch.device("cpu"), ProcessInfo(rank=0, world_size=2, local_rank=0))
    assert seen == [(model.bytes + reference.bytes) // 2 + critic.bytes]  # the critic is a replica per rank
