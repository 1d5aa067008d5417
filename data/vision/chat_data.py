"""The embedded image-chat data: small ``image_chat`` conversations about the pinned photographs,
and the byte-level tokenizer with Qwen's chat and vision tokens that tiny vision-language models use.

``python -m data prepare`` writes them beside the photographs (data/vision/photographs.py):

- ``datasets/images/chat/{train,eval}/part-*.jsonl`` (``write_parts``: the 96 training
  conversations as 16 files of 6, the 8 held-out ones as 8 files of 1):
  records ``{"messages": [...], "images": [...]}`` (data/kinds/image_chat.py) whose image paths are
  relative to the file (``../../photographs/chelsea.png``): one or two photographs a conversation, a
  question and a short answer that names what is shown;
- ``datasets/images/tokenizer/``: a Hugging Face ``tokenizer.json``, the built-in byte tokenizer's
  (bytes 0..255, ``<|endoftext|>`` 256, ``<|pad|>`` 257) with ``<|im_start|>``, ``<|im_end|>``,
  ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>`` and ``<|video_pad|>`` as the special
  tokens 258..263, so a model of ``vocab_size`` 512 reads images (its ``model.qwen2_5_vl`` token ids
  are ``TOKEN_IDS``); no ``chat_template`` in its ``tokenizer_config.json``: records render with
  the built-in ChatML.

The records are drawn from a seeded generator: the same spec writes the same bytes.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Callable

from core.exceptions import DataError
from data.vision.photographs import PHOTOGRAPHS

CHAT_DIR = Path("datasets/images/chat")
TOKENIZER_DIR = Path("datasets/images/tokenizer")
CHAT_SPEC = {"seed": 0, "train_n": 96, "eval_n": 8, "photographs": "../../photographs"}
"""What the chat files are written from (their ``.complete`` stamp holds it)."""
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Special tokens added after the byte tokenizer's two, in id order from 258."""
TOKEN_IDS = {"vision_start_token_id": 260, "vision_end_token_id": 261, "image_token_id": 262, "video_token_id": 263}
"""The ``model.qwen2_5_vl`` token ids of a model reading ``TOKENIZER_DIR``'s tokens."""

SUBJECTS = {
    "astronaut": ("an astronaut", "astronaut"),
    "chelsea": ("a cat", "cat"),
    "coffee": ("a cup of coffee", "coffee"),
    "rocket": ("a rocket", "rocket"),
}
"""Per photograph: what it shows, and in one word."""
ONE_IMAGE = (
    ("<image>What is in the picture?", "{what}."),
    ("<image>Describe the image in one word.", "{word}"),
    ("What does this photograph show?\n<image>", "It shows {what}."),
    ("<image>Name the subject.", "{word}"),
)
"""(user turn, answer) of one-image conversations."""
TWO_IMAGES = ("<image><image>What do the two pictures show, in order?", "{first}, then {second}.")
"""(user turn, answer) of two-image conversations."""


def conversations(n: int, seed: int, photographs: str) -> list[dict]:
    """``n`` image_chat records, one in four with two photographs; image paths under ``photographs``."""
    rng = random.Random(seed)
    names = sorted(SUBJECTS)
    out = []
    for _ in range(n):
        if rng.random() < 0.25:
            first, second = rng.sample(names, 2)
            user, answer = TWO_IMAGES
            text = answer.format(first=SUBJECTS[first][0], second=SUBJECTS[second][0])
            shown = [first, second]
        else:
            shown = [rng.choice(names)]
            user, answer = rng.choice(ONE_IMAGE)
            what, word = SUBJECTS[shown[0]]
            text = answer.format(what=what, word=word)
            text = text[0].upper() + text[1:]
        out.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": text}],
                    "images": [f"{photographs}/{PHOTOGRAPHS[name].file}" for name in shown]})
    return out


