"""What a run is: its ID, its directory, its recorded environment, and its lock.

The run ID is ``<run.name>-<YYYYMMDD-HHMMSS>-<hash8>``, chosen by rank 0 and broadcast so
every rank writes into the same directory. Rank 0 creates the layout of docs/contracts.md,
writes ``config.yaml`` and ``meta.json`` and takes the lock; a second live writer of the
same directory is refused.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import platform
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

from core import config as config_lib
from core import layout
from core.config import Config
from core.distributed_context import DistributedContext, launcher_env
from core.exceptions import ConfigError, ResumeError, RunDirLockedError
from core.layout import RunPaths

# Environment variables that can change numerics; recorded and compared on resume.
# The repository root of this code: meta.json's git record describes it, not the working directory.
CODE_ROOT = Path(__file__).resolve().parents[1]

DETERMINISM_ENV = (
    "CUBLAS_WORKSPACE_CONFIG",
    "NVIDIA_TF32_OVERRIDE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PJRT_DEVICE",
    "CPU_NUM_DEVICES",
    "XLA_FLAGS",
)


class RunContext:
    """The identity and directory of one run, shared by every rank."""

    def __init__(self, config: Config, run_id: str, paths: RunPaths, *, resumed: bool) -> None:
        self.config = config
        self.run_id = run_id
        self.paths = paths
        self.resumed = resumed
        self._lock: RunDirLock | None = None
        self.output_dir: Path = paths.root
        """Where this process writes logs and diagnostics: the run dir, except for a replay,
        which writes only into its own output directory (``use_output_dir``)."""

    @property
    def run_dir(self) -> Path:
        return self.paths.root

    @property
    def logs_dir(self) -> Path:
        return self.output_dir / layout.LOGS_DIR

    @property
    def diagnostics_dir(self) -> Path:
        return self.output_dir / layout.DIAGNOSTICS_DIR

    def use_output_dir(self, directory: Path) -> None:
        """Send this process's logs and diagnostics to ``directory`` (a replay's own output),
        which must lie outside the run dir."""
        directory = Path(directory)
        if directory.resolve().is_relative_to(self.paths.root.resolve()):
            raise ConfigError(
                f"output directory {directory} is inside the run dir {self.paths.root}",
                hint="a replay writes only into its own directory; choose one outside the run",
            )
        self.output_dir = directory

    # ------------------------------------------------------------------ creation

    @classmethod
    def create(cls, config: Config, dist: DistributedContext) -> "RunContext":
        run_id = None
        if dist.is_main:
            run_id = _new_run_id(config)
        run_id = dist.broadcast_object(run_id)
        paths = run_paths(config.run.root, run_id)
        ctx = cls(config, run_id, paths, resumed=False)
        if dist.is_main:
            if paths.root.exists():
                raise RunDirLockedError(
                    f"run dir {paths.root} already exists", hint="use --resume to continue it"
                )
            paths.root.mkdir(parents=True)
            ctx._acquire_lock()
            for sub in layout.SUBDIRS:
                (paths.root / sub).mkdir()
            config_lib.save(config, paths.config)
            meta = collect_meta(config, dist)
            (paths.artifacts / layout.GIT_DIFF_FILE).write_text(meta["git"].pop("diff", "") or "")
            paths.meta.write_text(json.dumps(meta, indent=2, sort_keys=True))
        dist.barrier()
        return ctx

    @classmethod
    def open_existing(
        cls, root: str | Path, run_id: str, dist: DistributedContext, *, lock: bool
    ) -> "RunContext":
        """Open a finished or interrupted run (for resume, lock=True; for replay, lock=False)."""
        paths = run_paths(root, run_id)
        if not paths.config.is_file():
            known = sorted(p.name for p in Path(root).glob("*") if (p / layout.CONFIG_FILE).is_file())
            raise ResumeError(
                f"no run {run_id!r} under {root}",
                hint=(f"known runs: {', '.join(known[-5:])}" if known
                      else "pass --root DIR (the config key run.root) if the run lives elsewhere"),
            )
        config = load_recorded_config(paths)
        ctx = cls(config, run_id, paths, resumed=True)
        if lock and dist.is_main:
            ctx._acquire_lock()
        dist.barrier()
        return ctx

    # ------------------------------------------------------------------ lock

    def _acquire_lock(self) -> None:
        self._lock = RunDirLock(self.paths.lock)
        self._lock.acquire()

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


class RunDirLock:
    """An exclusive lock on a run dir: ``flock`` on its ``.lock`` file, which names the owner.

    The kernel holds the lock for the owning process and drops it when that process ends
    however it ends, so there is no stale lock to take over: a lock file whose flock is free
    belongs to a dead process, and whoever locks it first owns it; every other contender
    fails at once. After locking, the path must still name the locked file (a releasing owner
    unlinks it), else the attempt starts again on the new file. Locks on a shared filesystem
    hold across hosts where it supports ``flock`` (NFSv4, Lustre with ``flock``).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirLockedError(
                    f"run dir {self.path.parent} is being written by another process ({_read_owner(self.path)})",
                    hint="wait for it to finish or stop it first",
                ) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released and unlinked between our open and our flock
                os.close(fd)
                continue
            record = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            self._fd = fd
            return

    def release(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)  # while still locked: no one can take a doomed file
            os.close(self._fd)
            self._fd = None


