"""transformers' two Qwen2-VL image processors for an ``ImageProcessing``, under the names each release gives them
(tests/data/test_images.py, tests/data/test_image_processors.py).

transformers 5.x: ``Qwen2VLImageProcessorPil`` is the PIL-backed ("slow") processor and ``Qwen2VLImageProcessor``
the torchvision-backed ("fast") one. 4.x: ``Qwen2VLImageProcessor`` is the slow one and
``Qwen2VLImageProcessorFast`` the fast one.
"""

from __future__ import annotations

import importlib

import pytest

from data.vision.images import ImageProcessing

TORCHVISION_BASES = ("TorchvisionBackend", "BaseImageProcessorFast")
"""The base classes of the torchvision-backed processors (5.x, 4.x)."""
NEEDS_TORCHVISION = "pip install torchvision (the torchvision-backed processor; Qwen-VL's AutoProcessor in 5.x)"


def processor_kwargs(processing: ImageProcessing) -> dict:
    """The processors' keyword arguments for ``processing``."""
    return dict(size={"shortest_edge": processing.min_pixels, "longest_edge": processing.max_pixels},
                patch_size=processing.patch_size, temporal_patch_size=processing.temporal_patch_size,
                merge_size=processing.merge_size, image_mean=list(processing.image_mean),
                image_std=list(processing.image_std))


def _module(name: str):
    try:
        return importlib.import_module(f"transformers.models.qwen2_vl.{name}")
    except ImportError:
        return None


def pil_module():
    """The module of the PIL-backed processor and its ``smart_resize``."""
    module = _module("image_processing_pil_qwen2_vl")  # 5.x
    return module or pytest.importorskip("transformers.models.qwen2_vl.image_processing_qwen2_vl")


def pil_processor(processing: ImageProcessing):
    """transformers' PIL-backed processor, checked to be that one."""
    module = pil_module()
    cls = getattr(module, "Qwen2VLImageProcessorPil", None) or module.Qwen2VLImageProcessor
    processor = cls(**processor_kwargs(processing))
    assert not torchvision_backed(processor), f"{type(processor).__name__} is not the PIL-backed processor"
    return processor


def torchvision_processor(processing: ImageProcessing):
    """transformers' torchvision-backed processor, checked to be that one (skipped without torchvision)."""
    pytest.importorskip("torchvision", reason=NEEDS_TORCHVISION)
    pytest.importorskip("transformers")
    if _module("image_processing_pil_qwen2_vl") is not None:  # 5.x
        cls = _module("image_processing_qwen2_vl").Qwen2VLImageProcessor
    else:
        cls = pytest.importorskip("transformers.models.qwen2_vl.image_processing_qwen2_vl_fast").Qwen2VLImageProcessorFast
    processor = cls(**processor_kwargs(processing))
    assert torchvision_backed(processor), f"{type(processor).__name__} is not the torchvision-backed processor"
    return processor


def torchvision_backed(processor) -> bool:
    """Whether an image processor is one of transformers' torchvision-backed ones."""
    return any(base.__name__ in TORCHVISION_BASES for base in type(processor).__mro__)


def torchvision_installed() -> bool:
    """Whether torchvision imports here (transformers then loads its torchvision processors by default)."""
    try:
        importlib.import_module("torchvision")
    except ImportError:
        return False
    return True
