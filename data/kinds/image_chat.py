"""The ``image_chat`` record kind: a chat record whose user turns show images, for vision-language SFT.

A record is ``{"messages": [...], "images": ["photos/cat.png", ...]}`` (``tools`` as for ``chat``).
Each ``<image>`` in a user turn's content stands for the next image of ``images``, in order; a path
is relative to the directory of the JSONL (or Parquet) file that holds the record. A Parquet record
may carry the images themselves instead: ``images`` a list of binary items (each an image file's
bytes), or of Hugging Face datasets' Image structs ``{"bytes", "path"}`` (the bytes where set, else
the path); they are decoded, checked and hashed (``ProcessedImage.sha256``) as the same bytes read
from a file are, and a bad one is named by its index and size.

Encoding, as transformers' Qwen2.5-VL chat template and processor do it:

1. every ``<image>`` becomes ``<|vision_start|><|image_pad|><|vision_end|>`` (what the template
   writes for an image item) and the conversation is rendered with the chat template and
   tokenized like a ``chat`` record, its target mask from ``data.loss_on``;
2. each image is decoded and preprocessed (data/vision/images.py, under ``data.images``) in the
   pipeline's worker stage, and its one ``<|image_pad|>`` repeated once per merged patch,
   ``t * h * w / merge**2`` of its grid (the processor's expansion);
3. the vision tokens (start, pads, end) never carry loss, whatever ``data.loss_on`` says;
4. the images travel as two ragged fields, ``pixel_values`` (each image's patch rows) and
   ``image_grid_thw`` (its (t, h, w) grid): ``Batch.media``, in the order of their placeholders,
   digested into the batch hash. Both keep their document whole: a conversation longer than
   ``data.seq_len`` is dropped and counted, never truncated (data/fields.py).

A bad record is a RecordError (named by file and line, or skipped under ``data.on_bad_record``):
placeholders outside user turns, more or fewer placeholders than images, vision tokens written in
the text, a path that is absolute or not a string, an image missing, truncated, not an image, 0x0,
over ``data.images.max_image_pixels`` or of an extreme aspect ratio. The tokenizer must hold the
vision tokens as single tokens (Qwen's vocabulary, or datasets/images/tokenizer for the tiny
models); another is a ConfigError naming ``data.tokenizer``.
"""

from __future__ import annotations

from pathlib import Path, PurePath
from typing import Any, Optional

import numpy as np

from core.exceptions import ConfigError, DataError
from data.chat_template import LOSS_ON, RecordError, token_mask, tools_of
from data.fields import TARGET_MASK, DocField, Pack
from data.kinds.chat import chat_messages
from data.record_kinds import Encoded, EncoderSetup, RecordKind
from data.vision.images import ImageProcessing, ProcessedImage, load_image, processing_of

PLACEHOLDER = "<image>"
"""Where a user turn shows the record's next image."""
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
"""Qwen2-VL's vision tokens: an image is ``VISION_START``, one ``IMAGE_PAD`` per merged patch, ``VISION_END``."""
PIXELS = DocField("pixel_values", Pack.RAGGED, whole_document=True)
"""Each image's float32 (t * h * w, 3 * temporal_patch * patch**2) patch rows."""
GRIDS = DocField("image_grid_thw", Pack.RAGGED, whole_document=True)
"""Each image's int64 (3,) grid of patches (t, h, w)."""


def vision_token_ids(tokenizer) -> dict[str, int]:
    """The ids of the three vision tokens; a ConfigError naming data.tokenizer where one is not a single token."""
    ids = {}
    for name in (VISION_START, IMAGE_PAD, VISION_END):
        encoded = list(tokenizer.encode(name))
        if len(encoded) != 1:
            raise ConfigError(f"data.tokenizer encodes {name} as {len(encoded)} tokens: image_chat records need "
                              f"{VISION_START}, {IMAGE_PAD} and {VISION_END} as single tokens", key="data.tokenizer",
                              hint="use data.tokenizer=qwen, or datasets/images/tokenizer (python -m data prepare) "
                                   "for a tiny byte-level model")
        ids[name] = encoded[0]
    return ids


