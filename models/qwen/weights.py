"""The Qwen family's weight adapter (``ModelFamily.weights``, models/weight_adapter.py).

Our state-dict key is the Hugging Face key without the leading ``model.`` (``lm_head.weight`` is
the same in both): every key maps one-to-one, nothing is stacked.

Exactness padding: HF Qwen2 always has q/k/v biases and HF Qwen3 with ``attention_bias``
also has an o_proj bias. Where our model lacks such a bias the exporter writes zeros (the
same function), and the loader accepts such a tensor only if it is all zeros.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from models.weight_adapter import Slot

# Old exports stored RoPE's inverse frequencies; we recompute them. A sequence classifier's score
# head is read by the reward model itself (training/objectives/reward_model_io.py).
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq|score\.weight")
_ZERO_PADDING = re.compile(r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.bias")


def to_hf_key(key: str) -> str:
    return key if key == "lm_head.weight" else f"model.{key}"


def from_hf_key(hf_key: str) -> str:
    return hf_key if hf_key == "lm_head.weight" else hf_key.removeprefix("model.")


class QwenWeights:
    """Hugging Face Qwen2/Qwen3 checkpoints <-> QwenForCausalLM: a rename, plus zero biases."""

    def from_hf(self, hf_key: str) -> Slot | None:
        if hf_key != "lm_head.weight" and not hf_key.startswith("model."):
            return None
        return Slot(from_hf_key(hf_key))

    def to_hf(self, key: str, slots: int | None = None) -> tuple[str, ...]:
        return (to_hf_key(key),)

    def stacked(self, key: str) -> bool:
        return False

    def ignored(self, hf_key: str) -> bool:
        return _IGNORED.fullmatch(hf_key) is not None

    def zero_padding(self, hf_key: str) -> bool:
        return _ZERO_PADDING.fullmatch(hf_key) is not None

    def export_padding(self, model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        dims, padding = model.dims, {}
        for layer in range(dims.num_layers):
            prefix = f"model.layers.{layer}.self_attn"
            if not dims.qk_norm and not dims.qkv_bias:  # exported as Qwen2, which always has q/k/v bias
                for proj, width in (("q_proj", dims.q_width), ("k_proj", dims.kv_width), ("v_proj", dims.kv_width)):
                    padding[f"{prefix}.{proj}.bias"] = torch.zeros(width, dtype=dtype)
            if dims.qk_norm and dims.qkv_bias:  # exported as Qwen3 attention_bias=true, which biases o_proj too
                padding[f"{prefix}.o_proj.bias"] = torch.zeros(dims.hidden_size, dtype=dtype)
        return padding


QWEN_WEIGHTS = QwenWeights()