def write_chat(out: Path = CHAT_DIR, *, force: bool = False) -> bool:
    """Write the train and eval conversations under ``out``; False when its stamp says they are there."""
    return write_splits(out, CHAT_SPEC, conversations, force=force)


PARTS = 16
"""Files a split of at least ``PARTS`` records is written as (``part-000.jsonl`` ...); a smaller split is one
file a record. A JSONL file is one unit of the pipeline, and a source with fewer units than
``data.num_streams`` repeats them across the streams (docs/data.md), so one file put the same records in
every stream: a batch of 8 streams read 2 distinct records 8 times over, and tiny-vl-grpo's evaluation
of "16 held-out prompts" scored 2 of them. 16 covers the configs' 8 streams, as ``datasets/tasks`` does;
the 8 held-out chats, as 8 files, give each of 8 streams its own."""
LAYOUT = "min(parts, records), none empty"
"""How ``write_parts`` spreads a split, as the stamps of what it wrote record it: splits written when
every split was ``PARTS`` files (the 8 held-out chats in 16, 8 of them empty) are written again."""


def parts_of(count: int) -> int:
    """The number of files ``write_parts`` writes ``count`` records as: ``PARTS``, or one a record below it."""
    return min(PARTS, count)


def write_parts(directory: Path, records: list[dict]) -> None:
    """``records`` (keys sorted, one a line) as ``parts_of(len(records))`` files under ``directory``, in order:
    file i holds the i-th of those contiguous runs (as even as the count allows), none empty. DataError
    for no records: a split that holds nothing would be read as an empty source."""
    if not records:
        raise DataError("a split of no records: nothing to write", path=str(directory),
                        hint="give the spec at least one record for this split (its train_n / eval_n)")
    files = parts_of(len(records))
    directory.mkdir(parents=True)
    for i in range(files):
        run = records[len(records) * i // files:len(records) * (i + 1) // files]
        (directory / f"part-{i:03d}.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in run))


def read_parts(directory: Path) -> list[dict]:
    """The records ``write_parts`` wrote under ``directory``, in their order."""
    return [json.loads(line) for part in sorted(directory.glob("part-*.jsonl")) for line in part.read_text().splitlines()]


def write_splits(out: Path, spec: dict, records: Callable[[int, int, str], list[dict]], *, force: bool) -> bool:
    """``records(train_n + eval_n, seed, photographs)`` of ``spec``, the first ``train_n`` under
    ``out/train/`` and the rest under ``out/eval/`` (``write_parts``), ``out`` replaced and stamped with
    ``spec``, ``PARTS`` and ``LAYOUT``; False (nothing written) when the stamp already holds them."""
    stamp, stamped = out / ".complete", {**spec, "parts": PARTS, "layout": LAYOUT}
    if not force and stamp.is_file() and json.loads(stamp.read_text()) == stamped:
        return False
    shutil.rmtree(out, ignore_errors=True)
    written = records(spec["train_n"] + spec["eval_n"], spec["seed"], spec["photographs"])
    for split, part in (("train", written[:spec["train_n"]]), ("eval", written[spec["train_n"]:])):
        write_parts(out / split, part)
    stamp.write_text(json.dumps(stamped))
    return True


def tokenizer_json() -> str:
    """The byte tokenizer's ``tokenizer.json`` with ``SPECIALS`` added (ids 258..263)."""
    from tokenizers import AddedToken, Tokenizer

    from data.tokenizers import ByteTokenizer

    tok = Tokenizer.from_str(ByteTokenizer().hf_tokenizer_json())
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in SPECIALS])
    return tok.to_str()


def write_tokenizer(out: Path = TOKENIZER_DIR, *, force: bool = False) -> bool:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` under ``out``; False when they are there."""
    config = {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "specials": list(SPECIALS)}
    stamp = out / ".complete"
    if not force and stamp.is_file() and json.loads(stamp.read_text()) == config:
        return False
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"},
                                                          indent=1) + "\n")
    stamp.write_text(json.dumps(config))
    return True
