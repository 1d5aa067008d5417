"""The Qwen3-MoE family's weight adapter (``ModelFamily.weights``, models/weight_adapter.py).

Keys are Qwen's (the Hugging Face key without the leading ``model.``), except each block's experts:
the checkpoints hold one tensor per expert, ``model.layers.N.mlp.experts.<e>.gate_proj.weight``
(and ``up_proj``, ``down_proj``), which the model stacks as slot ``e`` of
``layers.N.mlp.experts.gate_proj`` (many-to-one). That is the layout of the Hub's Qwen3-MoE
checkpoints and of transformers' ``save_pretrained`` (whose modules fuse gate and up in memory).

Zero padding as Qwen3's (models/qwen/weights.py): a checkpoint with ``attention_bias`` has an o_proj
bias our model lacks, accepted only if all zeros and written as zeros by an export with q/k/v bias.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from models.qwen.weights import QWEN_WEIGHTS, from_hf_key, to_hf_key
from models.weight_adapter import Slot

_THEIR_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_OUR_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)")


class Qwen3MoeWeights:
    """Hugging Face Qwen3-MoE checkpoints <-> Qwen3MoeForCausalLM: Qwen's rename, experts stacked."""

    def from_hf(self, hf_key: str) -> Slot | None:
        match = _THEIR_EXPERT.fullmatch(hf_key)
        if match is not None:
            return Slot(f"layers.{match.group(1)}.mlp.experts.{match.group(3)}", int(match.group(2)))
        if hf_key != "lm_head.weight" and not hf_key.startswith("model."):
            return None
        return Slot(from_hf_key(hf_key))

    def to_hf(self, key: str, slots: int | None = None) -> tuple[str, ...]:
        match = _OUR_EXPERTS.fullmatch(key)
        if match is None:
            return (to_hf_key(key),)
        if slots is None:
            raise ValueError(f"{key} stacks one tensor per expert: to_hf needs its number of slots")
        layer, proj = match.groups()
        return tuple(f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(slots))

    def stacked(self, key: str) -> bool:
        return _OUR_EXPERTS.fullmatch(key) is not None

    def ignored(self, hf_key: str) -> bool:
        return QWEN_WEIGHTS.ignored(hf_key)

    def zero_padding(self, hf_key: str) -> bool:
        return QWEN_WEIGHTS.zero_padding(hf_key)

    def export_padding(self, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        dims = model.dims
        if not dims.qkv_bias:
            return {}
        return {f"model.layers.{layer}.self_attn.o_proj.bias": torch.zeros(dims.hidden_size, dtype=dtype)
                for layer in range(dims.num_layers)}


WEIGHTS = Qwen3MoeWeights()
"""The row's weight adapter."""