class ImageChatDocuments:
    """An ``image_chat`` record (and the shard it came from) -> ids, target mask and its images' patches."""

    reads_files = True

    def __init__(self, setup: EncoderSetup) -> None:
        if setup.loss_on not in LOSS_ON:
            raise ConfigError(f"data.loss_on must be one of {LOSS_ON}, got {setup.loss_on!r}", key="data.loss_on")
        self.template = setup.template
        self.tokenizer = setup.tokenizer
        self.loss_on = setup.loss_on
        self.processing: ImageProcessing = processing_of(setup.images)
        self.vision = vision_token_ids(setup.tokenizer)

    def document(self, record: Any, shard: Optional[str] = None) -> Encoded:
        messages, first_completion = chat_messages(record)
        images, rendered_messages = self._shown(record, messages, shard, "record")
        rendered = self.template.render_spans(rendered_messages, first_completion, self.loss_on,
                                              tools=tools_of(record))
        ids, offsets = self.tokenizer.encode_offsets(rendered.text)
        return self._encoded(np.asarray(ids, dtype=np.int32), token_mask(offsets, rendered.spans), images)

    def _shown(self, record: dict, messages: list[dict], shard: Optional[str],
               whose: str) -> tuple[list[ProcessedImage], list[dict]]:
        """``record``'s images, loaded and processed, and ``messages`` with each user turn's placeholder
        written as the vision tokens; RecordError (naming ``whose`` turns) where the counts differ."""
        sources = _image_sources(record)
        shown = placeholders(messages)
        if shown != len(sources):
            raise RecordError(f"the {whose}'s user turns hold {shown} {PLACEHOLDER} placeholders but 'images' lists "
                              f"{len(sources)} images: each image needs one placeholder, in order")
        images = [self._image(source, k, shard) for k, source in enumerate(sources)]
        return images, [dict(m, content=show_images(m["content"])) if m["role"] == "user" else m for m in messages]

    def _encoded(self, ids: np.ndarray, mask: np.ndarray, images: list[ProcessedImage]) -> Encoded:
        """The rendered ``ids`` and target ``mask`` with each image's pad expanded, and the images' patches."""
        ids, mask = self._expand(ids, mask, images)
        fields: dict[str, Any] = {TARGET_MASK.name: mask}
        if images:
            fields[PIXELS.name] = [image.pixel_values for image in images]
            fields[GRIDS.name] = [np.asarray(image.grid_thw, dtype=np.int64) for image in images]
        return Encoded(ids, fields)

    def _image(self, source: str | bytes, index: int, shard: Optional[str]) -> ProcessedImage:
        if isinstance(source, bytes):  # decoded as the file would be: its sha256 is that of the same bytes
            try:
                return load_image(source, self.processing, file=shard)
            except DataError as exc:
                raise RecordError(f"images[{index}] ({len(source)} bytes in the record): {exc.message}") from None
        where = Path(shard).parent / source if shard else Path(source)
        try:
            return load_image(where, self.processing)
        except DataError as exc:
            raise RecordError(f"images[{index}] {source!r} ({where}): {exc.message}") from None

    def _expand(self, ids: np.ndarray, mask: np.ndarray,
                images: list[ProcessedImage]) -> tuple[np.ndarray, np.ndarray]:
        return expand_pads(ids, mask, images, self.vision)


def show_images(content: str) -> str:
    """A user turn's text with each ``<image>`` written as what the chat template writes for an image:
    ``<|vision_start|><|image_pad|><|vision_end|>``."""
    return content.replace(PLACEHOLDER, f"{VISION_START}{IMAGE_PAD}{VISION_END}")


def expand_pads(ids: np.ndarray, mask: np.ndarray, images: list[ProcessedImage],
                vision: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Rendered ``ids`` with each image's one pad token repeated once per merged patch, and ``mask`` with no
    vision token marked; ``vision``: ``vision_token_ids``. RecordError where the rendered text holds other
    counts of vision tokens than ``images``."""
    vision_ids = np.asarray(list(vision.values()), dtype=ids.dtype)
    counts = {name: int((ids == token).sum()) for name, token in vision.items()}
    if any(n != len(images) for n in counts.values()):
        found = ", ".join(f"{n} {name}" for name, n in counts.items())
        raise RecordError(f"the rendered record holds {found} for {len(images)} images: its text writes vision "
                          "tokens of its own (or the chat template drops some)")
    repeats = np.ones(len(ids), dtype=np.int64)
    repeats[ids == vision[IMAGE_PAD]] = [image.tokens for image in images]
    mask = mask & ~np.isin(ids, vision_ids)
    return np.repeat(ids, repeats), np.repeat(mask, repeats)


def _image_sources(record: dict) -> list[str | bytes]:
    """The record's images: each a path relative to its file, or the image file's bytes (a Parquet binary
    item, or Hugging Face datasets' Image struct ``{"bytes", "path"}``, its bytes when set)."""
    images = record.get("images")
    if images is None:
        return []
    if not isinstance(images, list):
        raise RecordError(f"'images' must be a list of paths relative to the record's file (or of images' bytes), "
                          f"got {type(images).__name__}")
    sources: list[str | bytes] = []
    for k, item in enumerate(images):
        if isinstance(item, dict):
            item = item.get("bytes") if item.get("bytes") is not None else item.get("path")
        if isinstance(item, (bytes, bytearray)):
            if not item:
                raise RecordError(f"images[{k}] holds 0 bytes: an image's bytes are its encoded file (PNG, JPEG ...)")
            sources.append(bytes(item))
            continue
        if not isinstance(item, str) or not item:
            what = f"a {type(item).__name__}" if not isinstance(item, str) else "an empty string"
            raise RecordError(f"images[{k}] must be a non-empty path string or an image's bytes, got {what}")
        if PurePath(item).is_absolute():
            raise RecordError(f"images[{k}] {item!r} is absolute: image paths are relative to the record's file")
        sources.append(item)
    return sources


def placeholders(messages: list[dict]) -> int:
    """The ``<image>`` placeholders of the user turns; RecordError for one in another turn."""
    shown = 0
    for i, message in enumerate(messages):
        n = message["content"].count(PLACEHOLDER)
        if n and message["role"] != "user":
            raise RecordError(f"messages[{i}] ({message['role']}) holds {PLACEHOLDER}: only user turns show images")
        shown += n
    return shown


KIND = RecordKind(name="image_chat", summary='{"messages": [...], "images": [...]}: a chat whose user turns show '
                  "images (<image>), rendered with the chat template", columns=("messages", "images"),
                  encoder=ImageChatDocuments, uses_template=True, fields=(TARGET_MASK, PIXELS, GRIDS))
