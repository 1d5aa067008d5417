"""Document fields: named data a document carries beside its tokens, and how each one packs.

A record kind (data/record_kinds.py) declares the fields its documents carry; its encoder
returns their values by name (``Encoded.fields``). The packers and the batch stage carry every
declared field without knowing what it means, by its ``Pack``:

- ``TOKENS``: one value per token, aligned with the document's tokens (a target mask, a
  per-token role). A separator takes the value of the token before it; tokens of documents
  without the field take ``missing``, padding takes ``pad``. In the batch: a (B, T) extra.
- ``DOCUMENT``: one scalar per document (a preference pair's margin), laid over the
  document's tokens and separators, ``missing`` elsewhere, ``pad`` on padding. A (B, T) extra.
- ``RAGGED``: a list of arrays of any shape per document (image patches, a signal), kept whole
  whatever the packing does to the tokens. In the batch: ``Batch.media[name]``, per row the
  items of its documents in document order. A field declared ``whole_document`` (images, whose
  placeholder tokens a cut would split from them) keeps its documents whole too: never
  truncated, dropped and counted when longer than a row.

A row carries a ``TOKENS`` or ``DOCUMENT`` field when one of its documents does (rows of
whole documents always carry the target mask: padding never trains); a batch carries it when
one of its rows does, the other rows filled with ``missing``. A field may add extras derived
from its (B, T) values and the rows' positions (``finish``: the pair index of pair roles).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np


class Pack(enum.Enum):
    """How a field's values travel through packing and batching (module docstring)."""

    TOKENS = "tokens"
    DOCUMENT = "document"
    RAGGED = "ragged"


@dataclass(frozen=True)
class DocField:
    """One named field of a document, declared by the record kinds that carry it."""

    name: str
    """Its key in ``Encoded.fields``, and its name in ``Batch.extras`` (or ``Batch.media``)."""
    pack: Pack
    """Per token, per document, or ragged (module docstring)."""
    dtype: str = "float32"
    """numpy dtype of its values in the batch (``TOKENS`` and ``DOCUMENT``; ragged items keep theirs)."""
    missing: float = 0
    """Value on the tokens of documents (and rows) that do not carry it."""
    pad: float = 0
    """Value on the padding of a row of whole documents."""
    finish: Optional[Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]] = None
    """Given its (B, T) values and the (B, T) position ids, further (B, T) extras derived from them."""
    whole_document: bool = False
    """``RAGGED``: its items belong to tokens of their document (an image to its placeholders), so a
    document carrying any is never truncated: one longer than data.seq_len is dropped and counted,
    whatever data.overlong says."""

    def row(self, width: int, fill: int) -> np.ndarray:
        """A row of ``width`` with ``missing`` over the first ``fill`` positions and ``pad`` after."""
        out = np.full(width, self.pad, dtype=self.dtype)
        out[:fill] = self.missing
        return out

    def on_document(self, value, length: int, separators: int = 1) -> np.ndarray:
        """The field over one laid-out document: its ``length`` tokens and the separator after it."""
        if self.pack is Pack.DOCUMENT:
            return np.full(length + separators, value, dtype=self.dtype)
        values = np.asarray(value, dtype=self.dtype)
        return np.concatenate([values, values[-1:]])


TARGET_MASK = DocField("target_mask", Pack.TOKENS, dtype="bool", missing=True, pad=False)
"""Which tokens are training targets: a position whose next token is not one gets no label
(``Batch.from_rows``). Rows of whole documents always carry it; documents without it train
every token."""