def _read_owner(lock: Path) -> str:
    try:
        return lock.read_text().strip() or "owner not yet recorded"
    except OSError:
        return "owner unknown"


RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def run_paths(root: str | Path, run_id: str) -> RunPaths:
    """The paths of run ``run_id`` under ``root``; refuses an ID that is not one path
    component (``..``, a separator, an option-like ``-x``) or a dir that resolves elsewhere
    (through a symlink), so no run ever writes outside ``run.root``."""
    if not isinstance(run_id, str) or RUN_ID_PATTERN.fullmatch(run_id) is None or run_id in (".", ".."):
        raise ConfigError(
            f"{run_id!r} is not a run ID",
            hint="a run ID is <run.name>-<YYYYMMDD-HHMMSS>-<hash8>; see `python -m experiments runs list`",
        )
    root_dir = Path(root).resolve()
    run_dir = Path(root) / run_id
    if run_dir.resolve().parent != root_dir:
        raise ConfigError(
            f"run dir {run_dir} resolves to {run_dir.resolve()}, outside run.root={root_dir}",
            key="run.root",
            hint="remove the link or choose another run.root",
        )
    return RunPaths(run_dir)


def _new_run_id(config: Config) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = f"{config.run.name}-{stamp}-{config.hash[:8]}"
    run_id, n = base, 1
    while (Path(config.run.root) / run_id).exists():  # two runs in the same second
        n += 1
        run_id = f"{base}.{n}"
    return run_id


# The hash part of a run ID: ``<name>-<YYYYMMDD-HHMMSS>-<hash8>``, with ``.N`` when two runs
# started in the same second.
_RUN_ID_HASH = re.compile(r"-\d{8}-\d{6}-([0-9a-f]{8})(?:\.\d+)?")


def load_recorded_config(paths: RunPaths) -> Config:
    """The run's ``config.yaml``, verified against the config hash recorded in ``meta.json``
    and against the run ID's hash suffix, before anything in it is used (resume, replay,
    export, generate). A config.yaml edited after the run started could name other
    settings (``train.lr``) or code to import (a reward function); it is refused with
    ResumeError (exit 4) naming the keys that differ from the config ``meta.json`` records."""
    try:
        raw = _read_yaml(paths.config)
        config = config_lib.from_dict(raw)
    except ConfigError as exc:
        raise _tampered(paths, f"it does not load ({exc.message})", None) from None
    recorded = _read_meta(paths)
    actual, expected = config.hash, recorded.get("config_hash")
    if not isinstance(expected, str):
        raise ResumeError(
            f"{paths.meta} records no config_hash, so {paths.config} cannot be verified",
            file=str(paths.meta),
            hint="restore meta.json from a copy of the run dir",
        )
    if actual != expected:
        why = f"its hash {actual[:8]} differs from meta.json's config_hash {expected[:8]}"
        raise _tampered(paths, why, _changed_keys(raw, recorded.get("config")))
    suffix = _RUN_ID_HASH.findall(paths.root.name)  # a copy may add a suffix (``<ID>-cut``)
    if suffix and suffix[-1] != actual[:8]:
        why = f"its hash {actual[:8]} differs from the run ID's hash part {suffix[-1]} (meta.json was edited too)"
        raise _tampered(paths, why, None)
    return config


