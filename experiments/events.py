"""Append and read ``events.jsonl`` and other JSON-lines files of a run directory.

Several ranks (and the watchdog thread) may append to the same events file. Each event is
written with one ``os.write`` on a descriptor opened with ``O_APPEND``, so lines from
different writers do not interleave on a local file system; the line is fsynced because
events matter most right before a process dies.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from experiments.schema import Event, SchemaError


class EventLog:
    """Writes one rank's events to a run's ``events.jsonl``."""

    def __init__(self, path: Path, *, rank: int, clock: Callable[[], float] = time.time) -> None:
        self._path = Path(path)
        self._rank = rank
        self._clock = clock

    @property
    def path(self) -> Path:
        return self._path

    def emit(self, kind: str, **fields: Any) -> Event:
        """Validate, append and fsync one event; returns it."""
        event = Event.create(kind, time=self._clock(), rank=self._rank, **fields)
        append_line(self._path, event.to_json())
        return event


def append_line(path: Path, line: str, *, fsync: bool = True) -> None:
    """Append ``line`` plus a newline with a single write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (line.rstrip("\n") + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def iter_jsonl(path: Path, *, skipped: list[tuple[int, str]] | None = None) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, skipping blank and unreadable lines.

    A process killed mid-write leaves a truncated last line, and a damaged disk or a hand edit
    leaves bytes that are not UTF-8; readers must survive both, as ``last_jsonl`` does. Each
    skipped line is appended to ``skipped`` as ``(line number from 1, reason)``, for a reader
    that says what it left out.
    """
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        return
    with handle:
        for number, raw in enumerate(handle, start=1):
            line = raw.strip()
            if not line:
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                reason = "not UTF-8"
            except json.JSONDecodeError:
                reason = "not JSON" if raw.endswith(b"\n") else "cut short (a write interrupted)"
            else:
                if isinstance(record, dict):
                    yield record
                    continue
                reason = "not a JSON object"
            if skipped is not None:
                skipped.append((number, reason))


def last_jsonl(path: Path, *, chunk: int = 1 << 16) -> dict[str, Any] | None:
    """The last parseable JSON object of a JSON-lines file, reading only its tail."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    with open(path, "rb") as handle:
        start = max(0, size - chunk)
        while True:
            handle.seek(start)
            lines = handle.read(size - start).splitlines()
            if start > 0:
                lines = lines[1:]  # the first line may be cut in the middle
            for raw in reversed(lines):
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    continue
                if isinstance(record, dict):
                    return record
            if start == 0:
                return None
            start = max(0, start - chunk * 8)


def read_events(path: Path, *, skipped: list[tuple[int, str]] | None = None) -> list[Event]:
    """Every well-formed event of an events.jsonl file, in file order (unreadable lines: ``iter_jsonl``)."""
    out = []
    for raw in iter_jsonl(path, skipped=skipped):
        if "event" in raw and "time" in raw:
            try:
                out.append(Event.from_dict(raw))
            except SchemaError:  # a malformed line must not hide the others
                continue
    return out
