"""The generated shapes task: small images of coloured shapes drawn from a seeded generator, with
questions whose one-word answers are checked exactly, so a tiny vision-language model's learning is
measured on images it never trained on (configs/tiny-vl-shapes-sft.yaml, tiny-vl-shapes-grpo.yaml).

Each image is ``SIZE`` x ``SIZE`` pixels on a plain background, cut into a 2 x 2 grid of cells; 1 to 4
cells (uniformly many) hold one shape each (circle, square or triangle, in one of ``COLOURS``), with
a random size and offset inside its cell, so shapes never overlap and a 56 x 56 image's 4 merged
image tokens are its 4 cells. Questions:

- ``"<image>How many shapes?"``: the number drawn, as a digit (``"3"``);
- ``"<image>What colour is the circle?"`` (or square, triangle), asked only of a kind drawn exactly
  once: its colour's name, capitalized (``"Red"``), as the case-sensitive ``exact_answer`` compares.

Guessing uniformly answers one in four of either question (4 counts, 4 colours).

``python -m data prepare`` writes, under ``datasets/images/shapes/`` (``write_shapes``):

- ``images/{train,eval}-NNNN.png``: the drawn images; an eval image equal to one drawn before is
  drawn again, so no eval image is ever shown in training;
- ``chat/{train,eval}/part-*.jsonl`` (``PARTS`` files a split): ``image_chat`` records (data/kinds/image_chat.py), each a
  question and its answer; two a training image (its count, and a colour when one applies), one an
  eval image (count and colour alternating);
- ``prompts/{train,eval}/part-*.jsonl``: ``image_prompt`` records (data/kinds/image_prompt.py) with
  the same questions and an ``answer``: one a training image, and one an eval image (the chats' eval
  questions);
- ``.complete``: the spec it was written from; the same spec writes the same bytes.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from data.vision.chat_data import PARTS, write_parts

SHAPES_DIR = Path("datasets/images/shapes")
SHAPES_SPEC = {"seed": 0, "train_images": 384, "eval_images": 32, "size": 56, "version": 2}
"""What the shapes files are written from (their ``.complete`` stamp holds it)."""
SIZE = 56
"""Image width and height in pixels (2 x 2 cells of 28: one merged image token each)."""
BACKGROUND = (235, 235, 235)
"""The plain background's RGB."""
COLOURS = {"Red": (215, 40, 40), "Green": (40, 160, 60), "Blue": (40, 80, 215), "Yellow": (225, 195, 20)}
"""Colour names (as answered) and their RGB."""
KINDS = ("circle", "square", "triangle")
"""The shapes drawn."""
COUNT_QUESTION = "<image>How many shapes?"
"""The counting question; its answer is the number of shapes as a digit."""
COLOUR_QUESTION = "<image>What colour is the {kind}?"
"""The colour question, asked of a kind drawn exactly once; its answer is a ``COLOURS`` name."""


@dataclass(frozen=True)
class Shape:
    """One drawn shape."""

    kind: str
    """One of ``KINDS``."""
    colour: str
    """One of ``COLOURS``' names."""
    box: tuple[int, int, int, int]
    """Its bounding box (left, top, right, bottom) in pixels, inside one cell."""


def draw_spec(rng: random.Random, size: int = SIZE) -> list[Shape]:
    """1 to 4 shapes, each in its own cell of the 2 x 2 grid, drawn from ``rng``."""
    cell = size // 2
    shapes = []
    for index in sorted(rng.sample(range(4), rng.randint(1, 4))):
        side = rng.randint(cell * 9 // 14, cell - 4)
        left = (index % 2) * cell + rng.randint(2, cell - side - 2)
        top = (index // 2) * cell + rng.randint(2, cell - side - 2)
        shapes.append(Shape(rng.choice(KINDS), rng.choice(sorted(COLOURS)), (left, top, left + side, top + side)))
    return shapes


def render(shapes: list[Shape], size: int = SIZE) -> bytes:
    """The PNG bytes of ``shapes`` drawn on the background (no antialiasing: exact colours)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for shape in shapes:
        left, top, right, bottom = shape.box
        fill = COLOURS[shape.colour]
        if shape.kind == "circle":
            draw.ellipse(shape.box, fill=fill)
        elif shape.kind == "square":
            draw.rectangle(shape.box, fill=fill)
        else:
            draw.polygon([((left + right) // 2, top), (right, bottom), (left, bottom)], fill=fill)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=False)
    return out.getvalue()


def questions(shapes: list[Shape]) -> list[tuple[str, str]]:
    """(question, answer) pairs about ``shapes``: the count, then the colour of each kind drawn once."""
    pairs = [(COUNT_QUESTION, str(len(shapes)))]
    for kind in KINDS:
        of_kind = [s for s in shapes if s.kind == kind]
        if len(of_kind) == 1:
            pairs.append((COLOUR_QUESTION.format(kind=kind), of_kind[0].colour))
    return pairs


def generate(spec: dict) -> dict:
    """Everything ``spec`` writes: ``{"images": {name: png}, "chat": {split: records}, "prompts": {split:
    records}}``, image paths relative to the record files (``../../images/<name>``)."""
    rng = random.Random(spec["seed"])
    images: dict[str, bytes] = {}
    shown: set[bytes] = set()
    chat: dict[str, list[dict]] = {"train": [], "eval": []}
    prompts: dict[str, list[dict]] = {"train": [], "eval": []}
    for split, n in (("train", spec["train_images"]), ("eval", spec["eval_images"])):
        for i in range(n):
            shapes = draw_spec(rng, spec["size"])
            while split == "eval" and render(shapes, spec["size"]) in shown:  # held out: never a training image
                shapes = draw_spec(rng, spec["size"])
            name = f"{split}-{i:04d}.png"
            images[name] = render(shapes, spec["size"])
            shown.add(images[name])
            pairs = questions(shapes)
            path = [f"../../images/{name}"]
            if split == "train":
                asked = [pairs[0]] + ([rng.choice(pairs[1:])] if len(pairs) > 1 else [])
                prompted = [rng.choice(pairs)]
            else:
                asked = [pairs[1] if i % 2 and len(pairs) > 1 else pairs[0]]
                prompted = asked
            chat[split] += [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                             "images": path} for q, a in asked]
            prompts[split] += [{"prompt": q, "answer": a, "images": path} for q, a in prompted]
    rng.shuffle(chat["train"])
    rng.shuffle(prompts["train"])
    return {"images": images, "chat": chat, "prompts": prompts}


def write_shapes(out: Path = SHAPES_DIR, *, force: bool = False) -> bool:
    """Write the images and the chat and prompt records under ``out``; False when its stamp says they
    are there."""
    stamp, stamped = out / ".complete", {**SHAPES_SPEC, "parts": PARTS}
    if not force and stamp.is_file() and json.loads(stamp.read_text()) == stamped:
        return False
    shutil.rmtree(out, ignore_errors=True)
    written = generate(SHAPES_SPEC)
    (out / "images").mkdir(parents=True)
    for name, png in written["images"].items():
        (out / "images" / name).write_bytes(png)
    for kind in ("chat", "prompts"):
        for split, records in written[kind].items():
            write_parts(out / kind / split, records)
    stamp.write_text(json.dumps(stamped))
    return True
