"""The batch stage: the next G/S sequences of each stream this rank runs -> one Batch."""

from __future__ import annotations

from data.batch import Batch
from data.fields import TARGET_MASK, DocField
from data.pipeline.packing import PackedSequence
from data.state import StreamState, state_dict


class BatchAssembler:
    """Turns per-stream sequences into this rank's rows of a global batch.

    A batch carries each document field one of its rows carries; rows without it are filled
    with the field's ``missing`` value (data/fields.py). Ragged items go to ``Batch.media``."""

    def __init__(self, owned: list[int], rows_per_stream: int, compat: dict,
                 fields: dict[str, DocField] | None = None) -> None:
        self.owned = owned
        self.rows_per_stream = rows_per_stream
        self._compat = compat
        self._fields = {TARGET_MASK.name: TARGET_MASK, **(fields or {})}

    def assemble(self, step: int, sequences: dict[int, list[PackedSequence]]) -> Batch:
        tokens, spans, index, rows = [], [], [], []
        states: dict[int, StreamState] = {}
        for s in self.owned:
            stream_rows = sequences[s]
            assert len(stream_rows) == self.rows_per_stream
            for j, seq in enumerate(stream_rows):
                tokens.append(seq.tokens)
                spans.append(seq.spans)
                rows.append(seq)
                index.append(s * self.rows_per_stream + j)
            states[s] = stream_rows[-1].state
        carried = sorted({name for seq in rows for name in seq.fields})
        fields = {self._fields[name]: [seq.fields[name] if name in seq.fields
                                       else self._fields[name].row(len(seq.tokens), len(seq.tokens)) for seq in rows]
                  for name in carried}
        ragged = sorted({name for seq in rows for name in seq.media})
        media = {name: [seq.media.get(name, []) for seq in rows] for name in ragged}
        return Batch.from_rows(step, tokens, spans, index, state_dict(states, self._compat), fields or None,
                               media=media or None)
