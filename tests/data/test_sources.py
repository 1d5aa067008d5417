"""Sources: units with stable IDs, reading from any position, every format, bad paths."""

from __future__ import annotations

import json

import pytest
import zstandard

from core.config import SourceConfig
from core.exceptions import DataError
from data.sources import Source
from data.sources.zstd import read_frame_index
from tests.data.corpus import doc_text, write_jsonl, write_parquet, write_zst


def _records(source: Source) -> list[tuple[str, int, object]]:
    return [(u.shard_id, r.record, r.payload) for u in source.units() for r in source.read(u, 0, None)]


def _read_from(source: Source, unit, record, seek):
    return [(r.record, r.payload) for r in source.read(unit, record, seek)]


def test_indexed_zst_has_a_unit_per_frame_and_resumes_inside_a_frame(tmp_path):
    write_zst(tmp_path, shards=1, docs=10, frame=4)
    source = Source(SourceConfig(path=str(tmp_path)), label="s")
    units = source.units()
    assert [(u.block, u.first_record, u.num_records) for u in units] == [(0, 0, 4), (1, 4, 4), (2, 8, 2)]
    assert units[1].id == "part-000.jsonl.zst#1"
    records = [(r.record, json.loads(r.payload)["text"]) for r in source.read(units[1], 2, None)]
    assert records == [(6, doc_text(0, 6)), (7, doc_text(0, 7))]


def test_zst_without_index_is_one_unit_streamed_across_frames(tmp_path):
    lines = [json.dumps({"text": f"t{i}"}).encode() for i in range(7)]
    c = zstandard.ZstdCompressor()
    data = c.compress(b"\n".join(lines[:3]) + b"\n") + c.compress(b"\n".join(lines[3:]) + b"\n")
    (tmp_path / "plain.jsonl.zst").write_bytes(data)
    source = Source(SourceConfig(path=str(tmp_path / "plain.jsonl.zst")), label="s")
    (unit,) = source.units()
    assert read_frame_index(unit.shard) is None and unit.num_records is None
    assert [r.payload for r in source.read(unit, 0, None)] == lines
    assert [r.record for r in source.read(unit, 5, None)] == [5, 6]


def test_parquet_units_are_row_groups_and_read_only_the_text_column(tmp_path):
    write_parquet(tmp_path, shards=1, docs=10, row_group=4, start=7)
    source = Source(SourceConfig(path=str(tmp_path), text_column="body"), label="s")
    units = source.units()
    assert [(u.block, u.first_record, u.num_records) for u in units] == [(0, 0, 4), (1, 4, 4), (2, 8, 2)]
    assert _read_from(source, units[2], 1, None) == [(9, doc_text(7, 9))]


def test_parquet_without_the_text_column_is_refused_naming_the_file(tmp_path):
    write_parquet(tmp_path, shards=1, docs=3)
    with pytest.raises(DataError) as err:
        Source(SourceConfig(path=str(tmp_path)), label="data.sources[0]")
    assert "missing text column 'text'" in str(err.value)
    assert "part-100.parquet" in str(err.value) and "body" in str(err.value)


def test_jsonl_resumes_by_byte_offset_and_keeps_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [json.dumps({"text": f"d{i}"}) if i != 2 else "" for i in range(6)])
    source = Source(SourceConfig(path=str(path)), label="s")
    (unit,) = source.units()
    records = list(source.read(unit, 0, None))
    assert [r.record for r in records] == [0, 1, 3, 4, 5]  # the blank line 2 is not a record
    after_first = records[1]
    tail = [(r.record, r.payload) for r in source.read(unit, after_first.next_record, after_first.next_seek)]
    assert tail == [(r.record, r.payload) for r in records[2:]]
    # Without the byte offset, the same position is found by counting lines.
    assert _read_from(source, unit, after_first.next_record, None) == tail


def test_text_files_are_documents_or_lines(tmp_path):
    (tmp_path / "a.txt").write_text("first line\nsecond line\n")
    (tmp_path / "b.txt").write_text("")
    whole = Source(SourceConfig(path=str(tmp_path), format="text"), label="s")
    assert _records(whole) == [("a.txt", 0, b"first line\nsecond line\n")]
    lines = Source(SourceConfig(path=str(tmp_path), format="text", text_unit="line"), label="s")
    assert [p for _, _, p in _records(lines)] == [b"first line", b"second line"]


def test_globs_select_files_and_ids_are_relative_to_the_glob_root(tmp_path):
    write_zst(tmp_path / "d" / "x", shards=2, docs=4, frame=4)
    write_parquet(tmp_path / "d" / "x", shards=1, docs=4)
    source = Source(SourceConfig(path=str(tmp_path / "d" / "**" / "*.jsonl.zst")), label="s")
    assert [u.id for u in source.units()] == ["x/part-000.jsonl.zst#0", "x/part-001.jsonl.zst#0"]


def test_fingerprint_changes_when_shards_change(tmp_path):
    write_zst(tmp_path, shards=2, docs=4)
    before = Source(SourceConfig(path=str(tmp_path)), label="s").fingerprint()
    assert Source(SourceConfig(path=str(tmp_path)), label="s").fingerprint() == before
    write_zst(tmp_path, shards=1, docs=4, start=9)
    assert Source(SourceConfig(path=str(tmp_path)), label="s").fingerprint() != before


@pytest.mark.parametrize("path", ["missing-dir", "missing-dir/*.jsonl"])
def test_missing_path_is_a_data_error(tmp_path, path):
    with pytest.raises(DataError) as err:
        Source(SourceConfig(path=str(tmp_path / path)), label="data.sources[0]")
    assert err.value.exit_code == 3 and "missing-dir" in str(err.value)


def test_empty_source_is_a_data_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="has no records"):
        Source(SourceConfig(path=str(tmp_path)), label="data.sources[0]")


def test_corrupt_frame_names_file_frame_and_record(tmp_path):
    write_zst(tmp_path, shards=1, docs=8, frame=4)
    path = tmp_path / "part-000.jsonl.zst"
    offset, size, _, _ = read_frame_index(str(path))[1]
    data = bytearray(path.read_bytes())
    data[offset + size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    source = Source(SourceConfig(path=str(path)), label="s")
    assert len(list(source.read(source.units()[0], 0, None))) == 4  # frame 0 is intact
    with pytest.raises(DataError) as err:
        list(source.read(source.units()[1], 0, None))
    assert "corrupt zstd frame 1" in err.value.message
    assert err.value.context["file"] == str(path) and err.value.context["record"] == 4
