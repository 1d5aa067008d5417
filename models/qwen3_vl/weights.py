"""The Qwen3-VL weight adapter (``ModelFamily.weights``, models/weight_adapter.py): a rename.

Ours -> Hugging Face: the language model's keys gain ``model.language_model.``
(``layers.0.mlp.up_proj.weight`` is ``model.language_model.layers.0.mlp.up_proj.weight``), the
tower's gain ``model.`` (``visual.blocks.0.attn.qkv.weight`` is ``model.visual.blocks.0.attn.qkv.weight``),
``lm_head.weight`` is the same: the layout the Qwen3-VL checkpoints are published in and what
transformers 5 writes. Nothing is stacked or padded.
"""

from __future__ import annotations

from models.rename_weights import RenameWeights
from models.weight_adapter import Slot

_TEXT = "model.language_model."
_VISION = "model.visual."


class Qwen3VLWeights(RenameWeights):
    """Hugging Face Qwen3VLForConditionalGeneration checkpoints <-> Qwen3VLForConditionalGeneration."""

    def from_hf(self, hf_key: str) -> Slot | None:
        if hf_key == "lm_head.weight":
            return Slot(hf_key)
        if hf_key.startswith(_VISION):
            return Slot(hf_key.removeprefix("model."))
        if hf_key.startswith(_TEXT):
            return Slot(hf_key.removeprefix(_TEXT))
        return None

    def to_hf(self, key: str, slots: int | None = None) -> tuple[str, ...]:
        if key == "lm_head.weight":
            return (key,)
        return (f"model.{key}" if key.startswith("visual.") else f"{_TEXT}{key}",)


QWEN3_VL_WEIGHTS = Qwen3VLWeights()
"""The row's weight adapter."""