def _read_meta(paths: RunPaths) -> dict[str, Any]:
    try:
        meta = json.loads(paths.meta.read_text())
    except (OSError, ValueError) as exc:
        meta = exc
    if not isinstance(meta, dict):
        raise ResumeError(
            f"{paths.meta} is missing or not a JSON object ({meta}), so {paths.config} cannot be verified",
            file=str(paths.meta),
            hint="restore meta.json from a copy of the run dir",
        )
    return meta


def _changed_keys(raw: dict[str, Any], recorded: Any) -> list[str]:
    """Dotted keys whose value in ``raw`` (config.yaml) differs from the config meta.json
    recorded at the start (empty when meta.json predates that record)."""
    if not isinstance(recorded, dict):
        return []
    return [f"{key} ({was!r} -> {now!r})" for key, was, now in config_lib.diff_resolved(recorded, raw)]


def _tampered(paths: RunPaths, why: str, keys: list[str] | None) -> ResumeError:
    """``keys``: the changed keys, [] when they cannot be named, None when not applicable."""
    if keys is None:
        named = ""
    elif keys:
        named = f"; changed keys: {', '.join(keys)}"
    else:
        named = " (this meta.json predates the recorded config, so the changed keys cannot be named)"
    return ResumeError(
        f"{paths.config} is not the config this run started with: {why}{named}",
        file=str(paths.config),
        hint="restore the run dir's config.yaml (meta.json's 'config' holds it as started); for other "
        "settings start a new run, or pass resumable keys as overrides to --resume",
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}", file=str(path)) from exc


# --------------------------------------------------------------------------- meta.json


def collect_meta(config: Config, dist: DistributedContext) -> dict[str, Any]:
    """Everything needed to reproduce the run or explain why it does not reproduce."""
    return {
        "config_hash": config.hash,
        # The resolved config as started: a config.yaml edited later is refused naming its keys.
        "config": config_lib.to_dict(config),
        "git": git_info(CODE_ROOT),  # the checkout whose code runs, wherever the run starts
        "versions": versions(),
        "host": host_info(),
        "world": dist.describe() | {"world_size": dist.world_size},
        "launcher_env": launcher_env(),
        "determinism": determinism_env(config, dist.device),
        "command": sys.argv,
        "cwd": str(Path.cwd()),
        "time": time.time(),
    }


def git_info(path: Path) -> dict[str, Any]:
    try:
        import git
    except ImportError:
        return {"is_repo": False, "reason": "GitPython is not installed"}
    try:
        repo = git.Repo(path, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return {"is_repo": False, "reason": f"{path} is not a git checkout"}
    try:
        commit = repo.head.commit.hexsha
    except ValueError:
        commit = None  # repository without commits
    try:
        branch = repo.active_branch.name
    except TypeError:
        branch = None  # detached HEAD
    dirty = repo.is_dirty(untracked_files=False)
    diff = repo.git.diff("HEAD") if (dirty and commit) else ""
    return {
        "is_repo": True,
        "commit": commit,
        "branch": branch,
        "dirty": dirty,
        "diff_ref": f"{layout.ARTIFACTS_DIR}/{layout.GIT_DIFF_FILE}",
        "diff": diff,
    }


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }
    # From the installed packages' metadata: importing transformers or torch_xla only to read
    # a version string would cost every run most of a second.
    packages = {"pyarrow": "pyarrow", "zstandard": "zstandard", "yaml": "PyYAML", "tokenizers": "tokenizers",
                "safetensors": "safetensors", "numpy": "numpy", "transformers": "transformers",
                "torch_xla": "torch_xla"}
    for name, distribution in packages.items():
        try:
            out[name] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def host_info() -> dict[str, Any]:
    import psutil

    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "memory_total_bytes": psutil.virtual_memory().total,
        "boot_time": psutil.boot_time(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def determinism_env(config: Config, device: torch.device) -> dict[str, Any]:
    """The facts that decide whether two runs can be bitwise equal."""
    return {
        "mode": config.determinism.mode,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device_type": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "env": {k: os.environ.get(k) for k in DETERMINISM_ENV},
        "torch_threads": torch.get_num_threads(),
    }
