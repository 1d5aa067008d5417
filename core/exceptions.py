"""Typed errors for Lockstep, each mapped to a process exit code (docs/contracts.md).

Every error carries the context needed to act on it (key, file, record, step, rank) and a
hint that says what to do next. ``str(error)`` is the single line printed on exit (a config
error naming several violations prints a line for each: core/config_errors.py).
"""

from __future__ import annotations

from typing import Any


class ExitCode:
    """Process exit codes shared by train.py, tests and tools."""

    OK = 0
    UNKNOWN = 1
    CONFIG = 2
    DATA = 3
    CHECKPOINT = 4
    DETERMINISM = 5
    WATCHDOG = 6
    NONFINITE = 7


class LockstepError(Exception):
    """Base error: a message, structured context and a hint on what to do next."""

    exit_code = ExitCode.UNKNOWN
    kind = "error"

    def __init__(self, message: str, *, hint: str | None = None, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.context = {k: v for k, v in context.items() if v is not None}

    def __str__(self) -> str:
        where = ", ".join(f"{k}={v}" for k, v in self.context.items())
        line = f"{self.kind}: {self.message}"
        if where:
            line += f" [{where}]"
        if self.hint:
            line += f" -> {self.hint}"
        return line

    def to_record(self) -> dict[str, Any]:
        """A JSON-friendly description for events.jsonl and diagnostics."""
        return {
            "type": type(self).__name__,
            "kind": self.kind,
            "exit_code": self.exit_code,
            "message": self.message,
            "hint": self.hint,
            "context": {k: str(v) for k, v in self.context.items()},
        }


class ConfigError(LockstepError):
    """A bad config file, key, value or override; raised before any process group exists."""

    exit_code = ExitCode.CONFIG
    kind = "config error"


class UsageError(ConfigError):
    """A bad command line."""

    kind = "usage error"


class DataError(LockstepError):
    """Missing, empty or corrupt input data; names the file and the record."""

    exit_code = ExitCode.DATA
    kind = "data error"
    skippable = True
    """Whether data.on_bad_record=skip may skip the record it names (False: a lost file tail)."""


class CheckpointError(LockstepError):
    """A checkpoint or resume that cannot proceed (damaged files, incompatible config)."""

    exit_code = ExitCode.CHECKPOINT
    kind = "checkpoint error"


class ResumeError(CheckpointError):
    """A resume refused: unknown run, changed non-resumable keys, changed environment."""

    kind = "resume error"


class RunDirLockedError(CheckpointError):
    """Another live process owns the run directory."""

    kind = "run dir locked"


class DeterminismError(LockstepError):
    """Replay found a ledger field that differs from the recorded run."""

    exit_code = ExitCode.DETERMINISM
    kind = "determinism violation"


class WatchdogAbort(LockstepError):
    """A rank made no progress within the watchdog timeout."""

    exit_code = ExitCode.WATCHDOG
    kind = "watchdog abort"


class NonFiniteError(LockstepError):
    """Loss or gradient norm became NaN/Inf under ``runtime.on_nonfinite: abort``."""

    exit_code = ExitCode.NONFINITE
    kind = "non-finite loss"


def exit_code_for(error: BaseException) -> int:
    """The process exit code for any exception."""
    if isinstance(error, LockstepError):
        return error.exit_code
    return ExitCode.UNKNOWN
