"""What the Qwen2.5-VL model reads of a batch's media, and the 3-D M-RoPE positions it builds from them.

Media (``Batch.media`` / ``ModelInputs.media``): per row, that row's images in the order their
placeholder runs appear in its tokens, as two ragged fields: ``pixel_values``, one
``(t * h * w, channels * temporal_patch * patch * patch)`` tensor of flattened patches per image,
and ``image_grid_thw``, one ``(3,)`` integer tensor per image, its (t, h, w) grid of patches (the
names of transformers' processor outputs).

Positions (``mrope_positions``), as transformers' ``Qwen2_5_VLModel.get_rope_index`` builds them
for one document: a text token advances all three axes together by one; an image's run of
``t * h * w / merge**2`` placeholders takes (start + frame, start + row, start + column) of its
merged grid, and the text after it resumes at start + max(h, w) / merge. A row of packed
documents restarts at each document (where the batch's 1-D positions do not continue by one), at
the position the batch gives there. Every run of placeholders must hold exactly one image of the
row, in order; anything else is a DataError naming the row, before the vision tower runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from core.exceptions import ConfigError, DataError
from models.qwen.rope import RotaryTable, inverse_frequencies

PIXELS = "pixel_values"
"""The media field of each image's flattened patches."""
GRIDS = "image_grid_thw"
"""The media field of each image's (t, h, w) patch grid."""


@dataclass(frozen=True)
class ImageBatch:
    """The images of one batch, per row, in the order of their placeholder runs."""

    pixels: list[list[torch.Tensor]]
    """Per row, each image's (t * h * w, patch values) flattened patches."""
    grids: list[list[tuple[int, int, int]]]
    """Per row, each image's (t, h, w) grid of patches."""

    def flat(self) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """Every image's patches concatenated row by row, and their grids in the same order."""
        return (torch.cat([p for row in self.pixels for p in row]), [g for row in self.grids for g in row])

    @property
    def count(self) -> int:
        """Images in the batch."""
        return sum(len(row) for row in self.grids)


def image_batch(media: Any, rows: int, patch_dim: int, *, arch: str = "qwen2_5_vl") -> ImageBatch | None:
    """The images of ``media`` (module docstring) for a batch of ``rows`` rows; None without images.
    ``arch`` is the model.arch value errors name."""
    if media is None:
        return None
    if not isinstance(media, Mapping):
        raise ConfigError(f"model.arch {arch} reads media as {{{PIXELS!r}, {GRIDS!r}}}, got "
                          f"{type(media).__name__}", key="model.arch")
    unknown = sorted(set(media) - {PIXELS, GRIDS})
    if unknown or (PIXELS in media) != (GRIDS in media):
        raise ConfigError(f"model.arch {arch} reads the media fields {PIXELS!r} and {GRIDS!r} together, got "
                          f"{sorted(media)}", key="model.arch", hint="give each image its patches and its grid")
    if PIXELS not in media:
        return None
    pixels, grids = list(media[PIXELS]), list(media[GRIDS])
    if len(pixels) != rows or len(grids) != rows:
        raise DataError(f"media holds {len(pixels)} rows of {PIXELS} and {len(grids)} of {GRIDS} for a batch of "
                        f"{rows} rows", hint="give every row its (possibly empty) list of images")
    shaped: list[list[tuple[int, int, int]]] = []
    for row, (row_pixels, row_grids) in enumerate(zip(pixels, grids)):
        if len(row_pixels) != len(row_grids):
            raise DataError(f"row {row} has {len(row_pixels)} images' patches but {len(row_grids)} grids", row=row)
        shaped.append([])
        for index, (patches, grid) in enumerate(zip(row_pixels, row_grids)):
            thw = tuple(int(v) for v in torch.as_tensor(grid).reshape(-1).tolist())
            if len(thw) != 3 or min(thw) <= 0:
                raise DataError(f"row {row}, image {index}: grid {list(thw)} is not three positive sizes (t, h, w)",
                                row=row)
            if tuple(patches.shape) != (thw[0] * thw[1] * thw[2], patch_dim):
                raise DataError(f"row {row}, image {index}: patches of shape {list(patches.shape)} do not fit its grid "
                                f"{list(thw)} (expected [{thw[0] * thw[1] * thw[2]}, {patch_dim}])", row=row)
            shaped[-1].append(thw)
    images = ImageBatch(pixels=[list(r) for r in pixels], grids=shaped)
    return images if images.count else None


