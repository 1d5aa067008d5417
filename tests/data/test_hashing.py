"""The ledger's hashes, computed by their definitions."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import numpy as np
import torch

from data.hashing import batch_hash, sequence_digest, state_hash


def test_sequence_digest_is_sha256_of_little_endian_int32():
    row = [1, 256, 70000, -100]
    expected = hashlib.sha256(struct.pack("<4i", *row)).digest()
    assert sequence_digest(torch.tensor(row, dtype=torch.int64)) == expected
    assert sequence_digest(np.array(row, dtype=np.int64)) == expected


def test_batch_hash_concatenates_digests_in_order():
    a, b = sequence_digest([1, 2]), sequence_digest([3])
    assert batch_hash([a, b]) == hashlib.sha256(a + b).hexdigest() != batch_hash([b, a])


def test_state_hash_is_over_canonical_json():
    assert state_hash({"b": 1, "a": [1, 2]}) == hashlib.sha256(b'{"a":[1,2],"b":1}').hexdigest()
    assert state_hash({"a": [1, 2], "b": 1}) == state_hash({"b": 1, "a": [1, 2]})


def test_the_evaluation_mark_and_the_prepared_value_travel_outside_the_batch_hash():
    """``Batch.evaluation`` and ``Batch.prepared`` ride along with every micro-batch and placement,
    and change no row digest (the ledger's batch_hash is over ids and extras only)."""
    from data.batch import Batch, DocSpan

    spans = [[DocSpan("s", "f", r, 0, 4, 0)] for r in range(4)]
    batch = Batch.from_rows(1, [np.arange(4) + r for r in range(4)], spans, [0, 1, 2, 3], state={})
    marked = dataclasses.replace(batch.for_evaluation(), prepared={"rollouts": [1, 2]})
    assert marked.row_digests() == batch.row_digests()
    assert not batch.evaluation and batch.prepared is None  # for_evaluation is a copy
    for part in [*marked.micro_batches(3), marked.placed(lambda t: t.clone())]:
        assert part.evaluation and part.prepared is marked.prepared
