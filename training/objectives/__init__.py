"""Training objectives: one per method, all driven by the same loop (base.py: the seam).

A kind registers once: its ``KIND`` (``<kind>_settings.py``) names its objective class by import
path (``ObjectiveKind.objective``), and training/registry.py hands every ``KIND`` to
core.objective_kinds. The class is imported here, from the registered kind, when a run builds it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from core.config import Config
from core.exceptions import ConfigError
from core.objective_kinds import objective_kind

if TYPE_CHECKING:
    from training.objectives.base import Objective

_BASE = ("LossOutput", "Objective", "ObjectiveContext")


def __getattr__(name: str):
    """The seam's types (base.py), imported when first read: the kinds' settings modules of this
    package are read by the config loader without torch (training/registry.py)."""
    if name not in _BASE:
        raise AttributeError(f"module 'training.objectives' has no attribute {name!r}")
    value = getattr(importlib.import_module("training.objectives.base"), name)
    globals()[name] = value
    return value


def objective_class(kind: str) -> type:
    """The objective class the registered kind ``kind`` names (``ObjectiveKind.objective``)."""
    path = objective_kind(kind).objective
    module, _, name = path.partition(":")
    if not module or not name:
        raise ConfigError(f"objective.kind {kind!r} names no objective class ({path!r}); its KIND must name one "
                          "as 'module:Class'", key="objective.kind", hint="set objective= in the kind's ObjectiveKind")
    found = getattr(importlib.import_module(module), name, None)
    if not isinstance(found, type):
        raise ConfigError(f"objective.kind {kind!r}: {path!r} is not a class", key="objective.kind",
                          hint="set objective= in the kind's ObjectiveKind to 'module:Class'")
    return found


def check_objective_config(config: Config) -> None:
    """What only the objective can check in a config, before any process group or run dir exists
    (a ConfigError, exit 2): an objective class may define ``check_config(config)``."""
    check = getattr(objective_class(config.objective.kind), "check_config", None)
    if check is not None:
        check(config)


def build_objective(config: Config) -> "Objective":
    """The objective ``objective.kind`` names (config validation has checked the name)."""
    return objective_class(config.objective.kind)(config)


__all__ = ["LossOutput", "Objective", "ObjectiveContext", "build_objective", "check_objective_config",
           "objective_class"]
