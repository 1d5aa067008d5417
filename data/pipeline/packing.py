"""The pack stage: one stream's documents -> fixed-length sequences, with provenance and state.

Documents are concatenated, each followed by the EOS separator, and cut every ``seq_len``
tokens; a document that does not fit continues in the next sequence (its ``DocSpan`` then
has a ``doc_offset`` > 0). Every sequence carries the stream state *after* it, so a batch
can hand the trainer the exact position to resume from.

The packer is the first stage that sees a stream's documents in order, so it is where a bad
document either stops the stream (``on_bad_record: error``, reported when the batch that
needs it is assembled) or is skipped (``skip``). A skipped record travels with the row whose
stream state first counts it as read (``PackedSequence.skipped``), so the pipeline counts it
when it hands that row to the trainer: never for rows read ahead and not yet consumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from core.exceptions import DataError
from data.batch import DocSpan
from data.fields import TARGET_MASK, DocField, Pack
from data.pipeline.items import Doc
from data.state import StreamState


class BadRecordKey(NamedTuple):
    """A skipped bad record: the same record read again (another epoch, a stream that repeats its
    unit) has the same key, so the pipeline counts it once."""

    source: int
    shard: str
    record: int
    """0-based index in the shard (Doc.record)."""

    @classmethod
    def of(cls, doc: Doc) -> "BadRecordKey":
        return cls(doc.source, doc.shard, doc.record)


@dataclass(slots=True)
class PackedSequence:
    tokens: np.ndarray
    """(seq_len,) int32 token ids."""
    spans: list[DocSpan]
    """Document spans, left to right."""
    state: StreamState | None
    """The stream's state after this sequence (kept for the last sequence of each batch only)."""
    fields: dict[str, np.ndarray] = field(default_factory=dict)
    """(seq_len,) values of each per-token or per-document field the row carries (data/fields.py):
    whole-document rows always carry the target mask; none: every token trains."""
    media: dict[str, list[np.ndarray]] = field(default_factory=dict)
    """The items of each ragged field of the row's documents, in document order (data/fields.py)."""
    skipped: tuple[BadRecordKey, ...] = ()
    """Bad records skipped (``on_bad_record: skip``) after the previous row and up to this row's
    state: counted when the row is consumed."""


@dataclass(slots=True)
class _UnusableRun:
    first_epoch: int
    reasons: dict[str, int] = field(default_factory=dict)


class UnusableSources:
    """Per source, the documents a stream read since the last one that reached a row.

    A source of which a whole epoch (of the stream's units) gave no usable document (every one
    too long for ``seq_len``, bad and skipped, or empty) is a DataError naming the source:
    without it the stream would read that source forever and never close a row. The epoch
    is a document's read position's; two past the epoch the run began in means one whole
    epoch went by in the run."""

    def __init__(self, stream: int, source_names: list[str], seq_len: int) -> None:
        self._stream = stream
        self._names = source_names
        self._seq_len = seq_len
        self._runs: dict[int, _UnusableRun] = {}

    def used(self, doc: Doc) -> None:
        self._runs.pop(doc.source, None)

    def not_used(self, doc: Doc, why: str) -> DataError | None:
        run = self._runs.setdefault(doc.source, _UnusableRun(doc.position.epoch))
        run.reasons[why] = run.reasons.get(why, 0) + 1
        if doc.position.epoch < run.first_epoch + 2:
            return None
        counts = ", ".join(f"{n} {reason}" for reason, n in sorted(run.reasons.items()))
        return DataError(
            f"source {self._names[doc.source]!r} has no usable record: a whole pass over its records "
            f"(stream {self._stream}) kept none ({counts}; data.seq_len={self._seq_len})",
            file=doc.shard, stream=self._stream,
            hint="raise data.seq_len, shorten or fix the records, or remove the source",
        )


@dataclass(slots=True)
class StreamFailure:
    """Takes the place of the sequence a failed stream can no longer produce."""

    error: DataError


