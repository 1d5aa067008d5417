"""The linear layers of a Qwen block that LoRA may wrap, by module name (models/qwen/model.py).

``model.lora.targets`` defaults to all of them and accepts only these; core.config receives the
names through ``core.objective_kinds.register_lora_targets`` (training/registry.py) and names no module
of the model itself.
"""

from __future__ import annotations

from core.objective_kinds import register_lora_targets

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Registered as soon as the family is imported (models/__init__.py imports this module), so that a
# process that builds a ModelConfig without an entry point (a spawned test worker, a notebook)
# has the names; training/registry.py registers the same names again, which is allowed.
register_lora_targets(LORA_TARGETS)
