"""A cut-off .jsonl.zst is reported as truncated (DataError naming file and byte offset),
never as a bad last record or an empty file, and never skipped by on_bad_record=skip."""

from __future__ import annotations

import json

import pytest

from core.config import DataConfig, SourceConfig
from core.exceptions import DataError
from data.pipeline import build
from data.sources.zstd import TruncatedShardError, ZstdJsonlFormat, write_indexed_jsonl_zst

RECORDS = 2000


def _shard(tmp_path, keep: float):
    path = tmp_path / "data.jsonl.zst"
    lines = (json.dumps({"text": f"document {i} " + "x" * (i % 50)}).encode() for i in range(RECORDS))
    write_indexed_jsonl_zst(path, lines, frame_records=100)
    data = path.read_bytes()
    cut = int(len(data) * keep)
    path.write_bytes(data[:cut])
    return path, cut


def _read_all(path):
    fmt = ZstdJsonlFormat()
    return [r for unit in fmt.units(str(path), "s0") for r in fmt.read(unit, 0, None)]


@pytest.mark.parametrize("keep", [0.63, 0.01])  # mid-file; inside the first frame
def test_truncation_names_the_file_and_the_byte_offset(tmp_path, keep):
    path, cut = _shard(tmp_path, keep)
    with pytest.raises(TruncatedShardError) as info:
        _read_all(path)
    assert info.value.context["file"] == str(path) and f"cut off at byte {cut}" in info.value.message
    assert "truncated" in info.value.message and info.value.exit_code == 3
    assert not info.value.skippable


def test_an_intact_shard_reads_every_record_and_an_unindexed_one_too(tmp_path):
    path, _ = _shard(tmp_path, 1.0)
    assert len(_read_all(path)) == RECORDS
    # Without its index (a plain multi-frame file) the file is streamed; still complete.
    from data.sources.zstd import read_frame_index

    frames = read_frame_index(str(path))
    end = frames[-1][0] + frames[-1][1]
    path.write_bytes(path.read_bytes()[:end])
    assert len(_read_all(path)) == RECORDS


def test_skip_mode_does_not_skip_a_truncated_file(tmp_path):
    path, _ = _shard(tmp_path, 0.63)
    config = DataConfig(sources=(SourceConfig(path=str(path)),), seq_len=32, num_streams=1, workers=1,
                        process_pool=False, on_bad_record="skip")
    with pytest.raises(DataError, match="truncated") as info:
        with build(config, seed=0, global_batch_size=8, rank=0, world_size=1) as pipe:
            for _ in range(10_000):
                next(pipe)
    assert info.value.context["file"] == str(path)


@pytest.mark.parametrize("cut", [12, 200])  # inside the frame header; inside the first block
@pytest.mark.parametrize("indexed", [True, False])
def test_a_file_cut_inside_its_first_block_is_reported_truncated_not_empty(tmp_path, cut, indexed):
    path = tmp_path / "data.jsonl.zst"
    lines = [json.dumps({"text": f"document {i} " + "x" * (i % 50)}).encode() for i in range(RECORDS)]
    if indexed:
        write_indexed_jsonl_zst(path, lines, frame_records=100)
    else:  # one frame, as the zstd command line writes it
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(b"\n".join(lines) + b"\n"))
    path.write_bytes(path.read_bytes()[:cut])
    config = DataConfig(sources=(SourceConfig(path=str(path)),), seq_len=32, num_streams=1, workers=1,
                        process_pool=False)
    with pytest.raises(DataError) as info:
        with build(config, seed=0, global_batch_size=8, rank=0, world_size=1) as pipe:
            next(pipe)
    assert "truncated zstd file" in info.value.message and "no records" not in info.value.message
    assert info.value.context["file"] == str(path) and f"cut off at byte {cut}" in info.value.message
