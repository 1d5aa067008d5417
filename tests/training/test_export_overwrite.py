"""``export --overwrite`` replaces only an earlier export holding nothing else
(training/cli/export_target.py), in-process: the probe's directory that merely held a
``config.json`` (and a run directory) was deleted whole; it is now refused and kept."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from core.exceptions import UsageError
from training.cli.export_target import EXPORT_MARKER, check_target, staged_directory


def _digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _run_dir(path: Path) -> Path:
    (path / "checkpoints").mkdir(parents=True)
    (path / "config.yaml").write_text("run: {name: mine}\n")
    (path / "ledger.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    return path


def _export(target: Path) -> Path:
    """An export as ``python -m training export`` writes it (marker included)."""
    with staged_directory(target, need_bytes=0, about={"run": "r", "checkpoint": "c", "form": "model"}) as staging:
        (staging / "config.json").write_text("{}")
        (staging / "model.safetensors").write_bytes(b"weights")
        (staging / "sub").mkdir()
        (staging / "sub" / "shard.bin").write_bytes(b"x")
    return target


def _refused(target: Path, *, roots: list[Path]) -> str:
    with pytest.raises(UsageError) as caught:
        check_target(target, overwrite=True, run_roots=roots)
    assert caught.value.exit_code == 2 and "\n" not in str(caught.value)
    return str(caught.value)


def test_a_directory_that_merely_holds_a_config_json_is_never_replaced(tmp_path, monkeypatch):
    """The probe: a project directory with a config.json and a run directory inside it."""
    monkeypatch.chdir(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text("{}")
    (project / "notes.txt").write_text("mine")
    _run_dir(project / "runs" / "user-20260101-000000-abcd1234")
    before = _digest(project)
    message = _refused(project, roots=[tmp_path / "runs"])
    assert f"--to {project} is not a Lockstep export" in message and EXPORT_MARKER in message
    assert "--overwrite" in message and "->" in message  # says what to do
    assert _digest(project) == before


def test_an_export_with_a_run_directory_anywhere_inside_is_refused(tmp_path):
    target = _export(tmp_path / "model")
    nested = _run_dir(target / "sub" / "deeper" / "a-run")
    before = _digest(target)
    message = _refused(target, roots=[])
    assert f"holds the run directory {nested}" in message
    assert _digest(target) == before


def test_an_export_holding_files_it_did_not_write_is_refused_naming_them(tmp_path):
    target = _export(tmp_path / "model")
    (target / "eval_results.json").write_text("{}")
    (target / "sub" / "README.md").write_text("notes")
    for i in range(4):
        (target / f"extra{i}.txt").write_text(str(i))
    before = _digest(target)
    message = _refused(target, roots=[])
    assert "files the export did not write (eval_results.json, extra0.txt, extra1.txt and 3 more)" in message
    assert _digest(target) == before
    for path in [target / "eval_results.json", target / "sub" / "README.md",
                 *(target / f"extra{i}.txt" for i in range(4))]:
        path.unlink()
    assert check_target(target, overwrite=True, run_roots=[]) == target.resolve()


def test_a_link_inside_an_export_is_an_entry_not_followed(tmp_path):
    target = _export(tmp_path / "model")
    elsewhere = _run_dir(tmp_path / "elsewhere")
    (target / "linked").symlink_to(elsewhere, target_is_directory=True)
    message = _refused(target, roots=[])
    assert "files the export did not write (linked)" in message  # the run behind the link is not walked into


def test_a_marker_that_is_missing_damaged_or_a_link_protects(tmp_path):
    target = _export(tmp_path / "model")
    marker = target / EXPORT_MARKER
    listed = json.loads(marker.read_text())
    assert listed["files"] == ["config.json", "model.safetensors", "sub/shard.bin"] and listed["run"] == "r"
    marker.write_text("{not json")
    assert "is not a Lockstep export" in _refused(target, roots=[])
    real = tmp_path / "marker.json"
    real.write_text(json.dumps(listed))
    marker.unlink()
    marker.symlink_to(real)
    assert "is not a Lockstep export" in _refused(target, roots=[])


def test_an_export_replaces_an_earlier_one_and_marks_the_new_one(tmp_path):
    target = _export(tmp_path / "model")
    assert check_target(target, overwrite=True, run_roots=[]) == target.resolve()
    with staged_directory(target, need_bytes=0, about={"run": "s", "checkpoint": "d", "form": "adapter"}) as staging:
        (staging / "adapter_config.json").write_text("{}")
    assert sorted(p.name for p in target.iterdir()) == ["adapter_config.json", EXPORT_MARKER]
    assert json.loads((target / EXPORT_MARKER).read_text())["files"] == ["adapter_config.json"]
    assert check_target(target, overwrite=True, run_roots=[]) == target.resolve()
