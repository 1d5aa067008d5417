"""Image preprocessing (data/vision/images.py) equal to transformers' PIL-backed Qwen2-VL image processor
on the pinned photographs (also where torchvision is installed and transformers' default is the other one,
tests/data/test_image_processors.py), their SHA-256 pinning (data/vision/photographs.py), and bad images as a
DataError naming file and record."""

from __future__ import annotations

import hashlib
import io
import struct
import sys
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps

from core.exceptions import ConfigError, DataError
from data.vision.images import ImageProcessing, decode_image, load_image, smart_resize
from data.vision.photographs import COMPLETE, PHOTOGRAPHS, copy_photographs, photograph_path, wheel_directory
from tests.data.hf_image_processors import pil_module, pil_processor

SETTINGS = {
    # Qwen2-VL / Qwen2.5-VL's processor as released: every photograph stays near its own size.
    "qwen2.5-vl-default": ImageProcessing(),
    # A small budget: every photograph is scaled down to at most 16 merged tokens.
    "small-budget": ImageProcessing(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28),
    # Qwen3-VL's 16-px patches and 0.5 mean/std, with a budget that scales every photograph up.
    "qwen3-vl-upscale": ImageProcessing(patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                                        min_pixels=1024 * 1024, max_pixels=2048 * 2048),
}


@pytest.fixture(scope="module")
def photographs(tmp_path_factory):
    """The pinned photographs, copied from the installed scikit-image (make test builds no datasets)."""
    pytest.importorskip("skimage", reason="pip install scikit-image (requirements-dev.txt)")
    out = tmp_path_factory.mktemp("images") / "photographs"
    assert copy_photographs(out)
    return out


def _assert_equal_to_transformers(ours: list, images: list[Image.Image], processing: ImageProcessing) -> None:
    hf = pil_processor(processing)(images=images, return_tensors="np")
    assert [list(image.grid_thw) for image in ours] == hf["image_grid_thw"].tolist()
    rows = np.concatenate([image.pixel_values for image in ours])
    assert rows.dtype == np.float32 and rows.shape == hf["pixel_values"].shape
    assert float(np.abs(rows - hf["pixel_values"]).max()) <= 1e-6
    for image in ours:
        t, h, w = image.grid_thw
        assert image.pixel_values.shape == (t * h * w, processing.row_size)
        assert image.tokens == t * h * w // processing.merge_size**2


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_photographs_equal_transformers_processor(photographs, setting):
    """The four photographs in one call: grids equal, pixel values within 1e-6 (they are bitwise
    equal today), rows in the processor's order; placeholder counts from the same grid."""
    processing = SETTINGS[setting]
    ours = [load_image(photographs / p.file, processing) for p in PHOTOGRAPHS.values()]
    images = [ImageOps.exif_transpose(Image.open(photographs / p.file)) for p in PHOTOGRAPHS.values()]
    _assert_equal_to_transformers(ours, images, processing)
    assert [image.sha256 for image in ours] == [p.sha256 for p in PHOTOGRAPHS.values()]
    grids = {tuple(image.grid_thw) for image in ours}
    assert len(grids) >= 2, "the photographs should give images of different sizes in one call"


def test_photographs_decode_to_their_pinned_sizes(photographs):
    for p in PHOTOGRAPHS.values():
        pixels, digest = decode_image(photographs / p.file)
        assert pixels.shape == (p.height, p.width, 3) and pixels.dtype == np.uint8
        assert digest == p.sha256


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def test_transparency_grey_and_palette_images_equal_transformers():
    """Transparency is composited onto white, grey and palette images become RGB, as transformers does."""
    rng = np.random.default_rng(0)
    rgba = Image.fromarray(rng.integers(0, 256, (37, 53, 4), dtype=np.uint8), mode="RGBA")
    grey = Image.fromarray(rng.integers(0, 256, (61, 29), dtype=np.uint8), mode="L")
    palette = Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).quantize(16)
    palette.info["transparency"] = 3
    processing = ImageProcessing(min_pixels=8 * 28 * 28)
    sources = [_png(im) for im in (rgba, grey, palette)]
    ours = [load_image(data, processing, file=f"inline-{i}") for i, data in enumerate(sources)]
    assert [image.sha256 for image in ours] == [hashlib.sha256(data).hexdigest() for data in sources]
    _assert_equal_to_transformers(ours, [Image.open(io.BytesIO(data)) for data in sources], processing)


def test_exif_orientation_is_applied_as_transformers_load_image_does(tmp_path):
    """A JPEG whose EXIF says "rotate 90": decoded upright, as transformers.image_utils.load_image
    hands it to the processor."""
    load = pytest.importorskip("transformers.image_utils").load_image
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: the stored image is to be rotated 90 degrees clockwise
    path = tmp_path / "rotated.jpg"
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (40, 90, 3), dtype=np.uint8)).save(
        path, format="JPEG", exif=exif)
    pixels, _ = decode_image(path)
    assert pixels.shape == (90, 40, 3)
    processing = ImageProcessing(min_pixels=4 * 28 * 28)
    _assert_equal_to_transformers([load_image(path, processing)], [load(str(path))], processing)


@pytest.mark.parametrize("height,width", [(1, 1), (10, 1990), (1990, 10), (28, 28), (27, 29), (4000, 3000),
                                          (123, 4567), (14, 2800), (3000, 31)])
def test_smart_resize_is_transformers_rule(height, width):
    module = pil_module()
    for processing in SETTINGS.values():
        expected = module.smart_resize(height, width, factor=processing.factor, min_pixels=processing.min_pixels,
                                       max_pixels=processing.max_pixels)
        got = smart_resize(height, width, processing)
        assert got == expected
        assert got[0] % processing.factor == 0 and got[1] % processing.factor == 0


