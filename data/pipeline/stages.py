"""The stateless stages: decode and tokenize (augment is in augment.py).

Each stage is a small picklable component with ``process(chunk) -> chunk``, so the same
object runs inline, in a worker thread or in a worker process, wherever the pipeline places
it (see pipeline.py). A stage
never raises for a bad document: it marks the document (``error``), and the packer, which
sees documents in order, fails or skips it deterministically. Source reading, packing and
batching are the stateful stages (reading.py, packing.py, batching.py).
"""

from __future__ import annotations

import json
import sys
from typing import Callable, Protocol

import numpy as np

from data.chat_template import RecordError
from data.pipeline.items import Chunk, Doc
from data.record_kinds import RecordEncoder
from data.tokenizers import ByteTokenizer, Tokenizer

BAD_RECORD_HINT = "fix or remove the record, or set data.on_bad_record=skip to skip and count bad records"


class BadRecord(ValueError):
    """A document that cannot be used (not a bug): skippable with data.on_bad_record=skip."""


class Stage(Protocol):
    name: str
    heavy: bool
    """Costs far more than a hand-off between threads: it gets data.workers workers of its
    own; a light stage runs inline in the thread that already holds the chunk."""
    holds_gil: bool
    """A heavy stage that holds the GIL: its workers hand chunks to worker processes."""

    def process(self, chunk: Chunk) -> Chunk: ...


def each_doc(stage: str, chunk: Chunk, fn: Callable[[Doc], object]) -> Chunk:
    """Replace each good document's payload by ``fn(doc)``; a failure marks the document."""
    for doc in chunk.docs:
        if doc.error is not None:
            continue
        try:
            doc.payload = fn(doc)
        except BadRecord as exc:
            doc.error, doc.hint, doc.payload = str(exc), BAD_RECORD_HINT, None
        except Exception as exc:  # a bug or an environment failure: never skipped
            doc.error = f"{stage} stage failed: {exc!r}"
            doc.hint, doc.fatal, doc.payload = "this is a bug in the data pipeline; report it", True, None
    return chunk


class DecodeStage:
    """Raw record -> text: a JSON line's text field, or UTF-8 bytes."""

    name = "decode"
    # json's C scanner and UTF-8 decoding run at hundreds of MB/s: any hand-off
    # (queue, GIL re-acquisition, pickling) costs more than the work (measured).
    heavy = False
    holds_gil = True

    def __init__(self, text_columns: list[str], structured: list[bool] | None = None) -> None:
        self.text_columns = text_columns  # per source index
        # per source index: its record kind has an encoder, which reads the whole record
        self.structured = structured or [False] * len(text_columns)

    def process(self, chunk: Chunk) -> Chunk:
        return each_doc(self.name, chunk, self._decode)

    def _decode(self, doc: Doc) -> str | dict:
        payload = doc.payload
        if self.structured[doc.source]:
            # A structured record: the tokenize stage parses and encodes it, in its workers
            # (JSON parsing and pickling a dict here cost the trainer's process GIL time).
            return payload
        if doc.codec == "json":
            return self._field(_utf8(payload), self.text_columns[doc.source])
        if isinstance(payload, str):
            return payload
        if isinstance(payload, bytes):
            return _utf8(payload)
        if payload is None:
            raise BadRecord("text is null")
        raise BadRecord(f"text is a {type(payload).__name__}, not a string")

    @staticmethod
    def _object(line: str) -> dict:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadRecord(f"invalid JSON line: {exc.msg} at column {exc.colno}") from None
        except RecursionError:  # nesting deeper than the interpreter's recursion limit
            raise BadRecord(f"JSON line nested deeper than {sys.getrecursionlimit()} levels") from None
        except ValueError:  # an integer of more digits than int() converts (sys.set_int_max_str_digits)
            raise BadRecord(f"JSON line holds an integer of more than {sys.get_int_max_str_digits()} digits") from None
        if not isinstance(obj, dict):
            raise BadRecord(f"JSON line is a {type(obj).__name__}, not an object")
        return obj

    @classmethod
    def _field(cls, line: str, column: str) -> str:
        obj = cls._object(line)
        if column not in obj:
            keys = ", ".join(list(obj)[:8])
            raise BadRecord(f"JSON line has no text key {column!r} (keys: {keys})")
        text = obj[column]
        if not isinstance(text, str):
            raise BadRecord(f"JSON field {column!r} is a {type(text).__name__}, not a string")
        return text


def _utf8(payload: object) -> str:
    if not isinstance(payload, bytes):
        raise BadRecord(f"record is a {type(payload).__name__}, expected bytes")
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRecord(f"invalid UTF-8 at byte {exc.start}") from None


class TokenizeStage:
    """Text -> int32 token ids (no special tokens; the packer adds the separator).

    A structured record is encoded by its source's record kind encoder (data/record_kinds.py)
    into ids plus its document fields, which travel as ``doc.fields`` (and ``doc.pieces``).
    """

    name = "tokenize"

    def __init__(self, tokenizer: Tokenizer, encoders: list[RecordEncoder | None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.encoders = encoders or []  # per source index; None for text sources
        # Measured: byte tokenization runs at ~400 MB/s (light); tokenizers' BPE encode (0.23)
        # at ~2.5 MB/s a core and not in parallel in threads: heavy, and it holds the GIL.
        # Encoding a structured record (rendering a chat template) is Python work per record: heavy too.
        self.heavy = not isinstance(tokenizer, ByteTokenizer) or any(e is not None for e in self.encoders)
        self.holds_gil = True

    def process(self, chunk: Chunk) -> Chunk:
        return each_doc(self.name, chunk, self._encode)

    def _encode(self, doc: Doc) -> np.ndarray:
        if self.encoders and self.encoders[doc.source] is not None:
            payload = doc.payload
            doc.payload = payload if isinstance(payload, dict) else DecodeStage._object(_utf8(payload))
            encoder = self.encoders[doc.source]
            try:  # an encoder that reads files (images) finds them relative to the record's shard
                encoded = (encoder.document(doc.payload, shard=doc.shard) if getattr(encoder, "reads_files", False)
                           else encoder.document(doc.payload))
            except RecordError as exc:  # a malformed record, one its template refuses, or text not UTF-8
                raise BadRecord(str(exc)) from None
            doc.fields, doc.pieces = encoded.fields, encoded.pieces
            return encoded.ids
        try:
            return self.tokenizer.encode_array(doc.payload)
        except RecordError as exc:  # text not encodable as UTF-8 (a lone surrogate): data/tokenizers.py
            raise BadRecord(str(exc)) from None
