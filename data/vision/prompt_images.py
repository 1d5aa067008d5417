"""A generation prompt's images, shown as the pipeline shows an ``image_prompt`` record's.

``python -m training generate`` (``--image PATH``, or a prompts file's ``images``) hands each prompt
to the sampler with its images (``Sampler.generate(media=...)``): the same steps as
data/kinds/image_chat.py's encoder, so a prompt reaches the model as a record would in training:

1. each ``<image>`` of the prompt (a text prompt without one shows its images before its text) is
   written as ``<|vision_start|><|image_pad|><|vision_end|>`` (``show_images``; a chat prompt's user
   turns only, as in records) and the prompt rendered and tokenized;
2. each image is decoded and preprocessed under the run's ``data.images`` (data/vision/images.py), and
   its one pad repeated once per merged patch (``expand_pads``);
3. its patch rows and grid become the prompt's media (``pixel_values``, ``image_grid_thw``).

A Hugging Face directory says how its images are cut in ``preprocessor_config.json`` (transformers'
Qwen2-VL image processor's fields; ``read_processor_config``), which ``write_processor_config`` writes
from a run's ``data.images``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from core.json_files import read_json_object
from core.exceptions import ConfigError, DataError
from data.kinds.image_chat import GRIDS, PIXELS, PLACEHOLDER, expand_pads, placeholders, show_images, vision_token_ids
from data.vision.images import ImageProcessing, ProcessedImage, load_image

PROCESSOR_CONFIG = "preprocessor_config.json"
"""The file of a Hugging Face directory that holds its image processor's settings."""


@dataclass(frozen=True)
class ShownPrompt:
    """One prompt as the sampler takes it."""

    text: str
    """The rendered text, each image written as its vision tokens (one pad each: what the record kinds render)."""
    ids: list[int]
    """The token ids, each image's pad repeated once per merged patch."""
    media: Optional[dict[str, list[np.ndarray]]]
    """The images' patch rows and int64 grids, in the order of their placeholders, as the record kinds' fields
    (None: a text prompt)."""


def shown_text(text: str, count: int) -> str:
    """A text prompt showing ``count`` images: its ``<image>`` placeholders (none: the images before the text)
    written as the vision tokens; DataError where it holds another number of placeholders."""
    if count and PLACEHOLDER not in text:
        text = PLACEHOLDER * count + text
    _check_count(text.count(PLACEHOLDER), count)
    return show_images(text)


def shown_messages(messages: Sequence[dict[str, str]], count: int) -> list[dict[str, str]]:
    """Chat messages showing ``count`` images at their user turns' placeholders (RecordError for one in
    another turn, DataError for another number of them)."""
    _check_count(placeholders(list(messages)), count)
    return [dict(m, content=show_images(m["content"])) if m["role"] == "user" else dict(m) for m in messages]


def _check_count(shown: int, count: int) -> None:
    if shown != count:
        raise DataError(f"the prompt holds {shown} {PLACEHOLDER} placeholders for {count} images: each image needs "
                        "one, in order", hint=f"write one {PLACEHOLDER} where each image goes")


class PromptImages:
    """Loads a prompt's images and expands its ids, with a tokenizer that holds the vision tokens."""

    def __init__(self, tokenizer: Any, processing: ImageProcessing) -> None:
        self.tokenizer = tokenizer
        self.processing = processing
        self.vision = vision_token_ids(tokenizer)  # a ConfigError naming data.tokenizer without them

    def load(self, paths: Sequence[Path]) -> list[ProcessedImage]:
        """Each image decoded and preprocessed (a DataError naming the file: missing, not an image, corrupt)."""
        return [load_image(path, self.processing) for path in paths]

    def prompt(self, text: str, images: list[ProcessedImage]) -> ShownPrompt:
        """The rendered ``text`` (its images shown as vision tokens) tokenized, its pads expanded, and the media."""
        ids = self.tokenizer.encode_array(text)
        expanded, _ = expand_pads(np.asarray(ids), np.zeros(len(ids), dtype=bool), images, self.vision)
        if not images:
            return ShownPrompt(text, [int(i) for i in expanded], None)
        media = {PIXELS.name: [image.pixel_values for image in images],
                 GRIDS.name: [np.asarray(image.grid_thw, dtype=np.int64) for image in images]}
        return ShownPrompt(text, [int(i) for i in expanded], media)


_SIZES = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}
"""transformers names the pixel budget both ways: ``min_pixels``/``max_pixels`` and ``size``'s edges."""
_SAME = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
"""Fields of ``preprocessor_config.json`` spelled as ``ImageProcessing``'s."""


def processor_config(processing: ImageProcessing) -> dict[str, Any]:
    """The ``preprocessor_config.json`` of ``processing``: transformers' Qwen2-VL image processor's fields.

    The type is ``Qwen2VLImageProcessor``, a name transformers 4.51, 4.57 and 5.24 all load; 4.x refuses
    5.x's ``Qwen2VLImageProcessorPil`` (no such class), and 5.24 finds either name's pair of backends and
    picks the backend itself, so naming the PIL one would change nothing there. Where torchvision is
    installed, 4.57 and 5.24 load the torchvision processor, whose pixels differ from the ones the model
    trained on (docs/data.md, "Images"); ``use_fast=False`` loads the PIL one, whose pixels equal ours."""
    config: dict[str, Any] = {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True,
                              "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                              "do_convert_rgb": True}
    config.update({name: getattr(processing, name) for name in _SIZES})
    config["size"] = {edge: getattr(processing, name) for name, edge in _SIZES.items()}
    config.update({name: list(v) if isinstance(v := getattr(processing, name), tuple) else v for name in _SAME})
    return config


def write_processor_config(directory: Path, processing: ImageProcessing) -> None:
    """``directory/preprocessor_config.json`` for ``processing``."""
    (Path(directory) / PROCESSOR_CONFIG).write_text(json.dumps(processor_config(processing), indent=2,
                                                               sort_keys=True) + "\n")


def read_processor_config(directory: Path) -> Optional[ImageProcessing]:
    """The ``ImageProcessing`` a Hugging Face directory's ``preprocessor_config.json`` describes (its fields
    it leaves out: the defaults), None without the file; DataError naming the file where it is not a JSON
    object or a field does not fit."""
    file = Path(directory) / PROCESSOR_CONFIG
    if not file.is_file():
        return None
    raw = read_json_object(file, DataError)
    size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
    fields = {name: size[edge] for name, edge in _SIZES.items() if edge in size}
    fields.update({name: raw[name] for name in _SIZES if name in raw and name not in fields})
    fields.update({name: tuple(raw[name]) if isinstance(raw[name], list) else raw[name]
                   for name in _SAME if name in raw})
    try:
        return ImageProcessing(**fields)
    except ConfigError as exc:  # names the field
        raise DataError(f"{PROCESSOR_CONFIG}: {exc.message}", file=str(file), hint="fix the field") from None
    except (TypeError, ValueError) as exc:  # a string where a number goes, a mean of the wrong length
        raise DataError(f"{PROCESSOR_CONFIG}: a field of the wrong type ({exc})", file=str(file),
                        hint="fix the field") from None
