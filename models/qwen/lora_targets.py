"""The linear layers of a Qwen block that LoRA may wrap, by module name (models/qwen/model.py).

The Qwen rows (models/qwen/family.py) declare them as their ``lora_targets``: ``model.lora.targets``
defaults to all of them and accepts only these, and models/lora.py lists them in this order.
"""

from __future__ import annotations

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
