"""Worker processes (data/pipeline/procpool.py): results, a dead child, clean shutdown."""

from __future__ import annotations

import os
import signal

import pytest

from core.exceptions import DataError
from data.pipeline.items import Chunk, Doc
from data.pipeline.procpool import ProcessPool
from data.pipeline.stages import DecodeStage
from data.state import Position
from tests.data.children import worker_children


def _chunk(text: bytes) -> Chunk:
    return Chunk(0, 0, [Doc(0, 0, "f", 0, "json", Position(), Position(), text)])


def test_a_child_applies_the_stage_and_close_reaps_it():
    pool = ProcessPool(2, {"decode": DecodeStage(["text"])})
    try:
        assert pool.run("decode", _chunk(b'{"text": "hi"}')).docs[0].payload == "hi"
        assert {c.pid for c in worker_children()} == set(pool.pids())
    finally:
        pool.close()
    assert worker_children() == []


def test_a_dead_child_is_a_data_error_not_a_hang():
    pool = ProcessPool(1, {"decode": DecodeStage(["text"])})
    try:
        os.kill(pool.pids()[0], signal.SIGKILL)
        with pytest.raises(DataError, match="worker process died"):
            pool.run("decode", _chunk(b'{"text": "hi"}'))
    finally:
        pool.close()
    assert worker_children() == []
