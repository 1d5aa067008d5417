"""Decode an image and turn it into the patch rows a Qwen2-VL / Qwen2.5-VL vision tower reads.

The arithmetic is that of transformers' PIL-backed ``Qwen2VLImageProcessorPil`` (the "slow"
processor; ``Qwen2VLImageProcessor`` is the torchvision one), so the pixel values are equal to
its output within 1e-6 (tests/data/test_images.py, on the four photographs). The torchvision
processor differs from it, and so from these rows, by its resampler alone: the same steps after
torchvision's resize give its pixels within 1e-6, and on the test photographs the two resizes
differ by up to 7 uint8 levels at Qwen2.5-VL's budget and 11 at Qwen3-VL's
(tests/data/test_image_processors.py; docs/data.md, "Images"):

1. decode with Pillow, apply the EXIF orientation (as transformers' ``load_image``), composite
   any transparency onto white and convert to RGB (as its ``convert_to_rgb``);
2. ``smart_resize``: height and width become multiples of ``patch_size * merge_size``, as close
   to the original as the pixel budget [min_pixels, max_pixels] allows, keeping the aspect
   ratio; Pillow's bicubic resize on the uint8 image, so the result is rounded to uint8;
3. rescale by 1/255 (in float64, then float32) and normalize ``(x - mean) / std`` per channel
   in float32 (CLIP's mean and std by default);
4. flatten into ``(grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size**2)`` rows,
   block-major: the ``merge_size x merge_size`` patches of one merged token are consecutive
   rows; each row is (channel, frame, y, x), the still image repeated over the
   ``temporal_patch_size`` frames; ``grid_thw = (1, grid_h, grid_w)``.

These rows and grids are what ``Batch.media`` carries per image (``pixel_values``,
``image_grid_thw``; docs/models.md "Qwen2.5-VL"), and ``ProcessedImage.tokens`` is the number of
image placeholder tokens the language model sees for it.

Bad input (missing, not an image, 0x0, truncated or corrupt, over ``max_image_pixels``, an
aspect ratio over ``max_aspect_ratio``) is a DataError naming the file and, when given, the record.
"""

from __future__ import annotations

import hashlib
import io
import math
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from core.exceptions import ConfigError, DataError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
"""OpenAI CLIP's per-channel mean (RGB), the Qwen2-VL / Qwen2.5-VL processors' ``image_mean``."""
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"""OpenAI CLIP's per-channel standard deviation (RGB), their ``image_std``."""
CHANNELS = 3


@dataclass(frozen=True)
class ImageProcessing:
    """How images become patch rows; the defaults are Qwen2-VL's and Qwen2.5-VL's processor."""

    patch_size: int = 14
    """Side of one vision patch in pixels (the tower's patch_size)."""
    temporal_patch_size: int = 2
    """Frames per patch; a still image is repeated this many times (the tower's temporal_patch_size)."""
    merge_size: int = 2
    """Patches merged into one language token per side (the tower's spatial_merge_size)."""
    min_pixels: int = 56 * 56
    """Smallest resized area (height * width); smaller images are scaled up to it."""
    max_pixels: int = 28 * 28 * 1280
    """Largest resized area (height * width); larger images are scaled down to it."""
    image_mean: tuple[float, float, float] = CLIP_MEAN
    """Per-channel mean subtracted after rescaling to [0, 1]."""
    image_std: tuple[float, float, float] = CLIP_STD
    """Per-channel standard deviation divided by after subtracting the mean."""
    max_image_pixels: int = 64 * 1024 * 1024
    """Largest decoded image (width * height, before resizing) accepted; larger is a DataError."""
    max_aspect_ratio: float = 200.0
    """Largest long side / short side accepted (the processors' limit); larger is a DataError."""

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels",
                     "max_image_pixels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"image processing {name}={value!r} must be a positive integer", key=name)
        if self.min_pixels > self.max_pixels:
            raise ConfigError(f"image processing min_pixels={self.min_pixels} is above max_pixels={self.max_pixels}",
                              key="min_pixels", hint="min_pixels <= max_pixels")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if len(value) != CHANNELS or (name == "image_std" and min(value) <= 0):
                raise ConfigError(f"image processing {name}={value!r} must be {CHANNELS} numbers"
                                  + (" above 0" if name == "image_std" else ""), key=name)
        if not self.max_aspect_ratio >= 1:
            raise ConfigError(f"image processing max_aspect_ratio={self.max_aspect_ratio!r} must be >= 1",
                              key="max_aspect_ratio")

    @property
    def factor(self) -> int:
        """What the resized height and width are multiples of: one merged token's side in pixels."""
        return self.patch_size * self.merge_size

    @property
    def row_size(self) -> int:
        """Values per patch row: channels * frames * patch * patch."""
        return CHANNELS * self.temporal_patch_size * self.patch_size**2


