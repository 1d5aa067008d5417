"""The batch stage: the next G/S sequences of each stream this rank runs -> one Batch."""

from __future__ import annotations

import numpy as np

from data.batch import Batch
from data.pipeline.packing import PackedSequence
from data.state import StreamState, state_dict


class BatchAssembler:
    """Turns per-stream sequences into this rank's rows of a global batch."""

    def __init__(self, owned: list[int], rows_per_stream: int, compat: dict) -> None:
        self.owned = owned
        self.rows_per_stream = rows_per_stream
        self._compat = compat

    def assemble(self, step: int, sequences: dict[int, list[PackedSequence]]) -> Batch:
        tokens, spans, index, masks, roles, margins = [], [], [], [], [], []
        states: dict[int, StreamState] = {}
        for s in self.owned:
            rows = sequences[s]
            assert len(rows) == self.rows_per_stream
            for j, seq in enumerate(rows):
                tokens.append(seq.tokens)
                masks.append(seq.mask)
                roles.append(seq.roles)
                margins.append(seq.margins)
                spans.append(seq.spans)
                index.append(s * self.rows_per_stream + j)
            states[s] = rows[-1].state
        has_masks = any(m is not None for m in masks)
        if has_masks:
            masks = [m if m is not None else np.ones(len(t), dtype=bool) for m, t in zip(masks, tokens)]
        if any(r is not None for r in roles):  # preference pairs (data/preference.py)
            roles = [r if r is not None else np.zeros(len(t), dtype=np.int8) for r, t in zip(roles, tokens)]
        else:
            roles = None
        if any(m is not None for m in margins):  # pairs whose margins are read
            margins = [m if m is not None else np.zeros(len(t), dtype=np.float32) for m, t in zip(margins, tokens)]
        else:
            margins = None
        return Batch.from_rows(step, tokens, spans, index, state_dict(states, self._compat),
                               masks if has_masks else None, roles=roles, margins=margins)