def test_prepare_copies_pinned_photographs_once(photographs, tmp_path):
    for name, p in PHOTOGRAPHS.items():
        assert hashlib.sha256((photographs / p.file).read_bytes()).hexdigest() == p.sha256
        assert photograph_path(name, photographs) == photographs / p.file
    assert (photographs / COMPLETE).is_file()
    assert not copy_photographs(photographs), "an up-to-date directory is left alone"

    # A source whose file differs from its pin is refused, naming the file; nothing is written.
    source = tmp_path / "wheel"
    source.mkdir()
    for p in PHOTOGRAPHS.values():
        (source / p.file).write_bytes((wheel_directory() / p.file).read_bytes())
    coffee = source / PHOTOGRAPHS["coffee"].file
    coffee.write_bytes(coffee.read_bytes()[:-1] + b"\0")
    out = tmp_path / "out"
    with pytest.raises(DataError, match="coffee.png has sha256") as err:
        copy_photographs(out, source=source)
    assert err.value.context["file"] == str(coffee)
    assert not out.exists()

    # A prepared photograph changed afterwards is refused when it is used.
    copy = tmp_path / "copy"
    copy_photographs(copy)
    rocket = copy / PHOTOGRAPHS["rocket"].file
    rocket.write_bytes(rocket.read_bytes() + b"\0")
    with pytest.raises(DataError, match="rocket.jpg has sha256"):
        photograph_path("rocket", copy)


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares its size and holds no pixels: refused from the header, before decoding."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))


def _jpeg(width: int, height: int) -> bytes:
    out = io.BytesIO()
    pixels = np.random.default_rng(1).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


BAD = {
    "truncated-png": (lambda: _png(Image.new("RGB", (64, 48), (9, 99, 199)))[:-40], "truncated or corrupt"),
    "truncated-jpeg": (lambda: _jpeg(96, 64)[:1500], "truncated or corrupt"),
    "not-an-image": (lambda: b'{"text": "a JSON line, not an image"}\n', "not an image"),
    "empty-file": (lambda: b"", "not an image"),
    "zero-by-zero": (lambda: _png_header(0, 0), "image is 0x0"),
    "over-pixel-limit": (lambda: _png(Image.new("RGB", (200, 100))), "over max_image_pixels=10000"),
    "header-over-pixel-limit": (lambda: _png_header(9000, 9000), "9000x9000 = 81000000 pixels is over"),
    "header-over-pillow-limit": (lambda: _png_header(20000, 20000), "of 20000x20000 is over Pillow's limit"),
    "aspect-ratio": (lambda: _png(Image.new("RGB", (402, 2))), "aspect ratio of 201.0"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_image_file_is_a_data_error_naming_file_and_record(tmp_path, case):
    make, message = BAD[case]
    data = make()
    processing = ImageProcessing(max_image_pixels=10_000 if case != "header-over-pixel-limit" else 64 << 20)
    path = tmp_path / f"{case}.img"
    path.write_bytes(data)
    with pytest.raises(DataError, match=message) as err:
        load_image(path, processing, record=7)
    assert err.value.context == {"file": str(path), "record": 7}
    assert f"file={path}" in str(err.value) and "record=7" in str(err.value) and err.value.hint
    # The same bytes from a Parquet cell: the file is the one named, no record when none is given.
    with pytest.raises(DataError, match=message) as err:
        load_image(data, processing, file="shard-00000.parquet")
    assert err.value.context == {"file": "shard-00000.parquet"}


@pytest.mark.parametrize("settings,key", [({"min_pixels": 1000, "max_pixels": 999}, "min_pixels"),
                                          ({"patch_size": 0}, "patch_size"), ({"merge_size": 1.5}, "merge_size"),
                                          ({"image_std": (0.5, 0.0, 0.5)}, "image_std"),
                                          ({"image_mean": (0.5, 0.5)}, "image_mean"),
                                          ({"max_aspect_ratio": 0.5}, "max_aspect_ratio")])
def test_bad_processing_settings_name_the_key(settings, key):
    with pytest.raises(ConfigError, match=key) as err:
        ImageProcessing(**settings)
    assert err.value.context == {"key": key}


def test_missing_image_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="missing") as err:
        load_image(tmp_path / "nowhere.png", record=3)
    assert err.value.context == {"file": str(tmp_path / "nowhere.png"), "record": 3}


def test_prepare_step_copies_or_says_what_to_install(tmp_path, monkeypatch, capsys):
    """``python -m data prepare``'s photographs step: written once, then up to date; without
    scikit-image (a dev dependency, not a runtime one) one line names it and prepare goes on."""
    pytest.importorskip("skimage", reason="pip install scikit-image (requirements-dev.txt)")
    from data.__main__ import _prepare_photographs

    out = tmp_path / "images" / "photographs"
    _prepare_photographs(out, force=False)
    assert capsys.readouterr().out == f"wrote: {out} ({len(PHOTOGRAPHS)} photographs, sha256 checked)\n"
    _prepare_photographs(out, force=False)
    assert capsys.readouterr().out == f"up to date: {out}\n"
    monkeypatch.setitem(sys.modules, "skimage", None)  # find_spec answers None, as if not installed
    _prepare_photographs(tmp_path / "other", force=False)
    printed = capsys.readouterr().out
    assert printed.startswith(f"skipped: {tmp_path / 'other'}") and "pip install scikit-image" in printed
    assert not (tmp_path / "other").exists()
