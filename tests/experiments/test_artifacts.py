"""experiments/artifacts.py: config copy, git diff, pip freeze, and failures recorded not raised."""

import json
import shutil
import subprocess

import pytest
import yaml

from core.config import Config, RunConfig
from experiments.artifacts import ArtifactStore


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


def test_real_pip_freeze_lists_torch(tmp_path):
    result = ArtifactStore(tmp_path).save_pip_freeze()
    assert result.ok, result.error
    assert any(line.lower().startswith("torch==") for line in (tmp_path / "artifacts" / "pip-freeze.txt").read_text().splitlines())


@pytest.mark.parametrize(
    "failure, fragment",
    [
        (FileNotFoundError(), "not found"),
        (subprocess.TimeoutExpired(["pip"], 1), "timed out after 1s"),
        (subprocess.CompletedProcess(["pip"], 1, "", "No module named pip"), "exited 1: No module named pip"),
    ],
)
def test_pip_freeze_failure_is_recorded_with_a_fallback_listing(tmp_path, failure, fragment):
    def runner(*args, **kwargs):
        if isinstance(failure, BaseException):
            raise failure
        return failure

    result = ArtifactStore(tmp_path, runner=runner).save_pip_freeze(timeout_s=1)
    assert not result.ok and fragment in result.error
    text = (tmp_path / "artifacts" / "pip-freeze.txt").read_text()
    assert text.startswith("# pip freeze failed") and "torch==" in text


def test_collect_writes_an_index_of_every_artifact(tmp_path):
    def runner(argv, **kwargs):
        if argv[0] == "git":
            raise FileNotFoundError
        return subprocess.CompletedProcess(argv, 0, "pkg==1.0\n", "")

    results = ArtifactStore(tmp_path, runner=runner).collect(Config(), repo_root=tmp_path)
    index = json.loads((tmp_path / "artifacts" / "artifacts.json").read_text())
    assert [(r["name"], r["ok"]) for r in index] == [("config", True), ("git_diff", False), ("pip_freeze", True)]
    assert index[1]["error"] == "git not found"
    assert [r.name for r in results] == ["config", "git_diff", "pip_freeze"]
    assert (tmp_path / "artifacts" / "pip-freeze.txt").read_text() == "pkg==1.0\n"
    store = ArtifactStore(tmp_path)
    assert store.trace_dir.is_dir() and store.plots_path.name == "plots.png"
