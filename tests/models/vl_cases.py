"""What the Qwen VL families' tests against transformers share (test_qwen2_5_vl.py, test_qwen3_vl.py,
test_qwen_vl_generation.py): the tiny models' special token ids, the four input cases (text alone, one
image, several images per row, images of different sizes in one batch), rows of token ids with their
images' placeholders and media, transformers' inputs for them, our model exported and loaded by
transformers, and the logits' tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.forward import ModelInputs, model_forward
from models.hf_weights import save_pretrained

IMAGE, VIDEO, START, END = 3, 4, 5, 6
"""The tiny models' image placeholder, video placeholder, vision start and vision end token ids."""
PATCH_VALUES = 3 * 2 * 14 * 14  # channels x frames x patch x patch
"""Values of one flattened patch of the tiny towers (patch 14, 2 frames)."""
INPUT_CASES = [
    pytest.param([[], []], id="text-only"),
    pytest.param([[(1, 8, 12)]], id="one-image"),
    pytest.param([[(1, 8, 12), (1, 4, 4)]], id="several-images-per-row"),
    pytest.param([[(1, 6, 10)], [(1, 4, 4), (1, 12, 8)], []], id="different-sizes-in-one-batch"),
]
"""Each row's image grids (t, h, w), for ``pytest.mark.parametrize("grids", INPUT_CASES)``."""


def export_pair(model, directory: Path, hf_class):
    """``model`` (initialized at seed 1, its norms and biases then moved off 1 and 0) and ``hf_class`` loaded
    from its export under ``directory``, both in eval mode, and the export's path."""
    model.init_weights(torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    path = directory / "export"
    save_pretrained(model, path)
    theirs = hf_class.from_pretrained(path, attn_implementation="sdpa")
    return model.eval(), theirs.eval(), path


def rows_with_images(grids_per_row: list[list[tuple[int, int, int]]], seed: int = 0):
    """Token ids (text, then per image: start, its placeholders, end, text), right-filled with text, and the media."""
    generator = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(7, 99, (n,), generator=generator).tolist()

    rows = []
    for grids in grids_per_row:
        ids = text(3)
        for t, h, w in grids:
            ids += [START] + [IMAGE] * (t * h * w // 4) + [END] + text(2)
        rows.append(ids)
    length = max(map(len, rows)) + 2
    ids = torch.tensor([r + text(length - len(r)) for r in rows])
    pixels = [[torch.randn(t * h * w, PATCH_VALUES, generator=generator) for t, h, w in g] for g in grids_per_row]
    media = {"pixel_values": pixels, "image_grid_thw": [[torch.tensor(g) for g in grids] for grids in grids_per_row]}
    return ids, media


def hf_inputs(ids: torch.Tensor, media) -> dict:
    """transformers' keyword inputs for ``ids`` and our per-row ``media``."""
    grids = [g for row in media["image_grid_thw"] for g in row]
    if not grids:
        return {"input_ids": ids}
    return {"input_ids": ids, "pixel_values": torch.cat([p for row in media["pixel_values"] for p in row]),
            "image_grid_thw": torch.stack(grids), "mm_token_type_ids": (ids == IMAGE).int()}


def ours_and_theirs(pair, grids_per_row, seed=0):
    """Our logits and transformers' for the rows of ``grids_per_row``, with the rows' ids and media."""
    ours, theirs, _ = pair
    ids, media = rows_with_images(grids_per_row, seed)
    with torch.no_grad():
        mine = model_forward(ours, ModelInputs(ids, media=media)).logits
        reference = theirs(**hf_inputs(ids, media)).logits
    return mine, reference, ids, media


def assert_logits_equal(mine: torch.Tensor, reference: torch.Tensor) -> None:
    """Within 1e-5 of the reference's largest magnitude (fp32)."""
    scale = reference.abs().max()
    assert (mine - reference).abs().max() <= 1e-5 * scale, float((mine - reference).abs().max() / scale)


def assert_logits_equal_transformers(pair, grids_per_row) -> None:
    """Our logits equal transformers' for the rows of ``grids_per_row``; where they show images, other pixels
    (each image's patches in reverse order) give other logits."""
    mine, reference, ids, media = ours_and_theirs(pair, grids_per_row)
    assert_logits_equal(mine, reference)
    if any(grids_per_row):
        other = {**media, "pixel_values": [[p.flip(0) for p in row] for row in media["pixel_values"]]}
        with torch.no_grad():
            changed = model_forward(pair[0], ModelInputs(ids, media=other)).logits
        assert not torch.allclose(changed, mine)
