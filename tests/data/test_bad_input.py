"""Bad input: a DataError (exit 3) naming file and record, or skipped and counted."""

from __future__ import annotations

import json

import pytest

from core.config import DataConfig, SourceConfig
from core.exceptions import DataError
from data.pipeline import build
from data.sources.zstd import read_frame_index, write_indexed_jsonl_zst
from tests.data.corpus import data_threads, write_parquet


def _good(i: int) -> bytes:
    return json.dumps({"text": f"document number {i} " * 3}).encode()


def _config(path, **kw) -> DataConfig:
    source = SourceConfig(path=str(path), **{k: kw.pop(k) for k in ("text_column",) if k in kw})
    return DataConfig(sources=(source,), seq_len=32, num_streams=2, workers=2, process_pool=False, **kw)


def _drain(config: DataConfig, batches: int = 40):
    with build(config, seed=0, global_batch_size=2, rank=0, world_size=1) as pipe:
        for _ in range(batches):
            next(pipe)
        return pipe.stats()


def _jsonl_with(tmp_path, bad: bytes, at: int = 3):
    lines = [_good(i) for i in range(8)]
    lines[at] = bad
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _corrupt_zst(tmp_path):
    path = tmp_path / "data.jsonl.zst"
    write_indexed_jsonl_zst(path, [_good(i) for i in range(16)], frame_records=4)
    offset, size, _, _ = read_frame_index(str(path))[2]
    data = bytearray(path.read_bytes())
    data[offset + size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("make,record,message", [
    (lambda p: _jsonl_with(p, b'{"text": "unterminated'), 4, "invalid JSON line"),  # line 4 (counted from 1)
    (lambda p: _jsonl_with(p, b'{"text": "caf\xe9 au lait"}'), 4, "invalid UTF-8"),
    (lambda p: _jsonl_with(p, b'{"title": "no text here"}', at=5), 6, "no text key 'text'"),
    (_corrupt_zst, 9, "corrupt zstd frame 2"),  # the frame's first record, line 9
])
def test_bad_record_stops_with_file_and_record(tmp_path, make, record, message):
    path = make(tmp_path)
    before = data_threads()
    with pytest.raises(DataError) as err:
        _drain(_config(path))
    assert err.value.exit_code == 3
    assert message in err.value.message
    assert err.value.context["file"] == str(path) and err.value.context["record"] == record
    assert "on_bad_record" in str(err.value)
    assert data_threads() == before


@pytest.mark.parametrize("make", [
    lambda p: _jsonl_with(p, b'{"text": "unterminated'),
    lambda p: _jsonl_with(p, b'{"text": "caf\xe9 au lait"}'),
    _corrupt_zst,
])
def test_bad_records_are_skipped_and_counted_when_asked(tmp_path, make):
    stats = _drain(_config(make(tmp_path), on_bad_record="skip"))
    assert stats["bad_records_skipped"] > 0 and stats["error"] is None


def test_missing_path_is_refused_at_build(tmp_path):
    with pytest.raises(DataError) as err:
        build(_config(tmp_path / "nope" / "*.jsonl"), seed=0, global_batch_size=2, rank=0, world_size=1)
    assert "nope" in str(err.value) and err.value.exit_code == 3


def test_empty_source_is_refused_at_build(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match="no records"):
        build(_config(tmp_path), seed=0, global_batch_size=2, rank=0, world_size=1)


def test_source_of_blank_lines_only_is_reported_not_looped_on(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n\n\n")
    with pytest.raises(DataError, match="yields no records"):
        _drain(_config(tmp_path), batches=1)


def test_missing_text_column_is_refused_at_build(tmp_path):
    write_parquet(tmp_path, shards=1, docs=4)
    with pytest.raises(DataError) as err:
        build(_config(tmp_path, text_column="content"), seed=0, global_batch_size=2, rank=0, world_size=1)
    assert "missing text column 'content'" in str(err.value) and "part-100.parquet" in str(err.value)


# Inputs that would hang or exhaust the reader (issue 44): JSON nested 100k levels deep, an
# integer of 100k digits. Both are bad records like any other: an error naming file and record,
# or skipped and counted.
NESTED_100K = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
INTEGER_100K_DIGITS = b'{"text": "x", "n": ' + b"7" * 100_000 + b"}"


@pytest.mark.parametrize("bad,message", [(NESTED_100K, "nested deeper than"),
                                         (INTEGER_100K_DIGITS, "integer of more than")])
def test_json_nested_too_deep_or_a_huge_integer_names_file_and_record(tmp_path, bad, message):
    path = _jsonl_with(tmp_path, bad, at=4)
    with pytest.raises(DataError) as err:
        _drain(_config(path))
    assert message in err.value.message
    assert err.value.context["file"] == str(path) and err.value.context["record"] == 5  # line 5
    stats = _drain(_config(path, on_bad_record="skip"))
    assert stats["bad_records_skipped"] > 0 and stats["error"] is None


def test_a_source_whose_every_record_is_bad_is_reported_not_skipped_forever(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join([NESTED_100K, b'{"text": "unterminated']) + b"\n")
    with pytest.raises(DataError, match="has no usable record") as err:
        _drain(_config(path, on_bad_record="skip"), batches=1)
    assert "bad" in err.value.message and err.value.context["file"] == str(path)
