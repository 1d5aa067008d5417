"""``.jsonl.zst``: JSON lines compressed with zstd, optionally with a frame index.

Files written by ``python -m data prepare`` hold many independent zstd frames, each ending
at a line boundary, followed by a *skippable* frame (which every zstd decoder ignores) that
indexes them: the byte offset, compressed size, first record and record count of each frame.
Such a file has one unit per frame and a resume decompresses only its frame. Any other
``.zst`` is one unit, read by streaming from the start of the file.

Index layout, at the very end of the file::

    skippable frame header: magic 0x184D2A5E (u32 LE), payload size (u32 LE)
    payload: JSON {"version": 1, "frames": [[offset, csize, first_record, num_records], ...]}
             then the JSON's length (u32 LE) and the tag b"LSFI"
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Optional

import zstandard

from core.exceptions import DataError
from data.sources.base import RawRecord, Unit

_SKIPPABLE_MAGIC = 0x184D2A5E
_TAG = b"LSFI"
_INDEX_VERSION = 1
_STREAM_CHUNK = 1 << 20


class ZstdJsonlFormat:
    """Reader for ``.jsonl.zst`` shards, indexed or not."""

    name = "jsonl.zst"

    def units(self, shard: str, shard_id: str) -> list[Unit]:
        frames = read_frame_index(shard)
        if frames is None:
            if Path(shard).stat().st_size == 0:
                return []
            return [Unit(shard, shard_id, 0, 0, None, "json")]  # no span: streamed
        return [
            Unit(shard, shard_id, i, first, count, "json", span=(offset, size))
            for i, (offset, size, first, count) in enumerate(frames)
            if count > 0
        ]

    def read(self, unit: Unit, record: int, seek: Optional[int]) -> Iterator[RawRecord]:
        if unit.span is None:
            yield from self._read_stream(unit, record)
        else:
            yield from self._read_frame(unit, record)

    def _read_frame(self, unit: Unit, record: int) -> Iterator[RawRecord]:
        (offset, size), first, count = unit.span, unit.first_record, unit.num_records
        with _open(unit.shard) as handle:
            handle.seek(offset)
            compressed = handle.read(size)
        try:
            data = zstandard.ZstdDecompressor().decompress(compressed)
        except zstandard.ZstdError as exc:
            raise DataError(
                f"corrupt zstd frame {unit.block} (lines {first + 1}..{first + count}): {exc}",
                file=unit.shard, record=first + record,
                hint="re-create the shard (python -m data prepare) or set data.on_bad_record=skip",
            ) from exc
        lines = data.split(b"\n")
        for local in range(record, min(count, len(lines))):
            text = lines[local].rstrip(b"\r")
            if text.strip():
                yield RawRecord(text, first + local, local + 1, None)

    def _read_stream(self, unit: Unit, record: int) -> Iterator[RawRecord]:
        line_no = 0
        for line in _stream_lines(unit.shard):
            line_no += 1
            if line_no <= record:
                continue
            text = line.rstrip(b"\r")
            if text.strip():
                yield RawRecord(text, line_no - 1, line_no, None)


def _open(path: str) -> BinaryIO:
    try:
        return open(path, "rb")
    except OSError as exc:
        raise DataError(f"cannot open shard: {exc.strerror}", file=path,
                        hint="the file was listed at start-up; restore it or restart") from exc


class TruncatedShardError(DataError):
    """A shard that ends inside a zstd frame: its tail is missing, so every record after the
    cut is lost. Never skipped by data.on_bad_record=skip."""

    skippable = False


def _stream_lines(path: str) -> Iterator[bytes]:
    """Lines of a zstd file of any frame layout, decompressed frame by frame as a stream.

    A file that ends inside a frame is truncated: TruncatedShardError names the byte offset
    where the unfinished frame starts and where the file ends. Without this check a cut
    file would read as a last line of garbage (or as no documents at all)."""
    line_no = 0
    rest = b""
    decompressor = zstandard.ZstdDecompressor()
    frame, frame_start, consumed = None, 0, 0
    with _open(path) as handle:
        while chunk := handle.read(_STREAM_CHUNK):
            while chunk:
                if frame is None:
                    frame, frame_start = decompressor.decompressobj(), consumed
                try:
                    out = frame.decompress(chunk)
                except zstandard.ZstdError as exc:
                    raise DataError(f"corrupt zstd data in the frame at byte {frame_start}, after line {line_no}: {exc}",
                                    file=path, record=line_no,
                                    hint="re-create the shard or set data.on_bad_record=skip") from exc
                if frame.eof:
                    unused = frame.unused_data
                    consumed += len(chunk) - len(unused)
                    chunk, frame = unused, None
                else:
                    consumed += len(chunk)
                    chunk = b""
                if out:
                    lines = (rest + out).split(b"\n")
                    rest = lines.pop()
                    line_no += len(lines)
                    yield from lines
    if frame is not None:
        raise TruncatedShardError(
            f"truncated zstd file: the frame starting at byte {frame_start} is cut off at byte {consumed} "
            f"(end of file), after line {line_no}",
            file=path, offset=consumed, record=line_no,
            hint="the file is incomplete (an interrupted copy or download); restore or re-create it",
        )
    if rest:
        yield rest


def read_frame_index(path: str) -> Optional[list[tuple[int, int, int, int]]]:
    """The frame table of an indexed file, or None when the file has no index."""
    with _open(path) as handle:
        end = handle.seek(0, os.SEEK_END)
        if end < 16:
            return None
        handle.seek(end - 8)
        length, tag = struct.unpack("<I4s", handle.read(8))
        if tag != _TAG or length + 16 > end:
            return None
        handle.seek(end - 16 - length)
        magic, size = struct.unpack("<II", handle.read(8))
        if magic != _SKIPPABLE_MAGIC or size != length + 8:
            return None
        try:
            index = json.loads(handle.read(length))
        except ValueError as exc:
            raise DataError(f"damaged frame index: {exc}", file=path,
                            hint="re-create the shard with python -m data prepare") from exc
    if index.get("version") != _INDEX_VERSION:
        raise DataError(f"frame index version {index.get('version')} is not {_INDEX_VERSION}",
                        file=path, hint="re-create the shard with this version of python -m data prepare")
    return [tuple(frame) for frame in index["frames"]]


def write_indexed_jsonl_zst(
    path: Path, lines: Iterable[bytes], *, frame_records: int, level: int = 3
) -> int:
    """Write JSON lines as independent checksummed frames plus a frame index; returns the record count."""
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True)
    frames: list[list[int]] = []
    pending: list[bytes] = []
    offset = 0
    records = 0
    with open(path, "wb") as out:

        def flush() -> None:
            nonlocal offset
            if not pending:
                return
            frame = compressor.compress(b"\n".join(pending) + b"\n")
            out.write(frame)
            frames.append([offset, len(frame), records - len(pending), len(pending)])
            offset += len(frame)
            pending.clear()

        for line in lines:
            pending.append(line)
            records += 1
            if len(pending) >= frame_records:
                flush()
        flush()
        index = json.dumps({"version": _INDEX_VERSION, "frames": frames}).encode()
        out.write(struct.pack("<II", _SKIPPABLE_MAGIC, len(index) + 8))
        out.write(index + struct.pack("<I4s", len(index), _TAG))
    return records
