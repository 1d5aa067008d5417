"""Hashes the ledger records: per-sequence digests, the global batch hash, the state hash.

The trainer gathers ``(sequence_index, sequence_digest)`` from every rank and calls
``batch_hash`` in global order, so the value does not depend on the world size;
``python -m data inspect`` computes the same value on one process.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np


def sequence_digest(input_ids_row: Any, extras: list[tuple[str, Any]] = ()) -> bytes:
    """sha256 over the row's token ids as little-endian int32 bytes, then each extra's name,
    dtype, shape and little-endian bytes (a row without extras hashes as its ids alone)."""
    row = _array(input_ids_row)
    if row.ndim != 1:
        raise ValueError(f"sequence_digest expects one row, got shape {row.shape}")
    h = hashlib.sha256(row.astype("<i4", copy=False).tobytes())
    for name, value in extras:
        value = _array(value)
        little = value.astype(value.dtype.newbyteorder("<"), copy=False)
        h.update(f"|{name}|{value.dtype.str}|{value.shape}|".encode())
        h.update(little.tobytes())
    return h.digest()


def _array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor; avoid importing torch here
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def batch_hash(digests_in_global_order: list[bytes]) -> str:
    """sha256 hex over the concatenated per-sequence digests."""
    h = hashlib.sha256()
    for digest in digests_in_global_order:
        h.update(digest)
    return h.hexdigest()


def state_hash(global_state: dict) -> str:
    """sha256 hex over the canonical JSON (sorted keys, no spaces) of the data state."""
    text = json.dumps(global_state, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
