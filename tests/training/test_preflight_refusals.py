"""Configs that would fail deep inside training are refused up front (exit 2, key named):
a vocabulary smaller than the tokenizer's, a model whose training state cannot fit."""

from __future__ import annotations

import subprocess
import sys

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
    proc = subprocess.run(
        [sys.executable, str(launch.ROOT / "train.py"), "--config", str(launch.ROOT / "configs" / "tiny.yaml"),
         "model.hidden_size=1000000", f"run.root={root}"],
        cwd=tmp_path, env=launch.env(tmp_path), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == ExitCode.CONFIG, proc.stderr
    assert "model" in proc.stderr and "GiB" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not root.exists()
