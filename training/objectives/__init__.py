"""Training objectives: one per method, all driven by the same loop (base.py: the seam)."""

from __future__ import annotations

from core.config import Config
from training.objectives.base import LossOutput, Objective, ObjectiveContext
from training.objectives.causal_lm import CausalLMObjective
from training.objectives.sft import SFTObjective

OBJECTIVES = {
    CausalLMObjective.name: CausalLMObjective,
    SFTObjective.name: SFTObjective,
}


def build_objective(config: Config) -> Objective:
    """The objective ``objective.kind`` names (config validation has checked the name)."""
    return OBJECTIVES[config.objective.kind](config)


__all__ = ["LossOutput", "Objective", "ObjectiveContext", "build_objective", "OBJECTIVES"]