CONFIGURED = ("min_pixels", "max_pixels", "max_image_pixels", "patch_size", "temporal_patch_size", "merge_size",
              "image_mean", "image_std")
"""The ``ImageProcessing`` fields a run sets under ``data.images`` (core ImagesConfig); max_aspect_ratio keeps its default."""


def processing_of(images: Any = None) -> ImageProcessing:
    """The ``ImageProcessing`` of a ``data.images`` section (None: the defaults); a bad value is a
    ConfigError naming its ``data.images.*`` key."""
    if images is None:
        return ImageProcessing()
    try:
        return ImageProcessing(**{name: tuple(value) if isinstance(value, (list, tuple)) else value
                                  for name, value in ((n, getattr(images, n)) for n in CONFIGURED)})
    except ConfigError as exc:
        raise ConfigError(exc.message, key=f"data.images.{exc.context.get('key')}", hint=exc.hint) from None


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image as the vision tower reads it."""

    pixel_values: np.ndarray
    """float32 (grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size**2) patch rows."""
    grid_thw: tuple[int, int, int]
    """(frames, patch rows, patch columns) after resizing: ``image_grid_thw``'s row for this image."""
    merge_size: int
    """Patches merged per side into one language token."""
    sha256: str
    """SHA-256 of the encoded bytes it was decoded from (empty when made from pixels)."""

    @property
    def tokens(self) -> int:
        """Image placeholder tokens in the text: the merged grid's size, t * h * w / merge**2."""
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2


