"""Our image pixels (data/vision/images.py) against both of transformers' Qwen2-VL image processors, and what a
user's transformers loads for an export's ``preprocessor_config.json`` (data/vision/prompt_images.py).

Ours equal the PIL-backed processor within 1e-6 (tests/data/test_images.py). The torchvision-backed one, which
transformers 5.x loads by default wherever torchvision is installed, resizes with torch's antialiased bicubic
instead of Pillow's: the resized uint8 images differ by one level at up to 16% of the values and, where one
side shrinks while the other grows, by up to 7 (Qwen2.5-VL's budget, rocket) or 11 levels (Qwen3-VL's, coffee)
at a few dozen values of high-contrast edges (torch 2.13, torchvision 0.28, transformers 5.24; torch 2.11 with
torchvision 0.26 parts less, by 2 levels at most). Everything after the resize is the same within 1e-6, which
``test_the_torchvision_processor_differs_by_its_resize_alone`` shows.

An export names ``Qwen2VLImageProcessor`` (transformers 4.51, 4.57 and 5.24 all load that name; which backend
is transformers' choice), so ``AutoProcessor.from_pretrained(export)`` gives the torchvision processor where
torchvision is installed; ``use_fast=False`` gives the PIL one, whose pixels are the training pixels.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

import models
from core import seeding
from core.config_schema import model_config_class
from data.chat_template import CHATML_TEMPLATE
from data.vision.chat_data import TOKEN_IDS, tokenizer_json
from data.vision.images import ImageProcessing, decode_image, load_image, patch_rows, smart_resize
from data.vision.photographs import PHOTOGRAPHS, copy_photographs
from data.vision.prompt_images import PROCESSOR_CONFIG, write_processor_config
from models.hf_weights import save_pretrained
from models.qwen3_vl.family import Qwen3VLSettings
from models.qwen_vl.family import QwenVLSettings
from tests.data.hf_image_processors import (NEEDS_TORCHVISION, pil_processor, torchvision_backed,
                                            torchvision_installed, torchvision_processor)

transformers = pytest.importorskip("transformers")

QWEN2_5_VL = ImageProcessing()
"""Qwen2.5-VL's processor as released (14-px patches, CLIP mean/std, 56x56 to 28x28x1280 pixels)."""
QWEN3_VL = ImageProcessing(patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), min_pixels=65536,
                           max_pixels=16777216)
"""Qwen3-VL's processor as released (16-px patches, mean and std 0.5, 256x256 to 4096x4096 pixels)."""
MAX_LEVELS = {"qwen2.5-vl": 7, "qwen3-vl": 11}
"""The largest difference between the torchvision-resized and the Pillow-resized uint8 images of the four
photographs, in levels, as measured (torch 2.13, torchvision 0.28): rocket (427x640 to 420x644) at Qwen2.5-VL's
budget, coffee (400x600 to 384x608) at Qwen3-VL's: both resamplers are antialiased bicubic, and their results
differ most where one side shrinks while the other grows (torch 2.11 with torchvision 0.26: 2 levels at most)."""
SETTINGS = {"qwen2.5-vl": QWEN2_5_VL, "qwen3-vl": QWEN3_VL}


@pytest.fixture(scope="module")
def photographs(tmp_path_factory):
    """The pinned photographs, copied from the installed scikit-image."""
    pytest.importorskip("skimage", reason="pip install scikit-image (requirements-dev.txt)")
    out = tmp_path_factory.mktemp("images") / "photographs"
    assert copy_photographs(out)
    return [out / p.file for p in PHOTOGRAPHS.values()]


def _opened(paths) -> list[Image.Image]:
    return [ImageOps.exif_transpose(Image.open(path)) for path in paths]


def _ours(paths, processing: ImageProcessing) -> tuple[np.ndarray, list[list[int]]]:
    images = [load_image(path, processing) for path in paths]
    return np.concatenate([image.pixel_values for image in images]), [list(image.grid_thw) for image in images]


