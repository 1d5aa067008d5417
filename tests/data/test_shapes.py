"""The generated shapes task (data/vision/shapes.py): seeded (the same spec writes the same bytes),
its images decode and show what their answers say, its records encode through the image_chat and
image_prompt kinds, and its eval images are never shown in training."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data.kinds.image_chat import PIXELS
from data.vision.chat_data import PARTS, read_parts, write_tokenizer
from data.vision.shapes import BACKGROUND, COLOURS, KINDS, SHAPES_SPEC, draw_spec, questions, render, write_shapes
from tests.data.image_cases import encoder_of

SMALL_SPEC = dict(SHAPES_SPEC, train_images=12, eval_images=4)
"""A few images of each split, for the tests that encode every record."""


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory) -> Path:
    """The shapes task as `python -m data prepare` writes it, beside the tokenizer with the vision tokens."""
    root = tmp_path_factory.mktemp("images")
    write_shapes(root / "shapes")
    write_tokenizer(root / "tokenizer")
    return root


def test_the_same_spec_writes_the_same_bytes(tmp_path, shapes_root):
    write_shapes(tmp_path / "again")
    first = sorted(p.relative_to(shapes_root / "shapes") for p in (shapes_root / "shapes").rglob("*") if p.is_file())
    again = sorted(p.relative_to(tmp_path / "again") for p in (tmp_path / "again").rglob("*") if p.is_file())
    assert first == again and len(first) == SHAPES_SPEC["train_images"] + SHAPES_SPEC["eval_images"] + 4 * PARTS + 1
    assert all((shapes_root / "shapes" / p).read_bytes() == (tmp_path / "again" / p).read_bytes() for p in first)
    assert not write_shapes(tmp_path / "again")  # its stamp says it is there


def test_drawn_pixels_match_the_spec_and_the_answers():
    rng = random.Random(7)
    counts = set()
    for _ in range(40):
        shapes = draw_spec(rng)
        image = np.asarray(Image.open(io.BytesIO(render(shapes))).convert("RGB"))
        assert image.shape == (56, 56, 3)
        for shape in shapes:  # each shape's centre shows its colour, its box's corner (but a square's) the background
            left, top, right, bottom = shape.box
            assert tuple(image[(top + bottom) // 2 + 2, (left + right) // 2]) == COLOURS[shape.colour]
            if shape.kind != "square":
                assert tuple(image[top, left]) == BACKGROUND
        boxes = [s.box for s in shapes]
        assert all(a[2] < b[0] or b[2] < a[0] or a[3] < b[1] or b[3] < a[1]
                   for i, a in enumerate(boxes) for b in boxes[i + 1:])  # no overlap
        drawn = {tuple(c) for c in image.reshape(-1, 3)} - {BACKGROUND}
        assert drawn == {COLOURS[s.colour] for s in shapes}  # exact colours, nothing else
        pairs = dict(questions(shapes))
        assert pairs["<image>How many shapes?"] == str(len(shapes))
        counts.add(len(shapes))
        for kind in KINDS:
            of_kind = [s.colour for s in shapes if s.kind == kind]
            assert pairs.get(f"<image>What colour is the {kind}?") == (of_kind[0] if len(of_kind) == 1 else None)
    assert counts == {1, 2, 3, 4}


def test_records_answer_what_their_image_shows(shapes_root):
    """Recount from the written files: every record's answer is the one its image's spec gives."""
    rng = random.Random(SHAPES_SPEC["seed"])
    specs = {}
    drawn = set()
    for split in ("train", "eval"):
        for i in range(SHAPES_SPEC[f"{split}_images"]):
            shapes = draw_spec(rng)
            while split == "eval" and render(shapes) in drawn:
                shapes = draw_spec(rng)
            drawn.add(render(shapes))
            specs[f"{split}-{i:04d}.png"] = shapes
            if split == "train":  # the generator's draws for the questions asked of it
                pairs = questions(shapes)
                if len(pairs) > 1:
                    rng.choice(pairs[1:])
                rng.choice(pairs)
    root = shapes_root / "shapes"
    for name, shapes in specs.items():
        assert (root / "images" / name).read_bytes() == render(shapes)
    for kind in ("chat", "prompts"):
        for split in ("train", "eval"):
            for record in read_parts(root / kind / split):
                (image,) = record["images"]
                name = image.removeprefix("../../images/")
                assert name.startswith(split) and (root / kind / split / image).resolve().is_file()
                question, answer = ((record["messages"][0]["content"], record["messages"][1]["content"])
                                    if kind == "chat" else (record["prompt"], record["answer"]))
                assert dict(questions(specs[name]))[question] == answer


def test_eval_images_are_never_shown_in_training(shapes_root):
    root = shapes_root / "shapes"
    train = {i for kind in ("chat", "prompts") for r in read_parts(root / kind / "train") for i in r["images"]}
    held = {i for kind in ("chat", "prompts") for r in read_parts(root / kind / "eval") for i in r["images"]}
    assert len(held) == SHAPES_SPEC["eval_images"] and not train & held
    assert not {(root / "images" / Path(i).name).read_bytes() for i in train} & {
        (root / "images" / Path(i).name).read_bytes() for i in held}  # no eval image equal to a training one
    chat_eval = [r["messages"][0]["content"] for r in read_parts(root / "chat" / "eval")]
    assert {q.split()[0] for q in chat_eval} == {"<image>How", "<image>What"}  # both questions held out


@pytest.mark.parametrize("kind", ["image_chat", "image_prompt"])
def test_every_record_encodes_through_its_kind(tmp_path, shapes_root, kind):
    import data.vision.shapes as shapes_module

    root = tmp_path / "images"
    root.mkdir()
    (root / "tokenizer").symlink_to(shapes_root / "tokenizer")
    written = shapes_module.generate(SMALL_SPEC)
    encoder = encoder_of(root, kind)
    folder = "chat" if kind == "image_chat" else "prompts"
    for name, png in written["images"].items():
        (root / "shapes" / "images").mkdir(parents=True, exist_ok=True)
        (root / "shapes" / "images" / name).write_bytes(png)
    for split, records in written[folder].items():
        shard = root / "shapes" / folder / split / "part-000.jsonl"
        shard.parent.mkdir(parents=True)
        for record in records:
            encoded = encoder.document(record, str(shard))
            assert len(encoded.fields[PIXELS.name]) == 1
            mask = encoded.fields["target_mask"]
            answer = record["messages"][1]["content"] if kind == "image_chat" else record["answer"]
            assert encoder.tokenizer.decode(encoded.ids[mask].tolist()).startswith(answer)


def test_every_split_is_spread_over_enough_files_for_every_stream(shapes_root):
    """A JSONL file is one unit and a source with fewer units than data.num_streams repeats them in
    every stream: each split is PARTS files (the configs' 8 streams read distinct records), holding
    every record once."""
    for kind in ("chat", "prompts"):
        for split in ("train", "eval"):
            files = sorted((shapes_root / "shapes" / kind / split).glob("part-*.jsonl"))
            assert len(files) == PARTS >= 8
            assert all(f.stat().st_size > 0 for f in files)
    held_out = read_parts(shapes_root / "shapes" / "prompts" / "eval")
    assert len({json.dumps(r, sort_keys=True) for r in held_out}) == len(held_out) == SHAPES_SPEC["eval_images"]
