"""Files that describe how a run was made, under ``run_dir/artifacts``.

``config.yaml`` (a copy of the resolved config), ``git.diff`` and ``git-untracked.txt``
(the uncommitted state of the source tree), ``pip-freeze.txt`` (installed packages, in
``pip freeze``'s format, read from the interpreter's package metadata: running pip costs
every run half a second of CPU), and the folders for profiler traces and plots. Collecting
an artifact never fails the run: a git command that is missing, fails or times out is
recorded in ``artifacts.json`` with its error, and the run goes on. Call on rank 0 only.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import site
import subprocess
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from core.config import Config, to_yaml
from core import layout

Runner = Callable[..., subprocess.CompletedProcess]

INDEX_FILE = "artifacts.json"


@dataclass(frozen=True)
class ArtifactResult:
    """What collecting one artifact produced."""

    name: str
    path: str | None
    ok: bool
    error: str | None = None


class ArtifactStore:
    """Writes a run's artifacts; external commands go through an injectable runner."""

    def __init__(self, run_dir: Path, *, runner: Runner = subprocess.run) -> None:
        self._dir = Path(run_dir) / layout.ARTIFACTS_DIR
        self._runner = runner

    @property
    def dir(self) -> Path:
        return self._dir

    @property
    def trace_dir(self) -> Path:
        """Where profiler chrome traces go (created on access)."""
        path = self._dir / layout.TRACES_DIR
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def plots_path(self) -> Path:
        return self._dir / layout.PLOTS_FILE

    def save_config(self, config: Config) -> ArtifactResult:
        path = self._write("config.yaml", to_yaml(config))
        return ArtifactResult("config", str(path), True)

    def save_git_diff(self, repo_root: Path, *, timeout_s: float = 30.0) -> ArtifactResult:
        """``git diff HEAD`` (staged and unstaged changes) and the untracked file list."""
        diff = self._run(["git", "-C", str(repo_root), "diff", "HEAD", "--binary"], timeout_s)
        if isinstance(diff, str):
            return ArtifactResult("git_diff", None, False, diff)
        path = self._write("git.diff", diff.stdout)
        untracked = self._run(
            ["git", "-C", str(repo_root), "ls-files", "--others", "--exclude-standard"], timeout_s
        )
        if not isinstance(untracked, str):
            self._write("git-untracked.txt", untracked.stdout)
        return ArtifactResult("git_diff", str(path), True)

    def save_pip_freeze(self, *, paths: Sequence[str] | None = None) -> ArtifactResult:
        """The installed distributions as ``pip freeze --all`` lists them (``freeze_lines``)."""
        path = self._write("pip-freeze.txt", "\n".join(freeze_lines(paths)) + "\n")
        return ArtifactResult("pip_freeze", str(path), True)

    def collect(self, config: Config, *, repo_root: Path) -> list[ArtifactResult]:
        """Config copy, git diff and pip freeze; writes and returns the index."""
        results = [
            self.save_config(config),
            self.save_git_diff(repo_root),
            self.save_pip_freeze(),
        ]
        self.write_index(results)
        return results

    def write_index(self, results: Sequence[ArtifactResult]) -> Path:
        return self._write(INDEX_FILE, json.dumps([asdict(r) for r in results], indent=2) + "\n")

    # ------------------------------------------------------------------ internals

    def _write(self, name: str, text: str) -> Path:
        self._dir.mkdir(parents=True, exist_ok=True)
        path = self._dir / name
        path.write_text(text)
        return path

    def _run(self, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess | str:
        """The finished process, or a one-line reason it failed."""
        try:
            proc = self._runner(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        except FileNotFoundError:
            return f"{argv[0]} not found"
        except subprocess.TimeoutExpired:
            return f"{' '.join(argv[:3])} timed out after {timeout_s:g}s"
        except OSError as exc:
            return f"{' '.join(argv[:3])} could not start: {exc}"
        if proc.returncode != 0:
            tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no stderr"]
            return f"{' '.join(argv[:3])} exited {proc.returncode}: {tail[0]}"
        return proc


def freeze_lines(paths: Sequence[str] | None = None) -> list[str]:
    """The distributions on ``paths`` (default ``interpreter_paths()``), sorted by name, as
    ``pip freeze --all`` writes them: ``name==version``; ``name @ url`` for one installed from
    a URL or a local path (its ``direct_url.json``); an editable one as ``editable_lines``.

    The interpreter's own (``paths`` left out) are read once a process, about 0.4 s of CPU: a
    process that starts several runs (a test's forked jobs) lists what it was started with."""
    if paths is None:
        return list(_interpreter_lines(tuple(interpreter_paths())))
    return _freeze(paths)


@functools.lru_cache(maxsize=4)
def _interpreter_lines(paths: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(_freeze(paths))


def _freeze(paths: Sequence[str]) -> list[str]:
    lines = {}
    for dist in importlib.metadata.distributions(path=list(paths)):
        name = dist.metadata["Name"]
        if not name or name.lower() in lines:
            continue  # an earlier path entry shadows it, as for the import system
        line = f"{name}=={dist.version}"
        try:
            direct = json.loads(dist.read_text("direct_url.json") or "null")
        except ValueError:
            direct = None
        if isinstance(direct, dict) and direct.get("url"):
            vcs = direct.get("vcs_info")
            if direct.get("dir_info", {}).get("editable") and direct["url"].startswith("file:"):
                line = "\n".join(editable_lines(name, dist.version, url_to_path(direct["url"])))
            elif isinstance(vcs, dict):
                line = f"{name} @ {vcs['vcs']}+{direct['url']}@{vcs.get('commit_id', '')}"
            else:
                line = f"{name} @ {direct['url']}"
        lines[name.lower()] = line
    return [line for key in sorted(lines) for line in lines[key].split("\n")]


def editable_lines(name: str, version: str, location: str) -> list[str]:
    """``pip freeze``'s lines for a project installed editable from ``location``.

    In a git checkout with a remote: ``-e git+<remote>@<commit>#egg=<name>`` (the ``origin``
    remote if there is one, else the first; ``&subdirectory=`` where the project lies below
    the repository's root), which reinstalls that commit. Otherwise a comment saying why, then
    ``-e <location>``. Other version control systems (pip also knows hg, svn, bzr) count as
    none here."""
    location = os.path.normcase(os.path.abspath(location))
    display = f"{name}=={version}"
    try:
        import git

        repo = git.Repo(location, search_parent_directories=True)
        remotes = repo.git.config("--get-regexp", r"remote\..*\.url").splitlines()
    except ImportError:  # no git executable
        return [f"# Editable install with no version control ({display})", f"-e {location}"]
    except (git.InvalidGitRepositoryError, git.NoSuchPathError, git.GitCommandNotFound):
        return [f"# Editable install with no version control ({display})", f"-e {location}"]
    except git.GitCommandError:  # exit 1: no remote configured
        return [f"# Editable Git install with no remote ({display})", f"-e {location}"]
    remote = next((r for r in remotes if r.startswith("remote.origin.url ")), remotes[0]).split(" ")[1].strip()
    url = _git_remote_as_url(remote)
    if url is None:
        return [f"# Editable Git install ({display}) with either a deleted local remote or invalid URI:",
                f"# '{remote}'", f"-e {location}"]
    if not url.lower().startswith("git:"):
        url = f"git+{url}"
    try:
        commit = repo.head.commit.hexsha
    except ValueError:  # no commit yet
        return [f"-e {location}"]
    requirement = f"-e {url}@{commit}#egg={name.replace('-', '_')}"
    subdirectory = _project_subdirectory(location, repo.working_tree_dir)
    return [requirement + (f"&subdirectory={subdirectory}" if subdirectory else "")]


_SCP_REMOTE = re.compile(r"^(\w+@)?([^/:]+):(\w[^:]*)$")  # user@host:path, git's shorthand for ssh


def _git_remote_as_url(remote: str) -> str | None:
    """A git remote as a URL pip accepts: URLs as they are, a local (bare) repository as a
    file URL, ``user@host:path`` as ``ssh://user@host/path``; None for anything else."""
    if re.match(r"\w+://", remote):
        return remote
    if os.path.exists(remote):
        return Path(remote).resolve().as_uri()
    scp = _SCP_REMOTE.match(remote)
    return scp.expand(r"ssh://\1\2/\3") if scp else None


def _project_subdirectory(location: str, repo_root: str) -> str | None:
    """The project's root (the nearest directory up from ``location`` with a pyproject.toml or
    setup.py) relative to the repository's root; None at the root or when there is none."""
    here = location
    while not (os.path.isfile(os.path.join(here, "pyproject.toml")) or os.path.isfile(os.path.join(here, "setup.py"))):
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent
    return None if os.path.samefile(here, repo_root) else os.path.relpath(here, repo_root)


def url_to_path(url: str) -> str:
    """The local path of a ``file:`` URL."""
    return urllib.request.url2pathname(urllib.parse.urlparse(url).path)


def interpreter_paths() -> list[str]:
    """Where a fresh interpreter, and so ``pip freeze``, looks for installed packages:
    ``PYTHONPATH`` and the site directories. Not this process's ``sys.path``: a package
    imported along the way may have added its vendored copies to it (setuptools does)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths += site.getsitepackages()
    if site.ENABLE_USER_SITE:
        paths.append(site.getusersitepackages())
    return paths
