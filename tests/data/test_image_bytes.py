"""Images carried in Parquet records (data/kinds/image_chat.py): ``images`` as binary items or Hugging Face
datasets' Image structs ``{"bytes", "path"}`` instead of paths.

A Parquet shard of either form, read by the source format, encodes as the same records with paths bit for
bit (ids, target mask, patches and grids: what the batches and row digests carry); an image's sha256 is its
file's; empty or corrupt bytes are a RecordError naming the image's index and size, which stops the pipeline
naming the shard and the record."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.config_sections import DataConfig, SourceConfig
from core.exceptions import DataError
from data.chat_template import RecordError
from data.pipeline import build
from data.record_kinds import record_kind
from data.sources.parquet import ParquetFormat
from tests.data.image_cases import SMALL, encoder_of, write_images_root

PHOTOS = ("chelsea.png", "coffee.png", "rocket.jpg")


@pytest.fixture(scope="module")
def images_root(tmp_path_factory) -> Path:
    pytest.importorskip("skimage", reason="pip install scikit-image (requirements-dev.txt)")
    return write_images_root(tmp_path_factory.mktemp("images"), chat=False)


def _messages(k: int) -> list[dict]:
    return [{"role": "user", "content": f"<image>What is picture {k}?"}, {"role": "assistant", "content": f"It {k}."}]


def _shard(root: Path, name: str, images: list) -> Path:
    """A Parquet shard under ``root/records`` whose k-th row shows ``images[k]`` (one item: a path relative to
    the shard, bytes, or an Image struct)."""
    (root / "records").mkdir(exist_ok=True)
    path = root / "records" / name
    table = pa.table({"messages": [_messages(k) for k in range(len(images))], "images": [[i] for i in images]})
    pq.write_table(table, path, row_group_size=4)
    return path


def _encoded(encoder, shard: Path) -> list:
    """Each record of a Parquet shard, as the source format reads it (data/sources/parquet.py), encoded."""
    parquet = ParquetFormat("text", record_kind("image_chat").columns)
    records = [raw.payload for unit in parquet.units(str(shard), shard.name) for raw in parquet.read(unit, 0, None)]
    return [encoder.document(record, str(shard)) for record in records]


def test_bytes_and_image_structs_encode_as_paths(images_root):
    encoder = encoder_of(images_root, "image_chat")
    photos = [images_root / "photographs" / name for name in PHOTOS]
    by_path = _encoded(encoder, _shard(images_root, "paths.parquet", [f"../photographs/{p.name}" for p in photos]))
    raw = [p.read_bytes() for p in photos]
    structs = [{"bytes": data, "path": p.name} for data, p in zip(raw, photos)]
    for name, images in (("bytes.parquet", raw), ("structs.parquet", structs)):
        for ours, theirs in zip(_encoded(encoder, _shard(images_root, name, images)), by_path, strict=True):
            assert (ours.ids == theirs.ids).all() and ours.fields.keys() == theirs.fields.keys()
            assert (ours.fields["target_mask"] == theirs.fields["target_mask"]).all()
            assert all((a == b).all() for key in ("pixel_values", "image_grid_thw")
                       for a, b in zip(ours.fields[key], theirs.fields[key], strict=True))


def test_an_images_sha256_is_its_files_and_a_struct_without_bytes_reads_its_path(images_root):
    encoder = encoder_of(images_root, "image_chat")
    shard = str(images_root / "records" / "any.parquet")
    photo = images_root / "photographs" / "chelsea.png"
    digest = hashlib.sha256(photo.read_bytes()).hexdigest()
    from_bytes = encoder._shown({"images": [photo.read_bytes()]}, _messages(0), shard, "record")[0][0]
    from_path = encoder._shown({"images": [{"bytes": None, "path": "../photographs/chelsea.png"}]}, _messages(0),
                               shard, "record")[0][0]
    assert from_bytes.sha256 == from_path.sha256 == digest
    assert (from_bytes.pixel_values == from_path.pixel_values).all()


@pytest.mark.parametrize("image, words", [
    (b"", "images[0] holds 0 bytes"),
    (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "images[0] (48 bytes in the record)"),
    ({"bytes": None, "path": None}, "must be a non-empty path string or an image's bytes, got a NoneType"),
])
def test_bad_bytes_are_a_record_error_naming_the_image(images_root, image, words):
    encoder = encoder_of(images_root, "image_chat")
    with pytest.raises(RecordError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        encoder.document({"messages": _messages(0), "images": [image]}, str(images_root / "records" / "x.parquet"))


def test_a_bad_image_in_a_parquet_shard_stops_the_pipeline_naming_the_file_and_record(images_root):
    good = (images_root / "photographs" / "chelsea.png").read_bytes()
    shard = _shard(images_root, "bad.parquet", [good, good, good[:200], good])
    config = DataConfig(sources=(SourceConfig(path=str(shard), name="images", record="image_chat"),),
                        tokenizer=str(images_root / "tokenizer"), seq_len=64, num_streams=1, workers=1,
                        process_pool=False, prefetch_batches=1, images=SMALL)
    with pytest.raises(DataError) as error:
        with build(config, seed=0, global_batch_size=2, rank=0, world_size=1) as pipe:
            next(pipe)
    assert error.value.context["file"] == str(shard) and error.value.context["record"] == 3
    assert "images[0] (200 bytes in the record)" in str(error.value)