def smart_resize(height: int, width: int, processing: ImageProcessing, *, file: str | None = None,
                 record: int | None = None) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of ``processing.factor``, area within
    [min_pixels, max_pixels], the aspect ratio kept as closely as that allows."""
    if height <= 0 or width <= 0:
        raise DataError(f"image is {width}x{height}: an image needs pixels", file=file, record=record,
                        hint="replace or drop the image")
    ratio = max(height, width) / min(height, width)
    if ratio > processing.max_aspect_ratio:
        raise DataError(f"image of {width}x{height} has an aspect ratio of {ratio:.1f}, over "
                        f"max_aspect_ratio={processing.max_aspect_ratio:g}", file=file, record=record,
                        hint="crop or pad the image")
    factor = processing.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > processing.max_pixels:
        beta = math.sqrt(height * width / processing.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < processing.min_pixels:
        beta = math.sqrt(processing.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode_image(source: bytes | str | Path, processing: ImageProcessing = ImageProcessing(), *,
                 file: str | None = None, record: int | None = None) -> tuple[np.ndarray, str]:
    """(uint8 (height, width, 3) RGB pixels, sha256 of the encoded bytes) of an image file or its
    bytes; ``file`` names where bytes came from (a path names itself)."""
    if isinstance(source, (str, Path)):
        file = file or str(source)
        try:
            data = Path(source).read_bytes()
        except FileNotFoundError:
            raise DataError("image file is missing", file=file, record=record,
                            hint="image paths are relative to the dataset; check the path") from None
        except OSError as exc:
            raise DataError(f"image file cannot be read: {exc.strerror or exc}", file=file, record=record) from None
    else:
        data = bytes(source)
    digest = hashlib.sha256(data).hexdigest()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # max_image_pixels decides
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            _check_size(width, height, processing, file, record)
            image.load()
            pixels = _to_rgb(ImageOps.exif_transpose(image))
    except UnidentifiedImageError:
        size = _header_size(data)
        if size is not None and 0 in size:
            raise DataError(f"image is {size[0]}x{size[1]}: an image needs pixels", file=file, record=record,
                            hint="replace or drop the image") from None
        raise DataError(f"not an image ({len(data)} bytes in no format Pillow reads)", file=file,
                        record=record, hint="images are PNG, JPEG, GIF, BMP, WebP, TIFF ...") from None
    except Image.DecompressionBombError:
        size = _header_size(data)
        shape = f" of {size[0]}x{size[1]}" if size else ""
        raise DataError(f"image{shape} is over Pillow's limit of {Image.MAX_IMAGE_PIXELS * 2} pixels "
                        "(max_image_pixels cannot raise it)", file=file, record=record,
                        hint="downscale the image") from None
    except (OSError, SyntaxError, ValueError, struct.error, EOFError) as exc:
        raise DataError(f"image is truncated or corrupt ({type(exc).__name__}: {exc})", file=file,
                        record=record, hint="re-encode or replace the image") from None
    return pixels, digest


def _check_size(width: int, height: int, processing: ImageProcessing, file: str | None,
                record: int | None) -> None:
    if width <= 0 or height <= 0:
        raise DataError(f"image is {width}x{height}: an image needs pixels", file=file, record=record,
                        hint="replace or drop the image")
    if width * height > processing.max_image_pixels:
        raise DataError(f"image of {width}x{height} = {width * height} pixels is over "
                        f"max_image_pixels={processing.max_image_pixels}", file=file, record=record,
                        hint="downscale the image, or raise max_image_pixels")


def _header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG or GIF header, for the images Pillow refuses to identify."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        return struct.unpack(">II", data[16:24])
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return struct.unpack("<HH", data[6:10])
    return None


def _to_rgb(image: Image.Image) -> np.ndarray:
    """RGB uint8 pixels; transparency is composited onto white (transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def preprocess(pixels: np.ndarray, processing: ImageProcessing = ImageProcessing(), *, sha256: str = "",
               file: str | None = None, record: int | None = None) -> ProcessedImage:
    """Resize, rescale, normalize and flatten uint8 (height, width, 3) RGB pixels into patch rows."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != CHANNELS:
        raise DataError(f"pixels of dtype {pixels.dtype} and shape {pixels.shape} are not uint8 "
                        f"(height, width, {CHANNELS})", file=file, record=record, hint="decode with decode_image")
    height, width = pixels.shape[:2]
    new_height, new_width = smart_resize(height, width, processing, file=file, record=record)
    resized = Image.fromarray(pixels).resize((new_width, new_height), resample=Image.Resampling.BICUBIC)
    rows, grid_h, grid_w = patch_rows(np.asarray(resized, dtype=np.uint8), processing)
    return ProcessedImage(rows, (1, grid_h, grid_w), processing.merge_size, sha256)


def patch_rows(resized: np.ndarray, processing: ImageProcessing) -> tuple[np.ndarray, int, int]:
    """(rows, grid_h, grid_w) of uint8 (H, W, 3) RGB pixels already resized to multiples of the factor:
    rescaled by 1/255, normalized and flattened (steps 3 and 4 above)."""
    chw = resized.transpose(2, 0, 1)  # (3, H, W)
    scaled = (chw.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(processing.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(processing.image_std, dtype=np.float32)[:, None, None]
    return patchify((scaled - mean) / std, processing)


def patchify(image: np.ndarray, processing: ImageProcessing) -> tuple[np.ndarray, int, int]:
    """(rows, grid_h, grid_w) of a float32 (3, H, W) image whose sides are multiples of the factor."""
    p, m, t = processing.patch_size, processing.merge_size, processing.temporal_patch_size
    channels, height, width = image.shape
    grid_h, grid_w = height // p, width // p
    blocks = image.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # (H/(p*m), W/(p*m), m, m, C, p, p)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))  # (..., C, t, p, p)
    rows = np.ascontiguousarray(frames.reshape(grid_h * grid_w, channels * t * p * p), dtype=np.float32)
    return rows, grid_h, grid_w


def load_image(source: bytes | str | Path, processing: ImageProcessing = ImageProcessing(), *,
               file: str | None = None, record: int | None = None) -> ProcessedImage:
    """Decode and preprocess one image file or its bytes (``file`` names where bytes came from)."""
    if isinstance(source, (str, Path)):
        file = file or str(source)
    pixels, digest = decode_image(source, processing, file=file, record=record)
    return preprocess(pixels, processing, sha256=digest, file=file, record=record)
