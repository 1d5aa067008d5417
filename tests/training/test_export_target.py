"""training/cli/export_target.py in-process: a directory any known run names as a frozen model is never
replaced, wherever the run started; what is not a run's is replaced only when asked."""

from __future__ import annotations

import json

import pytest
import yaml

from core.exceptions import UsageError
from training.cli.export_target import check_target, write_export_marker


def _model_dir(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def _run(root, name, config, cwd):
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "meta.json").write_text(json.dumps({"cwd": str(cwd)}))
    return run_dir


@pytest.mark.parametrize("key, config", [
    ("objective.dpo.reference", {"objective": {"kind": "dpo", "dpo": {"reference": "models/frozen"}}}),
    ("objective.distill.teacher", {"objective": {"kind": "distill", "distill": {"teacher": "models/frozen"}}}),
    ("model.init_from", {"model": {"init_from": "models/frozen"}}),
    ("model.lora.init_from", {"model": {"lora": {"rank": 4, "init_from": "models/frozen"}}}),
])
def test_a_frozen_model_of_a_run_started_elsewhere_is_protected(tmp_path, monkeypatch, key, config):
    started_in = tmp_path / "project"
    frozen = _model_dir(started_in / "models" / "frozen")
    _run(tmp_path / "runs", "user-20260101-000000-abcd1234", config, started_in)
    monkeypatch.chdir(tmp_path)  # not where the run started: its relative path resolves through meta.json
    with pytest.raises(UsageError) as caught:
        check_target(frozen, overwrite=True, run_roots=[tmp_path / "runs"])
    assert "user-20260101-000000-abcd1234" in str(caught.value) and key in str(caught.value)
    assert caught.value.exit_code == 2
    (started_in / "models" / "config.json").write_text("{}")  # a model directory holding it is protected too
    with pytest.raises(UsageError, match="is used by run"):
        check_target(started_in / "models", overwrite=True, run_roots=[tmp_path / "runs"])


def test_a_run_reference_by_id_and_unrelated_values_protect_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = _model_dir(tmp_path / "exports" / "tiny")
    write_export_marker(target, {"run": "earlier"})  # an earlier export: replaceable with --overwrite
    _run(tmp_path / "runs", "other", {"objective": {"dpo": {"reference": "run:exports"}},
                                      "data": {"tokenizer": "byte"}, "run": {"name": "tiny"}}, tmp_path)
    assert check_target(target, overwrite=True, run_roots=[tmp_path / "runs"]) == target.resolve()
    with pytest.raises(UsageError, match="not empty"):
        check_target(target, overwrite=False, run_roots=[tmp_path / "runs"])


def test_an_export_into_another_runs_artifacts_init_from_is_refused(tmp_path, monkeypatch):
    """The probe: ``--to runs/<other>/artifacts/init_from``, accepted before because a config.json is there."""
    monkeypatch.chdir(tmp_path)
    other = _run(tmp_path / "runs", "other-20260101-000000-abcd1234", {"model": {"init_from": "base"}}, tmp_path)
    copied = _model_dir(other / "artifacts" / "init_from")
    before = (copied / "config.json").read_text()
    for target in (copied, other / "artifacts" / "new", other):
        with pytest.raises(UsageError, match=f"inside the run directory {other.resolve()}") as caught:
            check_target(target, overwrite=True, run_roots=[tmp_path / "runs"])
        assert caught.value.exit_code == 2
    assert (copied / "config.json").read_text() == before and not (other / "artifacts" / "new").exists()
