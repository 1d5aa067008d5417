"""The Qwen2.5-VL weight adapter (``ModelFamily.weights``, models/weight_adapter.py): a rename.

Ours -> Hugging Face: the language model's keys gain ``model.`` (``layers.0.mlp.up_proj.weight`` is
``model.layers.0.mlp.up_proj.weight``), ``visual.*`` and ``lm_head.weight`` are the same; this is
the layout the Qwen2.5-VL checkpoints are published in, and what transformers 5 writes (its
in-memory names, ``model.language_model.*`` and ``model.visual.*``, are not a file layout).
Nothing is stacked or padded.
"""

from __future__ import annotations

from models.rename_weights import RenameWeights
from models.weight_adapter import Slot


class QwenVLWeights(RenameWeights):
    """Hugging Face Qwen2_5_VLForConditionalGeneration checkpoints <-> QwenVLForConditionalGeneration."""

    def from_hf(self, hf_key: str) -> Slot | None:
        if hf_key == "lm_head.weight" or hf_key.startswith("visual."):
            return Slot(hf_key)
        if hf_key.startswith("model.") and not hf_key.startswith(("model.language_model.", "model.visual.")):
            return Slot(hf_key.removeprefix("model."))
        return None

    def to_hf(self, key: str, slots: int | None = None) -> tuple[str, ...]:
        return (key if key == "lm_head.weight" or key.startswith("visual.") else f"model.{key}",)


QWEN_VL_WEIGHTS = QwenVLWeights()
"""The row's weight adapter."""
