"""A method's multi-turn side, built from ``objective.<kind>.environment`` (environment_settings.py):
what GRPO and PPO both need to play episodes, in one place.

- the environment: the single-turn ``RewardEnvironment`` of the method's rewards when no
  environment is set, else the configured tool environment (``resolve_environment``: a class path
  that does not import is a ConfigError naming ``objective.<kind>.environment.name``, exit 2);
- the ``EpisodeRunner`` over the method's generator, whose observations are the environment's
  tool messages rendered by the chat template (``observation_ids``);
- a step's recorded episodes for ``GroupRollout.collect`` (episode_store.py: a replay appends
  them without calling the environment, a resumed step compares with them);
- writing a step's episodes to the run dir, on rank 0, from every rank's experience summaries
  (the ledger's episode fields come from the same summaries: ``rollout_fields(episodes=True)``).

Without an environment every method here is a no-op, so a method calls them unconditionally.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from core.distributed_context import DistributedContext
from experiments.console import ConsoleField
from training.rollout.environment import Environment, RewardEnvironment
from training.rollout.environment_settings import EnvironmentSettings, episode_limits
from training.rollout.episode_store import step_records, write_episodes
from training.rollout.episodes import EpisodeRunner
from training.rollout.experience import episode_records
from training.rollout.generator import Decoder, Generator
from training.rollout.rewards import RewardFunction
from training.rollout.tool_environment import resolve_environment


class AgentRollouts:
    """The environment of ``settings`` (None: single-turn rollouts) for the method whose settings are
    ``section`` (``objective.grpo``), and what playing its episodes needs (module docstring)."""

    def __init__(self, settings: Optional[EnvironmentSettings], *, rewards: list[RewardFunction],
                 on_reward_error: str, section: str, tokenizer, template) -> None:
        self.settings, self.section, self.tokenizer, self.template = settings, section, tokenizer, template
        self.environment: Environment = (
            RewardEnvironment(rewards, on_error=on_reward_error) if settings is None else
            resolve_environment(settings.name, rewards=rewards, on_reward_error=on_reward_error,
                                max_calls_per_turn=settings.max_calls_per_turn, key=environment_key(section)))

    @property
    def plays_episodes(self) -> bool:
        return self.settings is not None

    @staticmethod
    def check(settings: Optional[EnvironmentSettings], *, rewards: list[RewardFunction], section: str) -> None:
        """Refuse now (exit 2, before any run dir) an environment that does not resolve."""
        if settings is not None:
            resolve_environment(settings.name, rewards=rewards, on_reward_error="error",
                                max_calls_per_turn=settings.max_calls_per_turn, key=environment_key(section))

    def runner(self, generator: Generator, decoder: Decoder, *, context: int) -> Optional[EpisodeRunner]:
        """The episode runner over ``generator`` (None without an environment); ``context`` is
        data.seq_len, the longest sequence an episode may reach."""
        if self.settings is None:
            return None
        return EpisodeRunner(generator=generator, decoder=decoder, environment=self.environment,
                             limits=episode_limits(self.settings, self.section), render=self.observation_ids, context=context)

    def observation_ids(self, messages: list[dict]) -> list[int]:
        """The ids an episode appends for a turn's tool messages (the template's observation_text)."""
        text = self.template.observation_text(messages, tools=self.environment.tools or None)
        return [int(t) for t in self.tokenizer.encode_array(text)]

    def recorded(self, run_dir: Optional[Path], step: int, group_size: int, *, replay: bool) -> dict[str, Any]:
        """``GroupRollout.collect``'s ``recorded`` and ``call_environment`` for step ``step``
        (episode_store.step_records); nothing without an environment or a run dir."""
        if self.settings is None or run_dir is None:
            return {}
        return step_records(run_dir, step, group_size, replay=replay)

    def write(self, run_dir: Optional[Path], step: int, parts: list[dict[str, Any]], *, records: bool,
              dist: DistributedContext) -> None:
        """Write step ``step``'s episodes from every rank's ``Experience.summary()`` (rank 0 of a
        recording run with a run dir only)."""
        if self.settings is not None and records and run_dir is not None and dist.is_main:
            write_episodes(run_dir, step, {row: record for row, (_, record) in episode_records(parts).items()})


def episode_console_fields(settings: Optional[EnvironmentSettings]) -> tuple[ConsoleField, ...]:
    """The step line's fields of a method that plays episodes: the tool calls its episodes wrote and
    the malformed ones (ledger fields ``tool_calls``, ``malformed_calls``; means over a log interval);
    none without an environment."""
    if settings is None:
        return ()
    return (ConsoleField("tool calls", "tool_calls", ".1f"), ConsoleField("malformed calls", "malformed_calls", ".1f"))


def environment_key(section: str) -> str:
    """The config key errors about a method's environment name."""
    return f"{section}.environment.name"