class StreamPacker:
    """Packs one stream, starting from (and continuing) a StreamState.

    Work is per call, not per token: the documents of a chunk are concatenated once and
    the full sequences are rows of that array; Python only walks documents and spans.
    """

    def __init__(self, stream: int, state: StreamState, *, seq_len: int, eos_id: int,
                 source_names: list[str], skip_bad: bool, state_every: int = 1) -> None:
        self.stream = stream
        self._seq_len = seq_len
        self._eos = np.array([eos_id], dtype=np.int32)
        self._names = source_names
        self._skip_bad = skip_bad
        self._state_every = state_every  # states are only needed at batch boundaries
        self._positions = list(state.positions)
        self._docs = state.docs  # documents finished
        self._next = state.docs  # counter of the next document to arrive
        self._skip = state.skip
        self._sequences = state.sequences
        self._carry = np.empty(0, dtype=np.int32)  # tokens of the unfinished sequence
        self._carry_spans: list[DocSpan] = []
        self._carry_skipped: list[BadRecordKey] = []  # skipped bad records of the unfinished sequence
        self._unusable = UnusableSources(stream, source_names, seq_len)
        self.failed = False
        self.bad_records = 0
        self.tokens = 0

    def accept(self, docs: list[Doc]) -> list[PackedSequence | StreamFailure]:
        """Pack documents (in stream order); returns the sequences they completed."""
        if self.failed:
            return []
        pieces, entries, failure = self._lay_out(docs)
        flat = np.concatenate(pieces) if len(pieces) > 1 else self._carry
        self.tokens += len(flat) - len(self._carry)
        T = self._seq_len
        full = len(flat) // T
        spans: list[list[DocSpan]] = [self._carry_spans] + [[] for _ in range(full)]
        states = self._walk(entries, spans, full)
        skipped = self._skipped_by_row(entries, full)
        rows = flat[: full * T].reshape(full, T)
        out: list[PackedSequence | StreamFailure] = [
            PackedSequence(rows[i], spans[i], states.get(i), skipped=tuple(skipped[i])) for i in range(full)
        ]
        self._carry, self._carry_spans, self._carry_skipped = flat[full * T:].copy(), spans[full], skipped[full]
        self._sequences += full
        if failure is not None:
            out.append(failure)
        return out

    def _lay_out(self, docs: list[Doc]) -> tuple[list[np.ndarray], list[tuple], StreamFailure | None]:
        """Token pieces to concatenate, and (doc, start, end, first token) in that array."""
        pieces, entries = [self._carry], []
        cursor = len(self._carry)
        for doc in docs:
            if doc.counter != self._next:
                raise RuntimeError(f"stream {self.stream}: document {doc.counter} arrived, expected {self._next}")
            self._next += 1
            first, self._skip = self._skip, 0  # tokens already packed before a resume
            if doc.error is not None:
                if not self._skip_bad or doc.fatal:
                    self.failed = True
                    return pieces, entries, StreamFailure(DataError(
                        doc.error, file=doc.shard, record=doc.record + 1, stream=self.stream, hint=doc.hint))
                self.bad_records += 1
            if doc.error is not None or len(doc.payload) == 0:  # adds nothing, not even a separator
                entries.append((doc, cursor, cursor, 0))
                error = self._unusable.not_used(doc, "bad" if doc.error is not None else "empty")
                if error is not None:
                    self.failed = True
                    return pieces, entries, StreamFailure(error)
                continue
            content: np.ndarray = doc.payload
            self._unusable.used(doc)
            if first < len(content):
                pieces.append(content[first:])
            pieces.append(self._eos)
            end = cursor + len(content) + 1 - first
            entries.append((doc, cursor, end, first))
            cursor = end
        return pieces, entries, None

    def _skipped_by_row(self, entries: list[tuple], full: int) -> list[list[BadRecordKey]]:
        """The skipped bad records of each row (the last: of the unfinished one). A skipped record
        adds no token, at the cursor where it was read: the row holding that cursor is the one
        whose state first counts it as read (a record right after a row that ends exactly at a
        document's end belongs to the next row, as the state of that row does not include it)."""
        skipped: list[list[BadRecordKey]] = [self._carry_skipped] + [[] for _ in range(full)]
        for doc, start, _, _ in entries:
            if doc.error is not None:
                skipped[start // self._seq_len].append(BadRecordKey.of(doc))
        return skipped

    def _walk(self, entries: list[tuple], spans: list[list[DocSpan]], full: int) -> dict[int, StreamState]:
        """Fill each sequence's spans; return the states of the sequences that end a batch."""
        T = self._seq_len
        wanted = [i for i in range(full) if (self._sequences + i + 1) % self._state_every == 0]
        states: dict[int, StreamState] = {}
        w = 0
        for doc, start, end, first in entries:
            if start < end:
                name = self._names[doc.source]
                s = start // T
                while True:
                    lo, hi = max(start, s * T), min(end, (s + 1) * T)
                    spans[s].append(DocSpan(name, doc.shard, doc.record, lo - s * T, hi - s * T, first + lo - start))
                    if hi == end:
                        break
                    s += 1
                while w < len(wanted) and (wanted[w] + 1) * T < end:  # sequences that cut this document
                    i = wanted[w]
                    positions = list(self._positions)
                    positions[doc.source] = doc.position  # resume re-reads it and skips what is packed
                    states[i] = StreamState(tuple(positions), doc.counter, first + (i + 1) * T - start,
                                            self._sequences + i + 1)
                    w += 1
            self._positions[doc.source] = doc.after
            self._docs = doc.counter + 1
            if start < end and w < len(wanted) and (wanted[w] + 1) * T == end:  # ends exactly here
                i = wanted[w]
                states[i] = StreamState(tuple(self._positions), self._docs, 0, self._sequences + i + 1)
                w += 1
        return states


PAD_SOURCE = "<padding>"
"""Source name of the span that pads a row of whole documents (no document, no loss)."""


class WholeDocPacker:
    """Packs one stream's whole documents into rows, padding the rest of each row.

    No document is cut across rows, so a conversation always sees its prompt (the packing of
    chat and prompt/completion data). Documents keep their order: a row closes when the next
    document does not fit, so the state after a row is simply "read from the first document
    of the next row" (``skip`` is always 0). A document longer than ``seq_len`` (with its
    separator) is truncated to ``seq_len`` tokens or dropped (``data.overlong``); both are
    counted, and a truncated document with a target mask whose kept part trains no token is
    dropped (and counted as dropped). A document of several pieces (a preference pair) is laid
    out as adjacent documents of one row, never truncated. Each document's fields are laid
    beside its tokens by their ``Pack`` (data/fields.py); the separator after a document is a
    target iff its last token is. A source none of whose documents is usable ends the stream
    (``UnusableSources``).
    """

    def __init__(self, stream: int, state: StreamState, *, seq_len: int, eos_id: int, pad_id: int,
                 source_names: list[str], skip_bad: bool, overlong: str, state_every: int = 1,
                 one_per_row: bool = False, fields: dict[str, DocField] | None = None) -> None:
        if state.skip:
            raise DataError(
                f"stream {stream}: the data state was saved with data.packing=split (skip={state.skip})",
                stream=stream, hint="resume with the data.packing of the run",
            )
        self.stream = stream
        self._seq_len = seq_len
        self._eos = np.array([eos_id], dtype=np.int32)
        self._pad = pad_id
        self._names = source_names
        self._skip_bad = skip_bad
        self._overlong = overlong
        self._state_every = state_every
        self._one_per_row = one_per_row  # prompt records: a row is one prompt (never cut: a bad record)
        self._fields = {TARGET_MASK.name: TARGET_MASK, **(fields or {})}  # what the documents may carry
        self._positions = list(state.positions)
        self._docs = state.docs
        self._next = state.docs
        self._sequences = state.sequences
        self._tokens: list[np.ndarray] = []
        self._spans: list[DocSpan] = []
        self._laid: dict[str, list[tuple[int, np.ndarray]]] = {}  # field -> (start, values) of the row
        self._media: dict[str, list[np.ndarray]] = {}  # ragged field -> the row's items
        self._skipped: list[BadRecordKey] = []  # bad records skipped since the last row closed
        self._fill = 0
        self._unusable = UnusableSources(stream, source_names, seq_len)
        self.failed = False
        self.bad_records = 0
        self.truncated = 0
        self.dropped = 0
        self.padding = 0
        self.tokens = 0

    def accept(self, docs: list[Doc]) -> list[PackedSequence | StreamFailure]:
        if self.failed:
            return []
        out: list[PackedSequence | StreamFailure] = []
        T = self._seq_len
        for doc in docs:
            if doc.counter != self._next:
                raise RuntimeError(f"stream {self.stream}: document {doc.counter} arrived, expected {self._next}")
            self._next += 1
            if doc.error is not None:
                failure = self._reject(doc)
                if failure is not None:
                    out.append(failure)
                    return out
                continue
            content: np.ndarray = doc.payload
            if len(content) == 0:
                failure = self._not_used(doc, "empty")
                if failure is not None:
                    out.append(failure)
                    return out
                continue
            if doc.pieces:  # a preference pair: two documents, one unit
                out.extend(self._accept_pieces(doc))
                if self.failed:
                    return out
                continue
            piece = np.concatenate([content, self._eos])
            laid = self._lay(doc, 0, len(content))
            if len(piece) > T and self._one_per_row:
                doc.error = (f"prompt record has {len(content)} tokens with its answer, more than "
                             f"data.seq_len={T} - 1 (the context of its rollouts)")
                doc.hint = "shorten the prompt, raise data.seq_len, or set data.on_bad_record=skip"
                failure = self._reject(doc)
                if failure is not None:
                    out.append(failure)
                    return out
                continue
            if len(piece) > T:
                dropped = self._overlong == "drop" or self._kept_whole(doc)
                piece, laid = piece[:T], {name: values[:T] for name, values in laid.items()}
                mask = laid.get(TARGET_MASK.name)
                if dropped or (mask is not None and not mask[1:].any()):  # nothing left to train
                    self.dropped += 1
                    failure = self._not_used(doc, "longer than data.seq_len")
                    if failure is not None:
                        out.append(failure)
                        return out
                    continue
                self.truncated += 1
            if self._fill + len(piece) > T:
                out.append(self._close_row())
            self._place(doc, piece, laid, 0)
            self._add_media(doc)
            self._used(doc)
            if self._fill == T or self._one_per_row:
                out.append(self._close_row())
        return out

    def _accept_pieces(self, doc: Doc) -> list[PackedSequence | StreamFailure]:
        """Pack a document of several pieces (``doc.pieces``: where each after the first starts; a
        preference pair: chosen, rejected) as adjacent documents of one row.

        The document is one unit: it is never split across rows, and one longer than a row (with a
        separator per piece) is dropped and counted, whatever ``data.overlong`` says (truncating
        would cut the responses the loss compares)."""
        T, out = self._seq_len, []
        cuts = (0, *doc.pieces, len(doc.payload))
        bounds = list(zip(cuts[:-1], cuts[1:]))
        if sum(hi - lo + 1 for lo, hi in bounds) > T:
            self.dropped += 1
            failure = self._not_used(doc, "longer than data.seq_len")
            return [failure] if failure is not None else out
        if self._fill + len(doc.payload) + len(bounds) > T:
            out.append(self._close_row())
        for lo, hi in bounds:
            self._place(doc, np.concatenate([doc.payload[lo:hi], self._eos]), self._lay(doc, lo, hi), lo)
        self._add_media(doc)
        self._used(doc)
        if self._fill == T:
            out.append(self._close_row())
        return out

    def _lay(self, doc: Doc, lo: int, hi: int) -> dict[str, np.ndarray]:
        """The document's per-token and per-document fields over its tokens [lo, hi) and a separator."""
        laid = {}
        for name, value in doc.fields.items():
            spec = self._fields.get(name)
            if spec is None:
                raise RuntimeError(f"stream {self.stream}: a document carries the field {name!r}, which no "
                                   "record kind of the run declares")
            if spec.pack is Pack.TOKENS:
                laid[name] = spec.on_document(value[lo:hi], hi - lo)
            elif spec.pack is Pack.DOCUMENT:
                laid[name] = spec.on_document(value, hi - lo)
        return laid

    def _place(self, doc: Doc, piece: np.ndarray, laid: dict[str, np.ndarray], offset: int) -> None:
        """Append one laid-out document (or piece) to the open row."""
        self._spans.append(DocSpan(self._names[doc.source], doc.shard, doc.record,
                                   self._fill, self._fill + len(piece), offset))
        self._tokens.append(piece)
        for name, values in laid.items():
            self._laid.setdefault(name, []).append((self._fill, values))
        self._fill += len(piece)

    def _kept_whole(self, doc: Doc) -> bool:
        """The document carries items of a ``whole_document`` field (an image): truncating it would
        cut them from their tokens, so it is dropped instead (data/fields.py)."""
        return any(self._fields[name].whole_document and len(value) for name, value in doc.fields.items()
                   if self._fields[name].pack is Pack.RAGGED)

    def _add_media(self, doc: Doc) -> None:
        for name, value in doc.fields.items():
            if self._fields[name].pack is Pack.RAGGED:
                self._media.setdefault(name, []).extend(value)

    def _reject(self, doc: Doc) -> StreamFailure | None:
        """A bad document ends the stream (``on_bad_record: error``, or a fatal failure), or is
        skipped and counted (``skip``): returns the failure, or None when skipped."""
        if not self._skip_bad or doc.fatal:
            self.failed = True
            return StreamFailure(DataError(doc.error, file=doc.shard, record=doc.record + 1, stream=self.stream,
                                           hint=doc.hint))
        self.bad_records += 1
        self._skipped.append(BadRecordKey.of(doc))
        return self._not_used(doc, "bad")

    def _consumed(self, doc: Doc) -> None:
        self._positions[doc.source] = doc.after
        self._docs = doc.counter + 1

    def _used(self, doc: Doc) -> None:
        self._unusable.used(doc)
        self._consumed(doc)

    def _not_used(self, doc: Doc, why: str) -> StreamFailure | None:
        """A document consumed without reaching a row: the failure once its source has none."""
        self._consumed(doc)
        error = self._unusable.not_used(doc, why)
        if error is None:
            return None
        self.failed = True
        return StreamFailure(error)

    def _close_row(self) -> PackedSequence:
        T, fill = self._seq_len, self._fill
        if fill < T:
            self._tokens.append(np.full(T - fill, self._pad, dtype=np.int32))
            self._spans.append(DocSpan(PAD_SOURCE, "", -1, fill, T, 0))
            self.padding += T - fill
        self.tokens += T
        self._sequences += 1
        state = None
        if self._sequences % self._state_every == 0:
            state = StreamState(tuple(self._positions), self._docs, 0, self._sequences)
        fields = {}
        for name in {TARGET_MASK.name, *self._laid}:  # padding never trains: every row has a target mask
            values = self._fields[name].row(T, fill)
            for start, laid in self._laid.get(name, ()):
                values[start:start + len(laid)] = laid
            fields[name] = values
        row = PackedSequence(np.concatenate(self._tokens).astype(np.int32, copy=False), self._spans, state,
                             fields=fields, media=self._media, skipped=tuple(self._skipped))
        self._tokens, self._spans, self._fill, self._laid, self._media = [], [], 0, {}, {}
        self._skipped = []
        return row
