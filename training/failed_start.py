"""A run that fails before its first step leaves no run dir behind, only its logs.

A missing data path, a model that does not build, a bad tokenizer file: the run dir exists
(rank 0 printed its ID) but nothing was trained or checkpointed, so there is nothing to
resume, and a run dir in ``failed`` state would only look resumable in ``runs list``. Rank 0
moves it to ``<run.root>/failed-starts/<run_id>/`` and keeps only ``logs/`` (each rank's log,
the traceback included) and ``diagnostics/`` (each rank's failure); the run ID is then
unknown to ``--resume`` and to the run browser, and a launcher's restart of the job
(``runtime/relaunch.py``) starts the run afresh. A rank that fails after the move writes its
failure there too.

Only fresh runs (not a resume, not a replay) with no ledger line, failing with a config,
data, checkpoint or unclassified error (exit 2, 3, 4, 1), qualify: a watchdog abort or a
non-finite loss keeps its diagnostics bundle in the run dir, and a stop signal before the
first step keeps its ``failed`` event there (docs/runtime.md).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from core import layout
from core.exceptions import ExitCode
from core.run_context import RunContext

_START_FAILURES = (ExitCode.UNKNOWN, ExitCode.CONFIG, ExitCode.DATA, ExitCode.CHECKPOINT)
_KEPT = (layout.LOGS_DIR, layout.DIAGNOSTICS_DIR)


def aside_dir(run: RunContext) -> Path:
    """Where a failed start's logs go: ``<run.root>/failed-starts/<run_id>``."""
    return run.paths.root.parent / layout.FAILED_STARTS_DIR / run.run_id


def applies(run: RunContext, exit_code: int) -> bool:
    """Whether this failure ends a fresh run before its first ledger line (module docstring)."""
    if run.resumed or run.output_dir != run.paths.root or exit_code not in _START_FAILURES:
        return False
    try:
        return run.paths.ledger.stat().st_size == 0
    except FileNotFoundError:
        return True


def output_dir(run: RunContext) -> Path:
    """Where this rank writes its failure: the run's output dir, or the failed start's new
    place once rank 0 has moved it there."""
    aside = aside_dir(run)
    return aside if not run.output_dir.exists() and aside.exists() else run.output_dir


def set_aside(run: RunContext) -> Path | None:
    """Rank 0: move the run dir to ``aside_dir`` and remove all but its logs and diagnostics."""
    aside = aside_dir(run)
    run.release()  # the lock file goes with what is removed; nothing may resume this run
    try:
        aside.parent.mkdir(parents=True, exist_ok=True)
        os.rename(run.paths.root, aside)
    except OSError:
        return None
    for entry in aside.iterdir():
        if entry.name in _KEPT:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return aside
