"""What flows through the pipeline: documents, grouped into per-stream chunks.

Chunks are the unit of work (amortizing queue and process hand-offs over several documents);
documents are the unit the in-flight semaphore counts. A chunk carries its stream and a
per-stream sequence number, so the stages after the parallel workers can restore order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from data.state import Position

Payload = Union[bytes, str, np.ndarray, None]


@dataclass(slots=True)
class Doc:
    """One document of one stream, from its raw record to its tokens."""

    counter: int
    """Index in its stream's document sequence (fixes its mixture draw and augmentation)."""
    source: int
    """Index of the source it came from."""
    shard: str
    """Shard file, for provenance and errors."""
    record: int
    """Record index within the shard."""
    codec: str
    """How the decode stage reads the payload (see data.sources.base.Codec)."""
    position: Position
    """Its source's read position at this document (the resume point while it is unfinished)."""
    after: Position
    """Its source's read position just after it."""
    payload: Payload
    """Raw bytes or text, then text, then int32 tokens."""
    raw_bytes: int = 0
    """Size of the raw record (the read-ahead estimate)."""
    error: Optional[str] = None
    """Why the document is bad, if it is."""
    hint: Optional[str] = None
    """What to do about the error."""
    fatal: bool = False
    """True for failures that on_bad_record=skip must not hide (bugs, dead workers)."""
    fields: dict = field(default_factory=dict)
    """Its document fields by name, from its record kind's encoder (data/fields.py; none for text)."""
    pieces: tuple[int, ...] = ()
    """Where each piece after the first starts in its tokens (``data.record_kinds.Encoded.pieces``)."""


@dataclass(slots=True)
class Chunk:
    """Consecutive documents of one stream."""

    stream: int
    seq: int
    docs: list[Doc] = field(default_factory=list)
    estimate: int = 0
    """Estimated tokens, booked against the stream's read-ahead budget until packed."""
