"""Parquet shards: one unit per row group, reading only the configured text column."""

from __future__ import annotations

from typing import Iterator, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from core.exceptions import DataError
from data.sources.base import RawRecord, Unit


class ParquetFormat:
    """Row groups are units; a column projection reads just the text column."""

    name = "parquet"

    def __init__(self, text_column: str, columns: tuple[str, ...] | None = None) -> None:
        self.text_column = text_column
        # Structured records (chat, prompt/completion): these columns, read as one dict a row.
        self.columns = columns

    def units(self, shard: str, shard_id: str) -> list[Unit]:
        meta = self._open(shard).metadata
        names = meta.schema.to_arrow_schema().names  # top-level columns (schema.names lists nested leaves)
        if self.columns is not None:
            missing = [c for c in self.columns if c not in names]
            if missing:
                raise DataError(
                    f"missing column(s) {', '.join(map(repr, missing))} (columns: {', '.join(names)})",
                    file=shard, hint="the record kind of this source (data.sources[i].record) needs them",
                )
        elif self.text_column not in names:
            raise DataError(
                f"missing text column {self.text_column!r} (columns: {', '.join(names)})",
                file=shard,
                hint="set text_column of this source in data.sources to the column holding the text",
            )
        units, first = [], 0
        for block in range(meta.num_row_groups):
            rows = meta.row_group(block).num_rows
            if rows:
                units.append(Unit(shard, shard_id, block, first, rows, "utf8"))
            first += rows
        return units

    def read(self, unit: Unit, record: int, seek: Optional[int]) -> Iterator[RawRecord]:
        if record >= (unit.num_records or 0):
            return
        try:
            table = self._open(unit.shard).read_row_group(unit.block, columns=list(self.columns or [self.text_column]))
        except (pa.ArrowException, OSError) as exc:
            raise DataError(
                f"cannot read row group {unit.block}: {exc}", file=unit.shard, record=unit.first_record,
                hint="re-create the shard or set data.on_bad_record=skip",
            ) from exc
        table = table.slice(record)
        values = table.to_pylist() if self.columns is not None else table.column(0).to_pylist()
        for offset, value in enumerate(values, start=record):
            yield RawRecord(value, unit.first_record + offset, offset + 1, None)

    @staticmethod
    def _open(shard: str) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(shard)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"cannot open Parquet shard: {exc}", file=shard,
                            hint="check that the file is a complete Parquet file") from exc
