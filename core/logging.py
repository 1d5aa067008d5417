"""Two channels: human-readable per-rank logs and structured events.

- ``logs/rank<R>.log``: everything a rank says, with timestamps.
- the console: rank 0 only, concise (the launcher interleaves every rank's stdout).
- ``events.jsonl``: one JSON object per lifecycle event (run_started, checkpoint_saved,
  resumed, stopped, failed, finished, ...). Any rank may emit; each line is written with
  one ``O_APPEND`` write, so lines from different ranks never interleave.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

_FORMAT = "%(asctime)s %(levelname)s [rank%(rank)s] %(message)s"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


class _RankLogFile(logging.FileHandler):
    """``logs/rank<R>.log``. A record it cannot write (a full disk) is dropped without the
    traceback ``logging`` would print to stderr for every one: the failure that follows is
    reported once, as one line, by the code that hit it."""

    write_failures = 0

    def handleError(self, record: logging.LogRecord) -> None:
        self.write_failures += 1

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # flushing what the full disk did not take
            self.write_failures += 1


def setup_logging(rank: int, log_dir: Path | None, *, console: bool) -> logging.Logger:
    """The ``lockstep`` logger for this rank: a file under log_dir and, on rank 0, stdout."""
    logger = logging.getLogger("lockstep")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    rank_filter = _RankFilter(rank)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        file_handler = _RankLogFile(log_dir / f"rank{rank}.log")
        file_handler.setFormatter(logging.Formatter(_FORMAT))
        file_handler.addFilter(rank_filter)
        logger.addHandler(file_handler)
    if console:
        stream = logging.StreamHandler(sys.stdout)
        stream.setFormatter(logging.Formatter("%(message)s"))
        stream.setLevel(logging.INFO)
        stream.addFilter(lambda record: record.name != "lockstep.events")
        logger.addHandler(stream)
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger("lockstep")


def console(message: str) -> None:
    """Print on stdout immediately (used for the two first lines run_id/run_dir)."""
    print(message, flush=True)


class EventLog:
    """Append-only structured events, shared by all ranks of a run."""

    def __init__(self, path: Path | None, *, rank: int, keep_recent: int = 50) -> None:
        self.path = path
        self.rank = rank
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep_recent)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": time.time(), "rank": self.rank, **fields}
        self.recent.append(record)
        if self.path is not None:
            line = (json.dumps(record, default=str, sort_keys=True) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        logging.getLogger("lockstep.events").info("event %s %s", event, json.dumps(fields, default=str, sort_keys=True))
        return record
