"""A configured source: its shards, their formats, and reading any unit from a position."""

from __future__ import annotations

import hashlib
from typing import Iterator, Optional

from core.config import SourceConfig
from core.exceptions import DataError
from data.record_kinds import record_kind
from data.sources.base import RawRecord, ShardFormat, Unit
from data.sources.discover import expand, format_of
from data.sources.lines import LineFormat, WholeFileFormat
from data.sources.parquet import ParquetFormat
from data.sources.zstd import ZstdJsonlFormat


class Source:
    """One entry of data.sources (or data.eval_source): a file, directory or glob of shards."""

    def __init__(self, config: SourceConfig, *, label: str) -> None:
        self.config = config
        self.label = label
        self.name = config.name or config.path
        self.weight = config.weight
        self._formats = _formats(config)
        root, files = expand(config.path)
        self._units: list[Unit] = []
        self._shard_format: dict[str, ShardFormat] = {}
        for path in files:
            fmt = self._format_for(str(path))
            shard_id = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
            self._shard_format[str(path)] = fmt
            self._units.extend(fmt.units(str(path), shard_id))
        if not self._units:
            raise DataError(
                f"source {self.name!r} has no records ({len(files)} empty file(s))",
                file=config.path, hint=f"point {label}.path at non-empty shards",
            )

    def _format_for(self, path: str) -> ShardFormat:
        name = self.config.format if self.config.format != "auto" else format_of(path)
        if name is None:
            raise DataError(
                f"cannot tell the format of {path!r} from its suffix", file=path,
                hint=f"set {self.label}.format (parquet, jsonl, jsonl.zst or text)",
            )
        return self._formats[name]

    def units(self) -> list[Unit]:
        return list(self._units)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for u in self._units:
            h.update(f"{u.id}:{u.first_record}:{u.num_records}\n".encode())
        return h.hexdigest()[:16]

    def content_digest(self) -> dict[str, str]:
        """{shard ID: sha256 of the shard's bytes}: what its records are, and how many. Reads
        every shard once (about a second per GB); for caches of values computed from the data."""
        digests = {}
        for unit in self._units:
            if unit.shard_id in digests:
                continue
            try:
                with open(unit.shard, "rb") as handle:
                    digests[unit.shard_id] = hashlib.file_digest(handle, "sha256").hexdigest()
            except OSError as exc:
                raise DataError(f"cannot read shard: {exc.strerror}", file=unit.shard,
                                hint="the file was listed at start-up; restore it or restart") from exc
        return digests

    def describe(self) -> str:
        """What must match for a saved stream position to mean the same data."""
        return f"{self.name}|weight={self.weight!r}|units={len(self._units)}|{self.fingerprint()}"

    def read(self, unit: Unit, record: int, seek: Optional[int]) -> Iterator[RawRecord]:
        return self._shard_format[unit.shard].read(unit, record, seek)


def _formats(config: SourceConfig) -> dict[str, ShardFormat]:
    text: ShardFormat = WholeFileFormat() if config.text_unit == "file" else LineFormat("text", "utf8")
    return {
        "parquet": ParquetFormat(config.text_column, record_kind(config.record).columns),
        "jsonl": LineFormat("jsonl", "json"),
        "jsonl.zst": ZstdJsonlFormat(),
        "text": text,
    }


def open_sources(configs: tuple[SourceConfig, ...], *, label: str) -> list[Source]:
    """Open every configured source; a missing or empty one is a DataError naming it."""
    if not configs:
        raise DataError(f"{label} is empty", hint=f"list at least one source under {label}")
    return [Source(c, label=f"{label}[{i}]") for i, c in enumerate(configs)]

