"""``objective.<kind>.environment``: the settings of multi-turn episodes (docs/post_training.md,
Agentic rollouts), their checks, and the episode runner's limits made from them. A method that
plays episodes (GRPO, PPO) holds an ``Optional[EnvironmentSettings]`` in its settings, hashed only when
set, and calls ``validate_environment`` from its own checks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from core.config_errors import raise_together
from core.exceptions import ConfigError

if TYPE_CHECKING:
    from training.rollout.episodes import EpisodeLimits


@dataclass(frozen=True)
class EnvironmentSettings:
    name: str = "calculator"
    """The environment of multi-turn episodes: calculator (data/calculator.py's tool; the final answer scored by the method's rewards) or a class 'package.module:Class' (docs/post_training.md, Agentic rollouts)."""
    max_turns: int = 4
    """Assistant turns sampled per episode at most; the last one is scored as the answer."""
    max_calls_per_turn: int = 4
    """Tool calls answered per turn (calculator); further calls get an error message."""
    max_observation_tokens: int = 64
    """An observation (a turn's rendered tool messages) longer than this ends the episode (truncated)."""
    max_episode_tokens: int = 256
    """Sampled plus observation tokens after the prompt, at most (also bounded by data.seq_len)."""
    tool_timeout_s: float = 30.0
    """Wall-clock seconds the environment may take to answer one turn of one episode."""
    on_env_error: Literal["error", "zero"] = "error"
    """An environment that raises, answers with something other than a Transition or takes too long: stop with a typed error, or end the episode with reward 0 and count it (ledger env_errors)."""


def validate_environment(e: EnvironmentSettings, section: str, *, max_new_tokens: int, model_rewards: bool) -> None:
    """The limits of ``<section>.environment`` (section: the method's settings, objective.<kind>), and
    the method's rewards: rule rewards only (``model_rewards``: the method has a model reward). Every
    violated one (core/config_errors.py); max_episode_tokens is asked once max_new_tokens is valid
    (the method's own check names it)."""
    key = f"{section}.environment"
    checks = (
        ("name", bool(e.name), "an environment name (calculator) or 'package.module:Class'"),
        ("max_turns", 1 <= e.max_turns <= 64, "in 1..64"),
        ("max_calls_per_turn", e.max_calls_per_turn >= 1, ">= 1"),
        ("max_observation_tokens", e.max_observation_tokens >= 1, ">= 1"),
        ("max_episode_tokens", max_new_tokens < 1 or e.max_episode_tokens >= max_new_tokens,
         f">= max_new_tokens ({max_new_tokens}): one turn must fit"),
        ("tool_timeout_s", math.isfinite(e.tool_timeout_s) and e.tool_timeout_s > 0, "> 0"),
        ("on_env_error", e.on_env_error in ("error", "zero"), "error or zero"),
    )
    found = [ConfigError(f"{key}.{name} must be {expected}, got {getattr(e, name)!r}", key=f"{key}.{name}")
             for name, ok, expected in checks if not ok]
    if model_rewards:
        found.append(ConfigError(
            f"{section}.rewards: a model reward scores one completion, not an episode of several turns",
            key=f"{section}.rewards", hint="rule rewards score an episode's final answer"))
    raise_together(found)


def episode_limits(e: EnvironmentSettings, section: str) -> "EpisodeLimits":
    """The episode runner's limits from ``<section>.environment`` (section: objective.<kind>)."""
    from training.rollout.episodes import EpisodeLimits  # torch: only where a run builds its episodes

    return EpisodeLimits(name=e.name, max_turns=e.max_turns, max_observation_tokens=e.max_observation_tokens,
                         max_episode_tokens=e.max_episode_tokens, timeout_s=e.tool_timeout_s, on_error=e.on_env_error,
                         key=f"{section}.environment")
