"""What the layers above core hand the config loader: every objective kind's settings, checks,
capabilities and objective class (training/objectives/*_settings.py), every model family's row
(models/qwen/family.py), the checks of the sections other layers read (``CONFIG_CHECKS``), and the
functions a lower layer's command line asks for by name (``PROVIDERS``).

A new kind registers once: its ``<kind>_settings.py`` defines ``KIND = ObjectiveKind(name=...,
objective="training.objectives.<module>:<Class>", ...)``, and ``KIND`` is appended to
``OBJECTIVE_KINDS`` below (at its end).

core.config reads no config before this has run: it imports nothing above itself, so it is given
this function by name (core/registration.py, ``training.registry:register_all``) and calls it before
it reads a config; entry points may call it first themselves (train.py, tests/conftest.py). Calling
it again does nothing. Nothing here imports torch (the launcher checks a config before torch).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from core.exceptions import ConfigError
from core.config_checks import register_check
from core.model_families import register_family
from core.objective_kinds import register_objective, registered_names, replace_objective
from core.registration import register_provider
from data.record_kinds import register_built_in_kinds
from models.qwen.family import FAMILIES
from models.qwen3_moe.family import FAMILIES as MOE_FAMILIES
from models.qwen3_vl.family import FAMILIES as QWEN3_VL_FAMILIES
from models.qwen_vl.family import FAMILIES as QWEN_VL_FAMILIES
from training.objectives import (causal_lm_settings, distill_settings, dpo_settings, grpo_settings, ppo_settings,
                                 reward_model_settings, sft_settings)

# The order is the schema's: causal_lm first (objective.kind's default), then the kinds whose
# sections follow objective.kind in config.yaml and config.md.
OBJECTIVE_KINDS = (causal_lm_settings.KIND, sft_settings.KIND, grpo_settings.KIND, dpo_settings.KIND,
                   distill_settings.KIND, ppo_settings.KIND, reward_model_settings.KIND)

# (name, module:function): core.config.validate runs them in this order, after core's own checks.
CONFIG_CHECKS = (
    ("parallel", "distributed.config_checks:validate_parallel"),
    ("optimizer", "training.optimizers.config_checks:validate_optimizer"),
    ("float8", "distributed.config_checks:validate_float8"),
    ("model", "models.config_checks:validate_model"),
)

# (name, module:function) for core.registration.provider: python -m experiments runs episodes
# decodes a run's token ids with the data layer's tokenizer.
PROVIDERS = (("tokenizer", "data.tokenizers:build_tokenizer"),)


def register_all(*, objectives: Mapping[str, str] | None = None) -> None:
    """Register every objective kind, model family, config check and provider with core.

    ``objectives`` (kind name -> ``module:Class``) builds another class for a kind, in the kind's
    place in the order: a test's entry script (tests/training/ppo_kill_train.py) does, in its
    own processes only, before train.main()'s own call, which then keeps what is registered."""
    replaced = dict(objectives or {})
    unknown = set(replaced) - {kind.name for kind in OBJECTIVE_KINDS}
    if unknown:
        raise ConfigError(f"no objective kind {sorted(unknown)} to build another class for", key="objective.kind")
    registered = registered_names()
    for kind in OBJECTIVE_KINDS:
        row = dataclasses.replace(kind, objective=replaced[kind.name]) if kind.name in replaced else kind
        if kind.name in replaced and kind.name in registered:
            replace_objective(row)  # registered already (the process imported a registry first): rebuilt in place
        elif kind.name not in registered:  # else registered before (a second call, or an entry script's own class): kept
            register_objective(row)
    for family in (*FAMILIES, *QWEN_VL_FAMILIES, *MOE_FAMILIES, *QWEN3_VL_FAMILIES):
        register_family(family)
    for name, path in CONFIG_CHECKS:
        register_check(name, path)
    for name, path in PROVIDERS:
        register_provider(name, path)
    register_built_in_kinds()  # data.sources[i].record's names (data/record_kinds.py)