def _theirs(processor, paths) -> tuple[np.ndarray, list[list[int]]]:
    out = processor(images=_opened(paths), return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"].tolist()


def _level(processing: ImageProcessing) -> float:
    """One uint8 level of the resized image in normalized units, in the channel where it is largest."""
    return 1 / 255 / min(processing.image_std)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_ours_equal_the_pil_processor_at_the_released_budgets(photographs, setting):
    """Both families' processors as released (test_images.py covers other budgets): our pixels within 1e-6."""
    processing = SETTINGS[setting]
    theirs, grids = _theirs(pil_processor(processing), photographs)
    ours, our_grids = _ours(photographs, processing)
    assert grids == our_grids and float(np.abs(ours - theirs).max()) <= 1e-6


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_the_torchvision_processor_differs_by_its_resize_alone(photographs, setting):
    """Their pixels are ours with torchvision's resize in place of Pillow's (within 1e-6); the two resizes differ
    by at most the measured levels, and do differ."""
    processing = SETTINGS[setting]
    theirs, grids = _theirs(torchvision_processor(processing), photographs)  # skipped without torchvision
    from torchvision.transforms.v2 import functional as tvF

    ours, our_grids = _ours(photographs, processing)
    assert grids == our_grids and theirs.shape == ours.shape and theirs.dtype == np.float32

    resized_rows, levels = [], []
    for path in photographs:
        pixels, _ = decode_image(path)
        height, width = smart_resize(*pixels.shape[:2], processing)
        by_torch = tvF.resize(torch.tensor(pixels).permute(2, 0, 1), [height, width],
                              interpolation=tvF.InterpolationMode.BICUBIC, antialias=True).permute(1, 2, 0).numpy()
        by_pillow = np.asarray(Image.fromarray(pixels).resize((width, height), Image.Resampling.BICUBIC))
        levels.append(int(np.abs(by_torch.astype(np.int16) - by_pillow.astype(np.int16)).max()))
        resized_rows.append(patch_rows(np.ascontiguousarray(by_torch), processing)[0])
    assert float(np.abs(np.concatenate(resized_rows) - theirs).max()) <= 1e-6

    assert max(levels) <= MAX_LEVELS[setting], levels
    difference = float(np.abs(ours - theirs).max())
    assert 1e-6 < difference <= MAX_LEVELS[setting] * _level(processing) + 1e-6, difference


FAMILIES = {
    "qwen2_5_vl": (QWEN2_5_VL, dict(qwen2_5_vl=QwenVLSettings(
        depth=2, hidden_size=32, num_heads=2, intermediate_size=64, window_size=56, fullatt_block_indexes=(1,),
        mrope_section=(2, 3, 3), **TOKEN_IDS))),
    "qwen3_vl": (QWEN3_VL, dict(qwen3_vl=Qwen3VLSettings(
        depth=2, hidden_size=32, num_heads=2, intermediate_size=48, num_position_embeddings=16,
        deepstack_visual_indexes=(0,), mrope_section=(4, 2, 2), **TOKEN_IDS), head_dim=16)),
}
"""Each VL family's tiny model and the processing its export writes (the family's processor as released)."""


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def export(request, tmp_path_factory):
    """A tiny random export as ``python -m training export`` writes one for a VL run: config.json and weights, the
    byte tokenizer with the vision tokens and the chat template, and ``preprocessor_config.json`` of the run's
    ``data.images``; with the processing it was written from."""
    processing, family = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    config = model_config_class()(arch=request.param, vocab_size=320, hidden_size=64, intermediate_size=96,
                                  num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=512, **family)
    save_pretrained(models.build(config, generator=seeding.generator(4, "model_init")), path)
    (path / "tokenizer.json").write_text(tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|pad|>",
                                                            "chat_template": CHATML_TEMPLATE}))
    write_processor_config(path, processing)
    return path, processing


def test_the_export_names_the_processor_every_transformers_loads(export):
    path, _ = export
    assert json.loads((path / PROCESSOR_CONFIG).read_text())["image_processor_type"] == "Qwen2VLImageProcessor"


def test_auto_image_processor_with_use_fast_false_gives_the_training_pixels(export, photographs):
    """The user's remedy where torchvision is installed, and the only processor where it is not."""
    path, processing = export
    processor = transformers.AutoImageProcessor.from_pretrained(path, use_fast=False)
    assert not torchvision_backed(processor), type(processor).__name__
    theirs, grids = _theirs(processor, photographs)
    ours, our_grids = _ours(photographs, processing)
    assert grids == our_grids and float(np.abs(ours - theirs).max()) <= 1e-6


@pytest.mark.parametrize("remedy", ["use_fast=False", "image_processor="])
def test_auto_processor_with_the_pil_image_processor_gives_the_training_pixels(export, photographs, remedy):
    """``AutoProcessor.from_pretrained(export, use_fast=False)`` (5.x), or with ``image_processor=`` the PIL one
    (4.x too, where ``use_fast=False`` also asks for a slow tokenizer): our pixels within 1e-6. transformers 5.x's
    Qwen-VL processors also hold a video processor, which needs torchvision."""
    pytest.importorskip("torchvision", reason=NEEDS_TORCHVISION)
    path, processing = export
    if remedy == "use_fast=False":
        processor = transformers.AutoProcessor.from_pretrained(path, use_fast=False)
    else:
        image_processor = transformers.AutoImageProcessor.from_pretrained(path, use_fast=False)
        processor = transformers.AutoProcessor.from_pretrained(path, image_processor=image_processor)
    assert not torchvision_backed(processor.image_processor), type(processor.image_processor).__name__
    theirs, grids = _theirs(processor.image_processor, photographs)
    ours, our_grids = _ours(photographs, processing)
    assert grids == our_grids and float(np.abs(ours - theirs).max()) <= 1e-6


def test_the_default_loaders_give_the_torchvision_processor_where_torchvision_is_installed(export, photographs):
    """What a user gets with default arguments: without torchvision the PIL processor (our pixels); with it the
    torchvision processor (for AutoProcessor too), whose pixels differ by the measured levels at most."""
    path, processing = export
    setting = "qwen3-vl" if processing.patch_size == 16 else "qwen2.5-vl"
    ours, our_grids = _ours(photographs, processing)
    if not torchvision_installed():
        processor = transformers.AutoImageProcessor.from_pretrained(path)
        assert not torchvision_backed(processor), type(processor).__name__
        theirs, grids = _theirs(processor, photographs)
        assert grids == our_grids and float(np.abs(ours - theirs).max()) <= 1e-6
        return
    for processor in (transformers.AutoImageProcessor.from_pretrained(path),
                      transformers.AutoProcessor.from_pretrained(path).image_processor):
        assert torchvision_backed(processor), type(processor).__name__
        theirs, grids = _theirs(processor, photographs)
        assert grids == our_grids
        assert 1e-6 < float(np.abs(ours - theirs).max()) <= MAX_LEVELS[setting] * _level(processing) + 1e-6
