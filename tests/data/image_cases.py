"""What the image record kinds' tests share (test_image_chat.py, test_image_prompt.py): small image
settings, the images root ``python -m data prepare`` writes, and a record kind's encoder over it."""

from __future__ import annotations

from pathlib import Path

from core.config_sections import ImagesConfig
from data.chat_template import ChatTemplate
from data.record_kinds import EncoderSetup, record_kind
from data.tokenizers import build_tokenizer
from data.vision.chat_data import write_chat, write_tokenizer
from data.vision.photographs import copy_photographs

SMALL = ImagesConfig(min_pixels=28 * 28, max_pixels=56 * 56)  # 1..4 image tokens a photograph
"""data.images for the tests: each photograph gives 1 to 4 image tokens."""


def write_images_root(root: Path, *, chat: bool) -> Path:
    """``root`` as `python -m data prepare` writes datasets/images: the photographs and the tokenizer with
    the vision tokens, and (``chat``) the image chats."""
    copy_photographs(root / "photographs")
    if chat:
        write_chat(root / "chat")
    write_tokenizer(root / "tokenizer")
    return root


def encoder_of(root: Path, kind: str, images: ImagesConfig = SMALL, loss_on: str = "assistant"):
    """Record kind ``kind``'s encoder with the tokenizer and chat template under ``root``."""
    tokenizer = build_tokenizer(str(root / "tokenizer"))
    template = ChatTemplate.for_tokenizer(str(root / "tokenizer"))
    return record_kind(kind).encoder(EncoderSetup(template, tokenizer, loss_on, frozenset(), images))
