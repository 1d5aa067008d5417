"""The streaming-source contract: shards split into units, read from any position.

A *unit* is the smallest piece of a source that is handed to a stream and the farthest a
resume ever re-reads: a Parquet row group, one frame of an indexed ``.jsonl.zst``, or a
whole file for formats that cannot seek further (plain ``.jsonl`` seeks by byte offset
inside its file instead). Units have stable IDs (shard path relative to the source root,
plus the block number), so a stream position survives moving the dataset directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Literal, Optional, Protocol, Union

Codec = Literal["json", "utf8"]
"""How a raw payload becomes text: a JSON object's text field, or UTF-8 bytes as they are."""


@dataclass(frozen=True)
class Unit:
    """A readable block of one shard."""

    shard: str
    """Shard path as listed (shown in provenance and errors)."""
    shard_id: str
    """Stable shard ID: the path relative to the source root."""
    block: int
    """Block number within the shard (row group, frame, or 0 for a whole file)."""
    first_record: int
    """Shard-level index of the unit's first record."""
    num_records: Optional[int]
    """Records (lines or rows) in the unit, when the format knows it without reading."""
    codec: Codec
    """How the decode stage turns a payload into text."""
    span: Optional[tuple[int, int]] = None
    """Byte range (offset, length) of the block in the file, for formats that store blocks contiguously."""

    @property
    def id(self) -> str:
        return f"{self.shard_id}#{self.block}"


@dataclass(frozen=True)
class RawRecord:
    """One record as read from a unit, before decoding."""

    payload: Union[bytes, str, None]
    """Raw line, file content, or a Parquet cell."""
    record: int
    """Record index within the shard (0-based), for provenance and errors."""
    next_record: int
    """Unit-local position just after this record."""
    next_seek: Optional[int]
    """Byte offset just after this record, for formats that can seek to it (else None)."""


class ShardFormat(Protocol):
    """One file format: how to cut a shard into units and read a unit from a position."""

    name: str

    def units(self, shard: str, shard_id: str) -> list[Unit]:
        """The shard's units in file order (empty units may be omitted)."""
        ...

    def read(self, unit: Unit, record: int, seek: Optional[int]) -> Iterator[RawRecord]:
        """Records of ``unit`` from unit-local position ``record`` (``seek``: its byte offset, if known)."""
        ...


class StreamingSource(Protocol):
    """A named, weighted set of shards that the pipeline reads unit by unit."""

    name: str
    weight: float

    def units(self) -> list[Unit]:
        """Every unit of every shard, in a stable order."""
        ...

    def fingerprint(self) -> str:
        """Changes when the listed shards or their units change."""
        ...

    def read(self, unit: Unit, record: int, seek: Optional[int]) -> Iterator[RawRecord]: ...
