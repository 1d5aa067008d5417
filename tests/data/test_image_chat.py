"""The image_chat record kind (data/kinds/image_chat.py): images referenced from user turns, rendered
with the vision tokens, expanded from each image's grid, carried as Batch.media through the pipeline
into the qwen2_5_vl forward; bad records named by file and line; overlong conversations dropped."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import load
from core.config_sections import DataConfig, ImagesConfig, SourceConfig
from core.exceptions import ConfigError, DataError
from data.chat_template import ChatTemplate, RecordError
from data.kinds.image_chat import GRIDS, IMAGE_PAD, PIXELS, VISION_END, VISION_START
from data.pipeline import build
from data.record_kinds import EncoderSetup, record_kind
from data.tokenizers import ByteTokenizer
from data.vision.chat_data import TOKEN_IDS, conversations
from data.vision.images import load_image
from tests.data.image_cases import SMALL, encoder_of, write_images_root


@pytest.fixture(scope="module")
def images_root(tmp_path_factory) -> Path:
    """datasets/images as `python -m data prepare` writes it: photographs, chats, tokenizer."""
    pytest.importorskip("skimage", reason="pip install scikit-image (requirements-dev.txt)")
    return write_images_root(tmp_path_factory.mktemp("images"), chat=True)


@pytest.fixture(scope="module")
def encoder(images_root):
    return encoder_of(images_root, "image_chat")


def _shard(root: Path, records: list, name: str = "part-000.jsonl") -> Path:
    """A JSONL file beside the photographs' directory, its records' images as ``../photographs/<file>``."""
    directory = root / "records"
    directory.mkdir(exist_ok=True)
    path = directory / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _record(user: str, answer: str, *images: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
            "images": [f"../photographs/{name}" for name in images]}


def test_each_image_is_its_vision_tokens_with_one_pad_per_merged_patch(images_root, encoder):
    shard = _shard(images_root, [])
    record = _record("<image>and<image>: which?", "The cat.", "astronaut.png", "chelsea.png")
    encoded = encoder.document(record, shard=str(shard))
    ids, mask = encoded.ids, encoded.fields["target_mask"]
    start, pad, end = (encoder.vision[name] for name in (VISION_START, IMAGE_PAD, VISION_END))
    assert (start, end, pad) == (TOKEN_IDS["vision_start_token_id"], TOKEN_IDS["vision_end_token_id"],
                                 TOKEN_IDS["image_token_id"])
    expected = [load_image(images_root / "photographs" / f, encoder.processing) for f in ("astronaut.png", "chelsea.png")]
    assert [tuple(g.tolist()) for g in encoded.fields[GRIDS.name]] == [e.grid_thw for e in expected]
    assert all(np.array_equal(p, e.pixel_values) for p, e in zip(encoded.fields[PIXELS.name], expected))
    # the processor's expansion: image k's single pad becomes grid.prod() // merge**2 pads, between start and end
    runs = np.split(ids, np.flatnonzero(ids == start) + 1)[1:]
    assert [int((run[:np.argmax(run == end)] == pad).sum()) for run in runs] == [4, 2]
    assert [e.tokens for e in expected] == [4, 2] and all(int(np.prod(e.grid_thw)) // 4 == e.tokens for e in expected)
    text = ByteTokenizer().decode([int(i) if i < 256 else 0 for i in ids if i not in (start, pad, end)])
    assert "and" in text and ": which?" in text and "<image>" not in text
    # only the answer and its end of turn train; no vision token ever does, whatever data.loss_on says
    assert encoder.tokenizer.decode(ids[mask].tolist()) == "The cat.<|im_end|>"
    everything = record_kind("image_chat").encoder(EncoderSetup(encoder.template, encoder.tokenizer, "all",
                                                                frozenset(), SMALL))
    all_ids, all_mask = (lambda e: (e.ids, e.fields["target_mask"]))(everything.document(record, shard=str(shard)))
    assert np.array_equal(all_ids, ids)
    assert not all_mask[np.isin(all_ids, [start, pad, end])].any() and all_mask[~np.isin(all_ids, [start, pad, end])].all()


def test_a_record_without_images_is_a_plain_chat(images_root, encoder):
    encoded = encoder.document({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
                               shard=str(_shard(images_root, [])))
    assert set(encoded.fields) == {"target_mask"} and encoder.vision[IMAGE_PAD] not in encoded.ids


def _corrupt(root: Path) -> dict[str, str]:
    """Bad image files beside the photographs, by what is wrong with them."""
    photographs = root / "photographs"
    png = (photographs / "coffee.png").read_bytes()
    (photographs / "truncated.png").write_bytes(png[:len(png) // 2])
    (photographs / "text.png").write_text("not an image at all\n")
    zero = bytearray(png[:33])
    zero[16:24] = (0).to_bytes(4, "big") + (0).to_bytes(4, "big")  # IHDR width x height = 0 x 0
    (photographs / "zero.png").write_bytes(bytes(zero))
    return {"truncated.png": "truncated or corrupt", "text.png": "not an image", "zero.png": "0x0",
            "missing.png": "missing", "astronaut.png": "over max_image_pixels"}


BAD = [
    (_record("<image><image>two?", "One.", "chelsea.png"), "2 <image> placeholders but 'images' lists 1"),
    (_record("none?", "None.", "chelsea.png"), "0 <image> placeholders but 'images' lists 1"),
    ({"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "<image>"}],
      "images": ["../photographs/chelsea.png"]}, "messages[1] (assistant) holds <image>"),
    (_record("<image><|image_pad|>?", "A.", "chelsea.png"), "writes vision tokens of its own"),
    ({**_record("<image>?", "A."), "images": ["/abs/chelsea.png"]}, "is absolute"),
    ({**_record("<image>?", "A."), "images": "chelsea.png"}, "'images' must be a list"),
]


@pytest.mark.parametrize("record, message", BAD, ids=["more", "fewer", "assistant", "own-tokens", "absolute", "str"])
def test_a_bad_record_is_a_record_error_saying_what_is_wrong(images_root, encoder, record, message):
    with pytest.raises(RecordError, match=re.escape(message)):
        encoder.document(record, shard=str(_shard(images_root, [])))


def _config(path: Path, tokenizer: Path, **overrides) -> DataConfig:
    base = dict(sources=(SourceConfig(path=str(path), name="image-chat", record="image_chat"),),
                tokenizer=str(tokenizer), seq_len=64, num_streams=2, workers=1, process_pool=False,
                prefetch_batches=1, images=SMALL)
    base.update(overrides)
    return DataConfig(**base)


def _batches(config: DataConfig, n: int, batch_size: int = 4):
    with build(config, seed=0, global_batch_size=batch_size, rank=0, world_size=1) as pipe:
        return [next(pipe) for _ in range(n)], pipe.stats()


@pytest.mark.parametrize("image", ["truncated.png", "text.png", "zero.png", "missing.png", "astronaut.png"])
def test_a_bad_image_is_a_record_error_naming_the_image(images_root, image):
    why = _corrupt(images_root)[image]
    encoder = encoder_of(images_root, "image_chat", ImagesConfig(min_pixels=784, max_pixels=3136,
                                                                  max_image_pixels=250_000))
    with pytest.raises(RecordError) as error:
        encoder.document(_record("Look: <image>", "Bad.", image), shard=str(_shard(images_root, [])))
    assert f"images[0] '../photographs/{image}'" in str(error.value) and why in str(error.value)


def test_a_bad_record_stops_the_pipeline_naming_the_file_and_its_line_or_is_skipped(images_root):
    _corrupt(images_root)
    good = [_record("<image>?", "A cat.", "chelsea.png")] * 3
    shard = _shard(images_root, [*good, _record("Look: <image>", "Bad.", "truncated.png"), *good], name="bad.jsonl")
    with pytest.raises(DataError) as error:
        _batches(_config(shard, images_root / "tokenizer"), 4)
    assert error.value.context["file"] == str(shard) and error.value.context["record"] == 4  # its line
    assert "images[0] '../photographs/truncated.png'" in str(error.value)
    _, stats = _batches(_config(shard, images_root / "tokenizer", on_bad_record="skip"), 2)
    assert stats["bad_records_skipped"] == 1


def test_the_tokenizer_must_hold_the_vision_tokens_checked_before_any_rank_reads_data():
    from data.pipeline.plan import check_chat_config

    template = ChatTemplate.for_tokenizer("byte")
    with pytest.raises(ConfigError) as error:
        record_kind("image_chat").encoder(EncoderSetup(template, ByteTokenizer(), "assistant", frozenset(), SMALL))
    assert error.value.context["key"] == "data.tokenizer" and "<|vision_start|>" in str(error.value)
    with pytest.raises(ConfigError) as early:  # train.py's check before any process group or run dir
        check_chat_config(load("configs/tiny-vl-sft.yaml", ["data.tokenizer=byte"]).data)
    assert early.value.context["key"] == "data.tokenizer"


def test_images_travel_as_batch_media_in_placeholder_order_and_overlong_chats_are_dropped(images_root):
    long_answer = "x" * 40  # with the image and the markup, over data.seq_len=64: dropped, never truncated
    records = [_record("<image>?", "A cat.", "chelsea.png"), _record("<image>", long_answer, "astronaut.png"),
               _record("<image><image>?", "Both.", "coffee.png", "rocket.jpg"), _record("plain", "Text.")] * 4
    config = _config(_shard(images_root, records, name="mixed.jsonl"), images_root / "tokenizer")
    batches, stats = _batches(config, 3)
    assert stats["overlong_dropped"] > 0 and stats["overlong_truncated"] == 0
    pad = TOKEN_IDS["image_token_id"]
    shown = 0
    for batch in batches:
        assert set(batch.media) == {PIXELS.name, GRIDS.name}
        for row in range(batch.input_ids.shape[0]):
            grids = [tuple(g.tolist()) for g in batch.media[GRIDS.name][row]]
            pixels = batch.media[PIXELS.name][row]
            assert [p.shape[0] for p in pixels] == [t * h * w for t, h, w in grids]
            assert int((batch.input_ids[row] == pad).sum()) == sum(t * h * w // 4 for t, h, w in grids)
            shown += len(grids)
            assert 4 not in [h * w // 4 for _, h, w in grids]  # the astronaut's chat never reached a row
    assert shown > 0


def test_a_changed_image_changes_the_row_digest_and_nothing_else(images_root, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(images_root / "photographs", copy / "photographs")
    records = [_record("<image>?", "A cat.", "chelsea.png"), _record("plain", "Text.")] * 4
    before, _ = _batches(_config(_shard(copy, records), images_root / "tokenizer"), 1)
    (copy / "photographs" / "chelsea.png").write_bytes((copy / "photographs" / "coffee.png").read_bytes())
    after, _ = _batches(_config(_shard(copy, records), images_root / "tokenizer"), 1)
    digests = [dict(b.row_digests()) for b in (before[0], after[0])]
    changed = [i for i in digests[0] if digests[0][i] != digests[1][i]]
    with_images = [i for i, row in zip(before[0].sequence_index, before[0].media[GRIDS.name]) if row]
    assert changed == with_images and changed


def test_a_pipeline_batch_runs_through_the_qwen2_5_vl_forward(images_root):
    from models.forward import model_forward
    from models.qwen_vl.model import empty_model
    from models.qwen_vl.positions import GRIDS as MODEL_GRIDS, PIXELS as MODEL_PIXELS

    assert (PIXELS.name, GRIDS.name) == (MODEL_PIXELS, MODEL_GRIDS)  # the names the family reads
    config = load("configs/tiny-vl-sft.yaml", ["model.num_layers=1", "model.qwen2_5_vl.depth=1",
                                               "model.qwen2_5_vl.fullatt_block_indexes=[0]"]).model
    model = empty_model(config)
    model.init_weights(torch.Generator().manual_seed(0))
    records = [_record("<image><image>?", "Both.", "coffee.png", "rocket.jpg"), _record("plain", "Text.")] * 2
    batch = _batches(_config(_shard(images_root, records, name="forward.jsonl"), images_root / "tokenizer"), 1)[0][0]
    logits = model_forward(model, batch).logits
    assert logits.shape == (*batch.input_ids.shape, config.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(DataError, match="no image left"):  # the placeholders need their images
        model_forward(model, dataclasses.replace(batch, media={}))


def test_data_images_is_hashed_only_when_set_and_checked_by_key():
    base = load("configs/tiny-sft.yaml")
    assert base.hash == load("configs/tiny-sft.yaml", ["data.images.max_pixels=1003520"]).hash  # its default
    assert base.hash != load("configs/tiny-sft.yaml", ["data.images.max_pixels=3136"]).hash
    from data.vision.images import processing_of

    with pytest.raises(ConfigError) as error:
        processing_of(ImagesConfig(min_pixels=5000, max_pixels=3136))
    assert error.value.context["key"] == "data.images.min_pixels"
    qwen3_vl = processing_of(load(None, ["data.images.patch_size=16", "data.images.image_mean=[0.5, 0.5, 0.5]",
                                         "data.images.image_std=[0.5, 0.5, 0.5]"]).data.images)
    assert (qwen3_vl.patch_size, qwen3_vl.image_mean, qwen3_vl.image_std) == (16, (0.5,) * 3, (0.5,) * 3)


def test_the_patch_geometry_must_be_the_vision_towers():
    with pytest.raises(ConfigError) as error:
        load("configs/tiny-vl-sft.yaml", ["model.qwen2_5_vl.spatial_merge_size=1"])
    assert error.value.context["key"] == "data.images.merge_size" and "spatial_merge_size=1" in str(error.value)


def test_the_embedded_chats_show_every_photograph_and_pair_some(images_root):
    records = conversations(64, 0, "../photographs")
    assert {len(r["images"]) for r in records} == {1, 2}
    assert {p for r in records for p in r["images"]} == {f"../photographs/{f}" for f in
                                                        ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg")}
    assert conversations(64, 0, "x") == conversations(64, 0, "x")
    from data.vision.chat_data import CHAT_SPEC, PARTS, read_parts

    written = read_parts(images_root / "chat" / "train")
    assert len(list((images_root / "chat" / "train").glob("part-*.jsonl"))) == PARTS  # a unit for every stream
    assert len(written) == CHAT_SPEC["train_n"]
    assert [r["images"][0].startswith("../../photographs/") for r in written] == [True] * len(written)
