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


def test_a_unique_prefix_finds_the_run_and_an_ambiguous_one_names_the_candidates(tmp_path):
    from training.checkpoint.resume import find_run

    for run_id in ("r-20260101-000000-aaaaaaaa", "r-20260101-000000-abbbbbbb", "s-20260102-000000-cccccccc"):
        (tmp_path / run_id).mkdir()
        (tmp_path / run_id / "config.yaml").write_text("{}\n")
    (tmp_path / "r-20260101-000000-ab-no-config").mkdir()  # not a run: no config.yaml
    assert find_run(tmp_path, "s-2026").root.name == "s-20260102-000000-cccccccc"
    assert find_run(tmp_path, "r-20260101-000000-aa").root.name == "r-20260101-000000-aaaaaaaa"
    assert find_run(tmp_path, "r-20260101-000000-ab").root.name == "r-20260101-000000-abbbbbbb"
    with pytest.raises(ResumeError) as info:
        find_run(tmp_path, "r-2026")
    assert info.value.exit_code == 4
    assert "matches 2 runs" in str(info.value)
    assert "r-20260101-000000-aaaaaaaa, r-20260101-000000-abbbbbbb" in str(info.value), str(info.value)
