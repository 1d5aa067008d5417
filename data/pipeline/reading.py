"""The source stage's readers: one stream's documents, in order, from its saved position.

A ``StreamReader`` asks the mixture which source document ``c`` comes from and takes that
source's next record through a ``SourceCursor``, which walks the stream's units of the
source epoch by epoch. Reading never raises for bad input: a unit that cannot be read
becomes one bad document (and the cursor moves to the next unit), so the packer decides,
in order, whether to stop or to skip and count it.
"""

from __future__ import annotations

from typing import Iterator, Optional

from core.exceptions import DataError
from data.pipeline.items import Doc
from data.sharding import Mixture, StreamAssignment
from data.sources.base import RawRecord, Unit
from data.sources.source import Source
from data.state import Position, StreamState


class SourceCursor:
    """Reads one source's records for one stream, from a Position."""

    def __init__(self, source: Source, assignment: StreamAssignment, stream: int,
                 position: Position) -> None:
        self._source = source
        self._assignment = assignment
        self._stream = stream
        self._epoch, self._cursor = position.epoch, position.cursor
        self._record, self._seek = position.record, position.seek
        self._unit: Optional[Unit] = None
        self._records: Optional[Iterator[RawRecord]] = None
        self._idle_units = 0
        self._idle_limit = 2 * len(source.units()) + assignment.num_streams + 2

    def position(self) -> Position:
        return Position(self._epoch, self._cursor, self._record, self._seek)

    def next(self) -> tuple[Unit, Optional[RawRecord], Optional[DataError], Position, Position]:
        """(unit, record or None, error or None, position before, position after)."""
        while True:
            if self._records is None:
                self._open_unit()
                continue
            before = self.position()
            try:
                raw = next(self._records)
            except StopIteration:
                self._next_unit()
                continue
            except DataError as exc:  # the unit gives a document after all: its error
                unit = self._unit
                self._next_unit()
                self._idle_units = 0  # (a damaged unit is not an empty one: its error is the report)
                return unit, None, exc, before, self.position()
            self._idle_units = 0
            self._record, self._seek = raw.next_record, raw.next_seek
            unit = self._unit
            if unit.num_records is not None and self._record >= unit.num_records:
                self._next_unit()
            return unit, raw, None, before, self.position()

    def _open_unit(self) -> None:
        units = self._assignment.units(self._stream, self._epoch)
        if self._cursor >= len(units):
            self._epoch, self._cursor, self._record, self._seek = self._epoch + 1, 0, 0, None
            return
        self._unit = units[self._cursor]
        self._records = self._source.read(self._unit, self._record, self._seek)

    def _next_unit(self) -> None:
        if self._records is not None and hasattr(self._records, "close"):
            self._records.close()
        self._records = None
        self._idle_units += 1
        if self._idle_units > self._idle_limit:
            raise DataError(
                f"source {self._source.name!r} yields no records for stream {self._stream}",
                file=self._source.config.path,
                hint="the source's files hold no documents; check data.sources[].path",
            )
        self._cursor, self._record, self._seek = self._cursor + 1, 0, None
        if self._cursor >= len(self._assignment.units(self._stream, self._epoch)):
            self._epoch, self._cursor = self._epoch + 1, 0

    def close(self) -> None:
        if self._records is not None and hasattr(self._records, "close"):
            self._records.close()
        self._records = None


class StreamReader:
    """The documents of one stream: mixture choice, then that source's next record."""

    def __init__(self, stream: int, state: StreamState, *, sources: list[Source],
                 assignments: list[StreamAssignment], mixture: Mixture) -> None:
        self.stream = stream
        self._mixture = mixture
        self._counter = state.docs
        self._cursors = [
            SourceCursor(src, asg, stream, pos)
            for src, asg, pos in zip(sources, assignments, state.positions)
        ]

    def read(self, max_docs: int, max_bytes: int) -> list[Doc]:
        """The next documents: at most max_docs, stopping once max_bytes are read."""
        docs: list[Doc] = []
        size = 0
        while len(docs) < max_docs and size < max_bytes:
            doc = self._next_doc()
            docs.append(doc)
            size += doc.raw_bytes
        return docs

    def _next_doc(self) -> Doc:
        source = self._mixture.choose(self.stream, self._counter)
        unit, raw, error, before, after = self._cursors[source].next()
        doc = Doc(self._counter, source, unit.shard, 0, unit.codec, before, after, None)
        self._counter += 1
        if error is not None:
            doc.record = int(error.context.get("record", unit.first_record + before.record))
            doc.error, doc.hint, doc.fatal = error.message, error.hint, not error.skippable
            return doc
        doc.record, doc.payload = raw.record, raw.payload
        doc.raw_bytes = len(raw.payload) if isinstance(raw.payload, (bytes, str)) else 0
        return doc

    def close(self) -> None:
        for cursor in self._cursors:
            cursor.close()
