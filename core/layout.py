"""The layout of a run directory (docs/contracts.md), defined once.

Every writer and reader of a run dir (the run context, the trainer, checkpointing, the run
browser, data inspection) takes the names of its files and folders from here, so a rename
is one edit. Checkpoint directories are ``checkpoints/step_<NNNNNNNN>/`` (the step, zero
padded to at least eight digits) and ``checkpoints/LATEST`` holds the name of the newest
published one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.yaml"
META_FILE = "meta.json"
LEDGER_FILE = "ledger.jsonl"
METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
LOCK_FILE = ".lock"
LOGS_DIR = "logs"
CHECKPOINTS_DIR = "checkpoints"
DIAGNOSTICS_DIR = "diagnostics"
ARTIFACTS_DIR = "artifacts"
EPISODES_DIR = "episodes"  # a run with an environment: each step's episodes (training/rollout/episode_store.py)
TENSORBOARD_DIR = "tensorboard"
TRACES_DIR = "traces"
PLOTS_FILE = "plots.png"
GIT_DIFF_FILE = "git.diff"
# Under run.root: the logs of runs that failed before their first step (their run dirs are gone).
FAILED_STARTS_DIR = "failed-starts"

# Folders created with every run dir.
SUBDIRS = (LOGS_DIR, CHECKPOINTS_DIR, DIAGNOSTICS_DIR, ARTIFACTS_DIR)
# Files whose presence marks a directory as a run dir (any one of them).
RUN_MARKERS = (CONFIG_FILE, EVENTS_FILE, LEDGER_FILE, META_FILE)

STEP_DIR_PREFIX = "step_"
LATEST_FILE = "LATEST"
_STEP_DIR_RE = re.compile(r"step_(\d{8,})")


def step_dir_name(step: int) -> str:
    """``step_00000042`` for step 42."""
    if step < 0:
        raise ValueError(f"a checkpoint step is >= 0, got {step}")
    return f"{STEP_DIR_PREFIX}{step:08d}"


def episodes_file_name(step: int) -> str:
    """A step's episode record under EPISODES_DIR (training/rollout/episode_store.py)."""
    return f"{step_dir_name(step)}.json"


def parse_step_dir_name(name: str) -> int | None:
    """The step a checkpoint dir name stands for; None for any other name."""
    match = _STEP_DIR_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def list_steps(checkpoint_dir: Path) -> list[int]:
    """Steps of the published checkpoint directories, ascending (intact or not)."""
    if not checkpoint_dir.is_dir():
        return []
    steps = (parse_step_dir_name(p.name) for p in checkpoint_dir.iterdir() if p.is_dir())
    return sorted(s for s in steps if s is not None)


STATE_FILE_SUFFIX = "_state.json"
_STATE_FILE_RE = re.compile(r"([a-z][a-z0-9_]*)_state\.json")


def state_file_name(part: str) -> str:
    """``<part>_state.json``: where a checkpoint keeps the JSON state of its part ``part``."""
    if _STATE_FILE_RE.fullmatch(part + STATE_FILE_SUFFIX) is None:
        raise ValueError(f"checkpoint part name {part!r} must match [a-z][a-z0-9_]*")
    return part + STATE_FILE_SUFFIX


def part_of_state_file(name: str) -> str | None:
    """The part a checkpoint file holds the state of; None for any other file."""
    match = _STATE_FILE_RE.fullmatch(name)
    return match.group(1) if match else None


@dataclass(frozen=True)
class RunPaths:
    """Where each part of one run dir lives."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def meta(self) -> Path:
        return self.root / META_FILE

    @property
    def ledger(self) -> Path:
        return self.root / LEDGER_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def events(self) -> Path:
        return self.root / EVENTS_FILE

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def logs(self) -> Path:
        return self.root / LOGS_DIR

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def latest(self) -> Path:
        return self.checkpoints / LATEST_FILE

    @property
    def diagnostics(self) -> Path:
        return self.root / DIAGNOSTICS_DIR

    @property
    def artifacts(self) -> Path:
        return self.root / ARTIFACTS_DIR

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_dir_name(step)
