"""experiments/artifacts.py: config copy, git diff, pip freeze, and failures recorded not raised."""

import json
import os
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
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"  # as installers name it
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
        "# Editable install with no version control (mine==0.1)",  # /src/mine is no git checkout
        "-e /src/mine",
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


def _git(cwd, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


def _project(root, *, remote: str | None = None, subdir: str = "") -> str:
    """A git repository holding a Python project (in ``subdir``), committed once."""
    project = root / subdir if subdir else root
    project.mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "one")
    if remote is not None:
        _git(root, "remote", "add", "origin", remote)
    return project.as_uri()


def test_editable_installs_freeze_as_pip_freezes_them(tmp_path):
    """Editable installs from a git checkout with a remote (https, scp-style ssh, the project in
    a subdirectory), from one without a remote, and from a plain directory: the same lines as
    ``pip freeze --all --path``, which reinstall the checkout's commit where there is one."""
    site_dir = tmp_path / "site"
    projects = {
        "from-https": _project(tmp_path / "a", remote="https://example.org/a.git"),
        "from_ssh": _project(tmp_path / "b", remote="git@example.org:team/b.git"),
        "in-subdir": _project(tmp_path / "c", remote="https://example.org/c.git", subdir="python/pkg"),
        "no-remote": _project(tmp_path / "d"),
    }
    plain = tmp_path / "e"
    plain.mkdir()
    projects["no-vcs"] = plain.as_uri()
    for name, url in projects.items():
        _dist_info(site_dir, name, "1.0", {"url": url, "dir_info": {"editable": True}})
    ours = freeze_lines([str(site_dir)])
    pip = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all", "--path", str(site_dir)],
                         capture_output=True, text=True, check=True)
    assert ours == pip.stdout.splitlines()
    assert any(line.startswith("-e git+ssh://git@example.org/team/b.git@") and line.endswith("#egg=from_ssh")
               for line in ours), ours
    assert any(line.endswith("#egg=in_subdir&subdirectory=python/pkg") for line in ours), ours
