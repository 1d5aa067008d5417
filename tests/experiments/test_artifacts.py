"""experiments/artifacts.py: config copy, git diff, pip freeze, and failures recorded not raised."""

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from core.config import Config, RunConfig
from experiments.artifacts import ArtifactStore, freeze_lines


def test_config_copy_is_the_resolved_config(tmp_path):
    store = ArtifactStore(tmp_path)
    result = store.save_config(Config(run=RunConfig(name="copy")))
    assert result.ok
    saved = yaml.safe_load((tmp_path / "artifacts" / "config.yaml").read_text())
    assert saved["run"]["name"] == "copy" and saved["train"]["max_steps"] == 100


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_git_diff_records_uncommitted_and_untracked_changes(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], check=True)
    (repo / "a.py").write_text("x = 1\n")
    subprocess.run(git + ["add", "a.py"], check=True)
    subprocess.run(git + ["commit", "-qm", "init"], check=True)
    (repo / "a.py").write_text("x = 2\n")
    (repo / "new.py").write_text("y = 1\n")
    store = ArtifactStore(tmp_path / "run")
    result = store.save_git_diff(repo)
    assert result.ok, result.error
    diff = (store.dir / "git.diff").read_text()
    assert "-x = 1" in diff and "+x = 2" in diff
    assert (store.dir / "git-untracked.txt").read_text().split() == ["new.py"]


def test_git_diff_outside_a_repo_is_recorded_as_failure(tmp_path):
    result = ArtifactStore(tmp_path / "run").save_git_diff(tmp_path)
    assert not result.ok and result.path is None and result.error


def test_pip_freeze_equals_pips_own_listing(tmp_path):
    result = ArtifactStore(tmp_path).save_pip_freeze()
    assert result.ok, result.error
    ours = (tmp_path / "artifacts" / "pip-freeze.txt").read_text().splitlines()
    assert any(line.lower().startswith("torch==") for line in ours)
    pip = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, check=True)
    assert sorted(ours, key=str.lower) == sorted(pip.stdout.splitlines(), key=str.lower)


def _dist_info(root, name: str, version: str, direct_url: dict | None = None) -> None:
    info = root / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))


def test_pip_freeze_lines_name_urls_editables_and_the_first_of_shadowed_copies(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    _dist_info(first, "plain", "1.0")
    _dist_info(first, "Local_Wheel", "2.0", {"url": "file:///wheels/local_wheel-2.0.whl", "archive_info": {}})
    _dist_info(first, "mine", "0.1", {"url": "file:///src/mine", "dir_info": {"editable": True}})
    _dist_info(first, "fromgit", "3.0", {"url": "https://example.org/r.git",
                                         "vcs_info": {"vcs": "git", "commit_id": "abc123"}})
    _dist_info(second, "plain", "0.9")  # shadowed by the first path entry
    assert freeze_lines([str(first), str(second)]) == [
        "fromgit @ git+https://example.org/r.git@abc123",
        "Local_Wheel @ file:///wheels/local_wheel-2.0.whl",
        "-e file:///src/mine",
        "plain==1.0",
    ]


def test_collect_writes_an_index_of_every_artifact(tmp_path):
    def runner(argv, **kwargs):
        assert argv[0] == "git", argv  # the package listing runs no command
        raise FileNotFoundError

    results = ArtifactStore(tmp_path, runner=runner).collect(Config(), repo_root=tmp_path)
    index = json.loads((tmp_path / "artifacts" / "artifacts.json").read_text())
    assert [(r["name"], r["ok"]) for r in index] == [("config", True), ("git_diff", False), ("pip_freeze", True)]
    assert index[1]["error"] == "git not found"
    assert [r.name for r in results] == ["config", "git_diff", "pip_freeze"]
    assert "torch==" in (tmp_path / "artifacts" / "pip-freeze.txt").read_text()
    store = ArtifactStore(tmp_path)
    assert store.trace_dir.is_dir() and store.plots_path.name == "plots.png"
