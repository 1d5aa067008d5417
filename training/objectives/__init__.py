"""Training objectives: one per method, all driven by the same loop (base.py: the seam)."""

from __future__ import annotations

from core.config import Config
from training.objectives.base import LossOutput, Objective, ObjectiveContext
from training.objectives.causal_lm import CausalLMObjective
from training.objectives.distill import DistillObjective
from training.objectives.dpo import DPOObjective
from training.objectives.grpo import GRPOObjective
from training.objectives.ppo import PPOObjective
from training.objectives.reward_model import RewardModelObjective
from training.objectives.sft import SFTObjective

OBJECTIVES = {
    CausalLMObjective.name: CausalLMObjective,
    SFTObjective.name: SFTObjective,
    DPOObjective.name: DPOObjective,
    DistillObjective.name: DistillObjective,
    GRPOObjective.name: GRPOObjective,
    PPOObjective.name: PPOObjective,
    RewardModelObjective.name: RewardModelObjective,
}


def check_objective_config(config: Config) -> None:
    """What only the objective can check in a config, before any process group or run dir exists
    (a ConfigError, exit 2): an objective class may define ``check_config(config)``."""
    check = getattr(OBJECTIVES[config.objective.kind], "check_config", None)
    if check is not None:
        check(config)


def build_objective(config: Config) -> Objective:
    """The objective ``objective.kind`` names (config validation has checked the name)."""
    return OBJECTIVES[config.objective.kind](config)


__all__ = ["LossOutput", "Objective", "ObjectiveContext", "build_objective", "check_objective_config", "OBJECTIVES"]
