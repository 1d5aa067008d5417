"""The linear layers of a Qwen block that LoRA may wrap, by module name (models/qwen/model.py).

``model.lora.targets`` defaults to all of them and accepts only these; core.config receives the
names through ``core.objective_kinds.register_lora_targets`` (training/registry.py) and names no module
of the model itself.
"""

from __future__ import annotations

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
