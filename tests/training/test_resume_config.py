"""training/checkpoint/resume.py: which config changes a resume accepts, and the environment check."""

from __future__ import annotations

import json

import pytest
import torch

from core import config as config_lib
from core.exceptions import ResumeError
from core.run_context import RunPaths, determinism_env
from training.checkpoint.resume import check_environment, resume_config


@pytest.fixture
def recorded(tmp_path):
    config = config_lib.load(None, ["run.name=r", "train.max_steps=10"])
    paths = RunPaths(tmp_path / "r-1")
    paths.root.mkdir()
    config_lib.save(config, paths.config)
    # as a run writes it: the hash config.yaml is verified against, and the determinism record
    paths.meta.write_text(json.dumps({"config_hash": config.hash,
                                      "determinism": determinism_env(config, torch.device("cpu"))}))
    return config, paths


def test_resumable_changes_are_accepted(recorded):
    _, paths = recorded
    config = resume_config(paths.root.parent, "r-1", ["train.max_steps=20", "checkpoint.interval=5", "parallel.strategy=fsdp"])
    assert config.train.max_steps == 20 and config.parallel.strategy == "fsdp"


def test_other_changes_are_refused_with_the_diff(recorded, capsys):
    _, paths = recorded
    with pytest.raises(ResumeError) as info:
        resume_config(paths.root.parent, "r-1", ["train.lr=0.5", "model.num_layers=8"])
    assert info.value.exit_code == 4
    assert "train.lr" in str(info.value) and "model.num_layers" in str(info.value)
    out = capsys.readouterr().out
    assert "- model.num_layers: 4" in out and "+ model.num_layers: 8" in out


def test_changed_environment_warns_or_refuses(recorded):
    config, paths = recorded
    assert check_environment(paths, config, torch.device("cpu"), strict=True) == []
    meta = json.loads(paths.meta.read_text())
    meta["determinism"]["torch"] = "0.0.1"
    paths.meta.write_text(json.dumps(meta))
    diffs = check_environment(paths, config, torch.device("cpu"), strict=False)
    assert diffs and "torch" in diffs[0]
    with pytest.raises(ResumeError):
        check_environment(paths, config, torch.device("cpu"), strict=True)
