"""The reward list of a method that scores rollouts (``objective.grpo.rewards``, ``objective.ppo.rewards``).

One settings class, ``RewardSettings``, and its checks, owned by the rollout room so GRPO and PPO
read the same keys the same way: a built-in rule reward (rewards.py), a user function
``package.module:function``, or ``model``, a trained reward model named by ``path`` (scored by
training/objectives/model_reward.py). ``section`` below is a method's settings (anything with a
``rewards`` tuple) and ``key`` its config key (``objective.grpo``), for errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from core.config_errors import raise_together
from core.exceptions import ConfigError
from training.rollout.rewards import STRIPS_THINKING, RewardFunction, resolve_reward, strip_thinking_error

MODEL_REWARD = "model"
"""The reward name of a trained reward model (training/objectives/model_reward.py)."""


@dataclass(frozen=True)
class RewardSettings:
    name: str = "exact_answer"
    """A built-in reward (exact_answer, numeric_tolerance, format_regex), model (a trained reward model: path), or a user function 'package.module:function' (docs/post_training.md)."""
    weight: float = 1.0
    """Weight of this reward in the sum that scores a completion."""
    pattern: str = ""
    """format_regex: the pattern the whole stripped completion must match."""
    tol: float = 0.0
    """numeric_tolerance: largest absolute difference from the answer that still passes."""
    strip_thinking: bool = False
    """exact_answer, numeric_tolerance: compare only the text after the completion's last </think> (an unclosed <think> scores 0), so a reasoning model's think block is not part of its answer."""
    path: str = ""
    """model: the reward model, run:RUN_ID[@STEP] (a reward_model run) or its Hugging Face sequence-classification export; its score of the prompt + completion is the reward."""


def check_rewards(section: Any, key: str) -> None:
    """At least one reward, finite weights, a path exactly where the reward is a model, and
    strip_thinking only on a reward that compares an answer (ConfigError): every violated one
    (core/config_errors.py)."""
    if len(section.rewards) < 1:
        raise ConfigError(f"{key}.rewards must be a list of at least one reward, got {section.rewards!r}",
                          key=f"{key}.rewards")
    found = []
    for i, reward in enumerate(section.rewards):
        if not math.isfinite(reward.weight):
            found.append(ConfigError(f"{key}.rewards[{i}].weight must be finite", key=f"{key}.rewards[{i}].weight"))
        if (reward.name == MODEL_REWARD) != bool(reward.path):
            found.append(ConfigError(
                f"{key}.rewards[{i}]: path names the reward model of a reward named {MODEL_REWARD!r}, "
                f"got name {reward.name!r} with path {reward.path!r}", key=f"{key}.rewards[{i}].path",
                hint="{name: model, path: run:RUN_ID | HF_DIR}; other rewards take no path"))
        if reward.strip_thinking and reward.name not in STRIPS_THINKING:
            found.append(strip_thinking_error(reward.name, f"{key}.rewards[{i}]"))
    raise_together(found)


def resolve_rule_rewards(section: Any, key: str) -> list[RewardFunction]:
    """The configured rule rewards, resolved (model rewards are left to the objective): an unknown
    name or a function path that does not import is a ConfigError naming ``{key}.rewards[i].name``."""
    return [resolve_reward(r.name, weight=r.weight, pattern=r.pattern, tol=r.tol, strip_thinking=r.strip_thinking,
                           key=f"{key}.rewards[{i}]")
            for i, r in enumerate(section.rewards) if r.name != MODEL_REWARD]


def model_rewards(section: Any, key: str) -> dict[str, RewardSettings]:
    """{config key of its path: settings} of each configured model reward, in order."""
    return {f"{key}.rewards[{i}].path": r for i, r in enumerate(section.rewards) if r.name == MODEL_REWARD}
