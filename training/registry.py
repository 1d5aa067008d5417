"""What the layers above core hand the config loader: every objective kind's settings, checks,
capabilities and objective class (training/objectives/*_settings.py), and the model family's LoRA
target names (models/qwen/lora_targets.py).

A new kind registers once: its ``<kind>_settings.py`` defines ``KIND = ObjectiveKind(name=...,
objective="training.objectives.<module>:<Class>", ...)``, and ``KIND`` is appended to
``OBJECTIVE_KINDS`` below (at its end).

core.config reads no config before this has run (core/objective_kinds.py) (it imports nothing above itself, so it
cannot look these up on its own). Every entry point calls ``register_all()`` first: train.py,
``python -m training``, ``python -m data``, ``python -m experiments``, the benchmarks,
scripts/config_reference.py and the tests (tests/conftest.py). Calling it again does nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from core.exceptions import ConfigError
from core.objective_kinds import register_lora_targets, register_objective, registered_names
from models.qwen.lora_targets import LORA_TARGETS
from training.objectives import (causal_lm_settings, distill_settings, dpo_settings, grpo_settings, ppo_settings,
                                 reward_model_settings, sft_settings)

# The order is the schema's: causal_lm first (objective.kind's default), then the kinds whose
# sections follow objective.kind in config.yaml and config.md.
OBJECTIVE_KINDS = (causal_lm_settings.KIND, sft_settings.KIND, grpo_settings.KIND, dpo_settings.KIND,
                   distill_settings.KIND, ppo_settings.KIND, reward_model_settings.KIND)


def register_all(*, objectives: Mapping[str, str] | None = None) -> None:
    """Register every objective kind and the LoRA target names with core.config.

    ``objectives`` (kind name -> ``module:Class``) builds another class for a kind, in the kind's
    place in the order: a test's entry script (tests/training/ppo_kill_train.py) does, in its
    own processes only, before train.main()'s own call, which then keeps what is registered."""
    replaced = dict(objectives or {})
    unknown = set(replaced) - {kind.name for kind in OBJECTIVE_KINDS}
    if unknown:
        raise ConfigError(f"no objective kind {sorted(unknown)} to build another class for", key="objective.kind")
    registered = registered_names()
    for kind in OBJECTIVE_KINDS:
        if kind.name in registered:
            continue  # registered before (a second call, or an entry script's own class for it): kept
        register_objective(dataclasses.replace(kind, objective=replaced[kind.name]) if kind.name in replaced else kind)
    register_lora_targets(LORA_TARGETS)
