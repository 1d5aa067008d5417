"""The reference log-prob cache (training/objectives/reference_cache.py): exact round trip,
another fingerprint refused, a torn last line ignored, a pair stored once."""

from __future__ import annotations

import numpy as np
import pytest

from core.exceptions import CheckpointError
from training.objectives.reference_cache import ReferenceCache, fingerprint


def test_values_come_back_bit_for_bit_across_writers(tmp_path):
    values = np.float32([-12.345678, -0.1, -1234.5]).tolist()
    ReferenceCache(tmp_path, "fp", rank=0, world_size=2).store([("a", values[0], values[1])])
    ReferenceCache(tmp_path, "fp", rank=1, world_size=2).store([("b", values[2], values[0])])
    cache = ReferenceCache(tmp_path, "fp", rank=0, world_size=1)  # a resume on another world size
    assert cache.lookup(["a", "b"]) == [(values[0], values[1]), (values[2], values[0])]
    assert cache.lookup(["a", "c"]) is None and cache.misses == 1


def test_another_fingerprint_is_refused(tmp_path):
    ReferenceCache(tmp_path, fingerprint({"seq_len": 256}), rank=0, world_size=1).store([("a", -1.0, -2.0)])
    with pytest.raises(CheckpointError, match="fingerprint"):
        ReferenceCache(tmp_path, fingerprint({"seq_len": 128}), rank=0, world_size=1)


def test_a_torn_line_is_ignored_and_a_repeated_pair_is_stored_once(tmp_path):
    cache = ReferenceCache(tmp_path, "fp", rank=0, world_size=1)
    cache.store([("a", -1.0, -2.0), ("a", -1.0, -2.0), ("b", -3.0, -4.0)])
    path = next(tmp_path.glob("entries-*.jsonl"))
    assert len(path.read_text().splitlines()) == 3  # header + a + b
    path.write_text(path.read_text() + '["c", "-0x1.0p+0"')  # killed mid-write
    reopened = ReferenceCache(tmp_path, "fp", rank=0, world_size=1)
    assert reopened.get("c") is None and reopened.get("b") == (-3.0, -4.0)
    reopened.store([("c", -5.0, -6.0)])
    assert ReferenceCache(tmp_path, "fp", rank=0, world_size=1).get("c") == (-5.0, -6.0)
