"""The part of a weight adapter (models/weight_adapter.py) that a family whose checkpoint layout is a
plain rename does not change: nothing stacked, skipped, zero-padded or added on export.

Such a family's adapter subclasses ``RenameWeights`` and writes ``from_hf`` and ``to_hf`` alone
(Qwen2.5-VL's models/qwen_vl/weights.py; the test family tests/families/gelu_lm.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn


class RenameWeights:
    """The rest of a ``WeightAdapter`` whose keys map one-to-one: a subclass adds ``from_hf`` and ``to_hf``."""

    def stacked(self, key: str) -> bool:
        return False

    def ignored(self, hf_key: str) -> bool:
        return False

    def zero_padding(self, hf_key: str) -> bool:
        return False

    def export_padding(self, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {}
