"""Line-per-record files: ``.jsonl`` (one JSON object a line) and text read line by line.

A file is one unit; inside it a position is a byte offset, so resume seeks straight to the
next record. Blank lines are not records but keep their line numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

from core.exceptions import DataError
from data.sources.base import Codec, RawRecord, Unit


class LineFormat:
    """One record per line; the whole file is one unit."""

    def __init__(self, name: str, codec: Codec) -> None:
        self.name = name
        self.codec = codec

    def units(self, shard: str, shard_id: str) -> list[Unit]:
        if Path(shard).stat().st_size == 0:
            return []
        return [Unit(shard, shard_id, 0, 0, None, self.codec)]

    def read(self, unit: Unit, record: int, seek: Optional[int]) -> Iterator[RawRecord]:
        try:
            handle = open(unit.shard, "rb")
        except OSError as exc:
            raise DataError(f"cannot open shard: {exc.strerror}", file=unit.shard,
                            hint="the file was listed at start-up; restore it or restart") from exc
        with handle:
            line_no, offset = self._position(handle, record, seek)
            for line in handle:
                offset += len(line)
                line_no += 1
                text = line.rstrip(b"\r\n")
                if text.strip():
                    yield RawRecord(text, line_no - 1, line_no, offset)

    @staticmethod
    def _position(handle, record: int, seek: Optional[int]) -> tuple[int, int]:
        if seek is not None:
            handle.seek(seek)
            return record, seek
        offset = 0
        for _ in range(record):  # no byte offset saved: count lines from the start
            line = handle.readline()
            if not line:
                break
            offset += len(line)
        return record, offset


class WholeFileFormat:
    """A plain text file is one document."""

    name = "text"

    def units(self, shard: str, shard_id: str) -> list[Unit]:
        if Path(shard).stat().st_size == 0:
            return []
        return [Unit(shard, shard_id, 0, 0, 1, "utf8")]

    def read(self, unit: Unit, record: int, seek: Optional[int]) -> Iterator[RawRecord]:
        if record > 0:
            return
        try:
            payload = Path(unit.shard).read_bytes()
        except OSError as exc:
            raise DataError(f"cannot read shard: {exc.strerror}", file=unit.shard, record=0) from exc
        yield RawRecord(payload, 0, 1, None)
