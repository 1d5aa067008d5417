"""The ``text`` record kind: a document's text (a file, a line, a JSON line's or a Parquet row's
``text_column``), tokenized as it is. The only kind data.packing=split may cut across rows."""

from __future__ import annotations

from data.record_kinds import RecordKind

KIND = RecordKind(name="text", summary="text (text_column), tokenized as it is")
