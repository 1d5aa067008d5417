"""What the trainer receives: one rank's rows of one global batch, with provenance and state.

Global batch ``k`` is the next ``G/S`` sequences of every stream in stream order; this rank
holds the rows of its streams. ``sequence_index`` gives each row's place in the global batch,
so per-row digests gathered from all ranks hash the same for any world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np
import torch

from data.fields import TARGET_MASK, DocField
from data.hashing import sequence_digest

IGNORE_INDEX = -100
"""Label value of positions that carry no loss."""


@dataclass(frozen=True, slots=True)
class DocSpan:
    """One document's tokens inside a packed sequence."""

    source: str
    """Source name (data.sources[i].name, or its path)."""
    shard: str
    """Shard file the document came from."""
    record: int
    """Record index within the shard (0-based line or row)."""
    start: int
    """First position of the span in the packed sequence."""
    end: int
    """One past the last position of the span (the span is [start, end))."""
    doc_offset: int
    """Offset of the span's first token within the document's tokens (documents split across sequences)."""


@dataclass
class Batch:
    """One rank's share of global batch ``step``."""

    step: int
    """1-based global batch index."""
    input_ids: torch.Tensor
    """(B, T) int64 token ids; B = global_batch_size // world_size."""
    labels: torch.Tensor
    """(B, T) int64 next-token targets within a document, IGNORE_INDEX elsewhere."""
    position_ids: torch.Tensor
    """(B, T) int64 positions, reset to 0 where each document span starts."""
    document_ids: torch.Tensor
    """(B, T) int64 document number within each row (0, 1, 2, ... left to right)."""
    sequence_index: list[int]
    """Global row index of each row within the global batch."""
    provenance: list[list[DocSpan]]
    """The document spans of each row."""
    state: dict
    """This rank's stream states after this batch ({"version", "streams"})."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """Further per-row tensors, (B, ...) each: the document fields of the rows (data/fields.py; e.g.
    ``target_mask`` (B, T) bool, which tokens are training targets); objectives add theirs (e.g.
    reference log-probs). They move to the device with the batch (``placed``) and are covered by
    the batch hash (``row_digests``)."""
    media: dict[str, list[list[torch.Tensor]]] = field(default_factory=dict)
    """Ragged data by field name (data/fields.py ``Pack.RAGGED``): per row, the items of its documents
    in document order, each a tensor of its own shape (a row may have none). Sliced by row with the
    batch, moved to the device (``placed``), and in the batch hash (``row_digests``)."""
    evaluation: bool = False
    """A held-out batch of the trainer's evaluation (``for_evaluation``): an objective scores it
    instead of preparing it for an update. Set by the caller, never inferred."""
    prepared: object | None = None
    """What an objective's ``prepare`` computed beyond per-row tensors, for its ledger fields (GRPO:
    the rollouts' ``Experience``). Read only; micro-batches share it; not moved by ``placed``, not
    in the batch hash."""

    def num_target_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def row_digests(self) -> list[tuple[int, bytes]]:
        """(global row index, digest) of each row: its token ids, then its extras by name, then its
        media items by field name and order (a row without media items digests as its ids and extras)."""
        extras = sorted(self.extras.items())
        media = sorted(self.media.items())
        return [
            (index, sequence_digest(self.input_ids[r], [(name, value[r]) for name, value in extras]
                                    + [(f"media:{name}[{i}]", item) for name, rows in media
                                       for i, item in enumerate(rows[r])]))
            for r, index in enumerate(self.sequence_index)
        ]

    def placed(self, place) -> "Batch":
        """The batch with its tensors (extras included) moved by ``place`` (e.g. to the device)."""
        return replace(
            self,
            input_ids=place(self.input_ids),
            labels=place(self.labels),
            position_ids=place(self.position_ids),
            document_ids=place(self.document_ids),
            extras={k: place(v) for k, v in self.extras.items()},
            media={k: [[place(item) for item in row] for row in rows] for k, rows in self.media.items()},
        )

    def for_evaluation(self) -> "Batch":
        """The batch marked as held out (``evaluation``)."""
        return replace(self, evaluation=True)

    def with_extras(self, **extras: torch.Tensor) -> "Batch":
        return replace(self, extras={**self.extras, **extras})

    def micro_batches(self, size: int) -> list["Batch"]:
        """Row slices of at most ``size`` rows; each keeps the step and the state."""
        if size <= 0:
            raise ValueError(f"micro batch size must be > 0, got {size}")
        rows = self.input_ids.shape[0]
        return [self._rows(i, min(i + size, rows)) for i in range(0, rows, size)]

    def select(self, rows: list[int]) -> "Batch":
        """The batch of rows ``rows`` (local indices, in that order); each keeps the step and the state."""
        index = torch.tensor(rows, dtype=torch.int64)
        return replace(
            self,
            input_ids=self.input_ids[index],
            labels=self.labels[index],
            position_ids=self.position_ids[index],
            document_ids=self.document_ids[index],
            sequence_index=[self.sequence_index[r] for r in rows],
            provenance=[self.provenance[r] for r in rows],
            extras={k: v[index] for k, v in self.extras.items()},
            media={k: [v[r] for r in rows] for k, v in self.media.items()},
        )

    def _rows(self, lo: int, hi: int) -> "Batch":
        return replace(
            self,
            input_ids=self.input_ids[lo:hi],
            labels=self.labels[lo:hi],
            position_ids=self.position_ids[lo:hi],
            document_ids=self.document_ids[lo:hi],
            sequence_index=self.sequence_index[lo:hi],
            provenance=self.provenance[lo:hi],
            extras={k: v[lo:hi] for k, v in self.extras.items()},
            media={k: v[lo:hi] for k, v in self.media.items()},
        )

    @classmethod
    def from_rows(
        cls,
        step: int,
        tokens: list[np.ndarray],
        spans: list[list[DocSpan]],
        sequence_index: list[int],
        state: dict,
        fields: Mapping[DocField, Sequence[np.ndarray]] | None = None,
        *,
        media: Mapping[str, Sequence[Sequence[np.ndarray]]] | None = None,
    ) -> "Batch":
        """Build the tensors from packed rows and their document spans (spans cover each row).

        ``fields``: per document field (data/fields.py), its (T,) values of each row; each travels as
        an extra of its name (B, T) in its dtype, with the extras its ``finish`` derives (preference
        roles add ``pair_index``). The target mask (``TARGET_MASK``) also masks labels: a position
        whose next token is not a target gets no label. ``media``: per ragged field, the items of
        each row (``Batch.media``)."""
        input_ids = np.stack(tokens).astype(np.int64)  # (B, T)
        rows, width = input_ids.shape
        starts = np.array([r * width + sp.start for r, row in enumerate(spans) for sp in row], dtype=np.int64)
        ends = np.array([r * width + sp.end for r, row in enumerate(spans) for sp in row], dtype=np.int64)
        first_span = np.cumsum([0] + [len(row) for row in spans[:-1]])  # (B,) index of each row's first span
        mark = np.zeros(rows * width, dtype=np.int64)
        mark[starts] = 1
        span_of = np.cumsum(mark) - 1  # (B*T,) which span each position is in
        position_ids = (np.arange(rows * width) - starts[span_of]).reshape(rows, width)
        document_ids = span_of.reshape(rows, width) - first_span[:, None]
        # Each token predicts the next one of the same span; a span's last position (its EOS,
        # or where the document continues in another row) has no target.
        labels = np.empty(rows * width, dtype=np.int64)
        labels[:-1] = input_ids.reshape(-1)[1:]
        labels[ends - 1] = IGNORE_INDEX
        extras = {}
        for spec, values in (fields or {}).items():
            stacked = np.stack(values).astype(spec.dtype)  # (B, T)
            if spec.name == TARGET_MASK.name:
                labels[:-1][~stacked.reshape(-1)[1:]] = IGNORE_INDEX
            extras[spec.name] = torch.from_numpy(stacked)
            if spec.finish is not None:
                extras.update({name: torch.from_numpy(value) for name, value in spec.finish(stacked, position_ids).items()})
        labels = labels.reshape(rows, width)
        return cls(
            step=step,
            input_ids=torch.from_numpy(input_ids),
            labels=torch.from_numpy(labels),
            position_ids=torch.from_numpy(position_ids),
            document_ids=torch.from_numpy(document_ids),
            sequence_index=list(sequence_index),
            provenance=[list(s) for s in spans],
            state=state,
            extras=extras,
            media={name: [[torch.from_numpy(np.asarray(item)) for item in row] for row in per_row]
                   for name, per_row in (media or {}).items()},
        )


def prompt_and_answer(batch: Batch, row: int) -> tuple[list[int], list[int]]:
    """A prompt record's row split by its target mask: the prompt ids (untrained) and the answer
    ids (trained, without the final separator). Used by rollouts and generation evaluations."""
    span = batch.provenance[row][0]
    ids = batch.input_ids[row, span.start:span.end].tolist()
    mask = batch.extras["target_mask"][row, span.start:span.end].tolist()
    prompt = [t for t, m in zip(ids, mask) if not m]
    answer = [t for t, m in zip(ids[:-1], mask[:-1]) if m]  # the last token is the separator
    return prompt, answer