def mrope_positions(input_ids: torch.Tensor, position_ids: torch.Tensor | None, images: ImageBatch | None, *,
                    image_token_id: int, video_token_id: int, merge: int, arch: str = "qwen2_5_vl") -> torch.Tensor:
    """(3, B, T) long positions (temporal, height, width) of every token (module docstring); ``arch`` is
    the model.arch value errors name."""
    batch, seq_len = input_ids.shape
    ids = input_ids.detach().cpu().numpy()
    given = None if position_ids is None else position_ids.detach().cpu().numpy()
    if given is not None and given.shape[0] == 1 and batch > 1:
        given = np.broadcast_to(given, (batch, seq_len))
    out = np.empty((3, batch, seq_len), dtype=np.int64)
    for row in range(batch):
        grids = list(images.grids[row]) if images is not None else []
        out[:, row] = _row_positions(ids[row], None if given is None else given[row], grids, row,
                                     image_token_id=image_token_id, video_token_id=video_token_id, merge=merge,
                                     arch=arch)
    return torch.from_numpy(out).to(input_ids.device)


def _row_positions(ids: np.ndarray, given: np.ndarray | None, grids: list[tuple[int, int, int]], row: int, *,
                   image_token_id: int, video_token_id: int, merge: int, arch: str) -> np.ndarray:
    if (ids == video_token_id).any():
        raise DataError(f"row {row} holds video placeholder tokens (id {video_token_id}), which {arch} does "
                        "not read", row=row, hint="leave videos out of the records")
    is_image = ids == image_token_id
    starts = np.zeros(len(ids), dtype=bool)
    starts[0] = True
    if given is not None:
        starts[1:] = given[1:] != given[:-1] + 1  # a packed document begins
    cuts = np.flatnonzero(starts | np.concatenate(([True], is_image[1:] != is_image[:-1])))
    ends = np.append(cuts[1:], len(ids))
    out = np.empty((3, len(ids)), dtype=np.int64)
    pending = list(grids)
    current = 0
    for begin, end in zip(cuts.tolist(), ends.tolist()):
        if starts[begin]:
            current = 0 if given is None else int(given[begin])
        if not is_image[begin]:
            out[:, begin:end] = current + np.arange(end - begin)
            current += end - begin
            continue
        if not pending:
            raise DataError(f"row {row} has a run of {end - begin} image placeholders at tokens {begin}..{end - 1} "
                            f"but no image left for it ({len(grids)} images in the row)", row=row,
                            hint="every placeholder run needs its image; a cut or duplicated run is refused")
        t, h, w = pending.pop(0)
        if h % merge or w % merge:
            raise DataError(f"row {row}: image grid {[t, h, w]} is not a multiple of spatial_merge_size={merge}",
                            row=row)
        gh, gw = h // merge, w // merge
        if end - begin != t * gh * gw:
            raise DataError(f"row {row} has a run of {end - begin} image placeholders at tokens {begin}..{end - 1}, "
                            f"but its image {len(grids) - len(pending) - 1} of grid {[t, h, w]} gives "
                            f"{t * gh * gw} merged patches", row=row,
                            hint="the placeholder count must come from the grid the tower consumes")
        frame, height, width = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[:, begin:end] = current + np.stack([frame.ravel(), height.ravel(), width.ravel()])
        current += max(h, w) // merge
    if pending:
        raise DataError(f"row {row} has {len(grids)} images but only {len(grids) - len(pending)} placeholder runs",
                        row=row, hint="every image needs its run of placeholders in the row's tokens")
    return out


def mrope_table(positions: torch.Tensor, head_dim: int, theta: float, section: tuple[int, ...]) -> RotaryTable:
    """The rotary table of (3, B, T) positions: frequency pair i rotates by the axis its section gives
    it (the first ``section[0]`` pairs by the temporal position, the next by height, the last by width)."""
    axis = torch.repeat_interleave(torch.arange(3, device=positions.device),
                                   torch.tensor(section, device=positions.device))  # (head_dim/2,)
    return axis_rope_table(positions, head_dim, theta, axis)


def axis_rope_table(positions: torch.Tensor, head_dim: int, theta: float, axis: torch.Tensor) -> RotaryTable:
    """The rotary table of (3, B, T) positions where frequency pair i rotates by the position of axis
    ``axis[i]`` (0 temporal, 1 height, 2 width; ``axis`` is (head_dim/2,) long)."""
    inv_freq = inverse_frequencies(head_dim, theta, positions.device)  # (head_dim/2,)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (3, B, T, head_dim/2)
    picked = angles.gather(0, axis.view(1, 1, 1, -1).expand(1, *angles.shape[1:])).squeeze(0)  # (B, T, head_dim/2)
    return RotaryTable(picked.cos(), picked.sin())
