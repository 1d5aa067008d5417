"""``objective.kind=grpo``: its settings (``objective.grpo``), checks and capabilities.

Everything the config loader needs to know about GRPO lives here and reaches core.config
through ``KIND`` (registered by training/registry.py); the method itself is grpo.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from core.config import Config
from core.config_errors import check_independent, raise_together
from core.exceptions import ConfigError
from core.objective_kinds import ObjectiveCapabilities, ObjectiveKind
from data.record_kinds import record_kind
from training.objectives.rollout_correction_settings import RolloutCorrectionSettings, validate_rollout_correction
from training.rollout.environment_settings import EnvironmentSettings, validate_environment
from training.rollout.reward_settings import RewardSettings, check_rewards, resolve_rule_rewards
from training.rollout.reward_settings import model_rewards as _model_rewards


@dataclass(frozen=True)
class GRPOSettings:
    group_size: int = 4
    """Completions sampled per prompt; advantages are normalized within each prompt's group."""
    max_new_tokens: int = 32
    """Generated tokens per completion at most (fewer where data.seq_len ends first)."""
    eval_samples: int = 0
    """Held-out evaluation: completions sampled per prompt for sampled pass@1 (metrics.sampled_accuracy); 0: greedy only."""
    eval_temperature: float = 1.0
    """Held-out evaluation: temperature of the eval_samples completions (> 0; used only when eval_samples > 0)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (> 0)."""
    top_p: float = 1.0
    """Nucleus filter of the rollouts (1 keeps all tokens)."""
    top_k: int = 0
    """Top-k filter of the rollouts (0 keeps all tokens)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the frozen reference; 0 builds no reference."""
    clip_eps_low: float = 0.2
    """The ratio is clipped to [1 - clip_eps_low, 1 + clip_eps_high]."""
    clip_eps_high: float = 0.2
    """Upper clip range (DAPO's clip-higher when larger than clip_eps_low)."""
    importance: Literal["token", "sequence"] = "token"
    """token: per-token ratios (GRPO); sequence: one length-normalized ratio per completion (GSPO)."""
    loss_norm: Literal["sequence", "token", "dr_grpo"] = "sequence"
    """sequence: mean over each completion's tokens, then over completions; token: mean over all completion tokens of the batch (DAPO); dr_grpo: sum over tokens / (completions x max_new_tokens)."""
    std_eps: float = 1.0e-4
    """Added to the group's reward standard deviation before dividing (advantage = (r - mean) / (std + eps))."""
    advantage_std: Literal["population", "unbiased", "none"] = "population"
    """The group's reward standard deviation: population (divide by G) or unbiased (G - 1, TRL's; sqrt(G / (G - 1)) larger); none: advantage = r - mean, not divided (Dr. GRPO)."""
    overlong_buffer: int = 0
    """DAPO soft overlong shaping: a completion longer than max_new_tokens - overlong_buffer tokens gets a penalty growing linearly to -1 at max_new_tokens, added to its reward; 0: off."""
    mask_truncated: bool = False
    """DAPO: completions that end at max_new_tokens or data.seq_len without a stop token carry no loss (nor count in its normalizer)."""
    dynamic_sampling_rounds: int = 0
    """DAPO dynamic sampling: a group whose (shaped) rewards are all equal is re-sampled with fresh keys, for at most this many extra rollout rounds per step; 0: off."""
    reference: str = "init"
    """Frozen reference for the KL term: init, a Hugging Face directory, or run:RUN_ID[@STEP]."""
    rewards: tuple[RewardSettings, ...] = (RewardSettings(),)
    """Rewards summed with their weights into a completion's score."""
    on_reward_error: Literal["error", "zero"] = "error"
    """A reward function that raises or returns a non-finite value: stop with a typed error, or score 0 and count it."""
    inner_updates: int = 1
    """Optimizer updates per rollout batch, within one loop step (the step's ledger line lists each one's loss)."""
    environment: Optional[EnvironmentSettings] = None
    """Multi-turn episodes with tools (docs/post_training.md, Agentic rollouts); null: one completion per sample, scored by the rewards."""
    rollout_slots: int = 0
    """Sampler rows (KV-cache rows per forward) of the rollouts; 0: one row per completion of a step (group_size x global_batch_size / data.num_streams). Fewer rows refill finished ones with pending completions (docs/models.md, Scheduling): less memory, and a step with mixed completion lengths costs about their mean; the completions may differ from those of another row count (last bits, and a token where they flip a draw)."""
    rollout_correction: Optional[RolloutCorrectionSettings] = None
    """Truncated (TIS) and masked (MIS) importance sampling between the sampler's log-probs and the trainer's, for rollouts not sampled bit for bit as the trainer computes (docs/post_training.md, Rollout correction); costs one more policy forward per step; null: off."""


def validate(config: Config) -> None:
    """objective.grpo.* (docs/post_training.md, GRPO) and what GRPO needs of data.* and train.*, every
    violated constraint (core/config_errors.py); reward function paths are resolved by
    ``resolve_rewards`` (they import user code)."""
    check_independent(config, (
        _check_settings,
        lambda view: check_rewards(view.objective.grpo, "objective.grpo"),
        lambda view: validate_rollout_correction(view.objective.grpo.rollout_correction, "objective.grpo"),
        _check_model_reward_sampling,
        _check_environment,
        _check_environment_sampling,
        lambda view: check_prompt_data(view, "grpo",
                                       eval_hint="use data.eval_source and objective.grpo.eval_samples with grpo"),
    ))


def _check_settings(config: Config) -> None:
    """The sizes and coefficients of objective.grpo (overlong_buffer asked once max_new_tokens is valid)."""
    g, key = config.objective.grpo, "objective.grpo"
    checks = (
        ("group_size", g.group_size >= 2, ">= 2 (advantages compare completions of one prompt)"),
        ("max_new_tokens", g.max_new_tokens >= 1, ">= 1"),
        ("eval_samples", g.eval_samples >= 0, ">= 0 (0: greedy evaluation only)"),
        ("eval_temperature", math.isfinite(g.eval_temperature) and g.eval_temperature > 0, "> 0"),
        ("temperature", math.isfinite(g.temperature) and g.temperature > 0, "> 0 (greedy groups have no variance)"),
        ("top_p", 0 < g.top_p <= 1, "in (0, 1]"),
        ("top_k", g.top_k >= 0, ">= 0"),
        ("kl_coef", math.isfinite(g.kl_coef) and g.kl_coef >= 0, ">= 0"),
        ("clip_eps_low", 0 <= g.clip_eps_low < 1, "in [0, 1)"),
        ("clip_eps_high", math.isfinite(g.clip_eps_high) and g.clip_eps_high >= 0, ">= 0"),
        ("std_eps", math.isfinite(g.std_eps) and g.std_eps > 0, "> 0"),
        ("overlong_buffer", g.max_new_tokens < 1 or 0 <= g.overlong_buffer <= g.max_new_tokens,
         f"in 0..max_new_tokens ({g.max_new_tokens}; 0: no overlong shaping)"),
        ("dynamic_sampling_rounds", 0 <= g.dynamic_sampling_rounds <= 16, "in 0..16 (0: no dynamic sampling)"),
    )
    found = [ConfigError(f"{key}.{name} must be {expected}, got {getattr(g, name)!r}", key=f"{key}.{name}")
             for name, ok, expected in checks if not ok]
    if g.rollout_slots < 0:
        found.append(ConfigError(
            f"{key}.rollout_slots must be >= 0, got {g.rollout_slots}", key=f"{key}.rollout_slots",
            hint="0: one sampler row per completion of a step; n: n rows, refilled as completions end"))
    if not 1 <= g.inner_updates <= 64:
        found.append(ConfigError(
            f"{key}.inner_updates must be in 1..64, got {g.inner_updates}",
            key=f"{key}.inner_updates",
            hint="the optimizer updates made on each rollout batch; 1 is GRPO as published",
        ))
    raise_together(found)


def _check_model_reward_sampling(config: Config) -> None:
    key = "objective.grpo"
    if model_rewards(config) and config.objective.grpo.dynamic_sampling_rounds > 0:
        raise ConfigError(f"{key}.dynamic_sampling_rounds: a model reward scores a whole rollout batch after it is "
                          "sampled, and dynamic sampling re-samples groups while the rollout is collected",
                          key=f"{key}.dynamic_sampling_rounds",
                          hint="dynamic_sampling_rounds: 0 with a model reward (its scores are rarely all equal)")


def _check_environment(config: Config) -> None:
    g = config.objective.grpo
    if g.environment is not None:
        validate_environment(g.environment, "objective.grpo", max_new_tokens=g.max_new_tokens,
                             model_rewards=bool(model_rewards(config)))


def _check_environment_sampling(config: Config) -> None:
    key = "objective.grpo"
    if config.objective.grpo.environment is not None and config.objective.grpo.dynamic_sampling_rounds > 0:
        raise ConfigError(f"{key}.dynamic_sampling_rounds: not with an environment (episodes are recorded per "
                          "global row; a re-sampled group would need its own record)",
                          key=f"{key}.dynamic_sampling_rounds", hint="dynamic_sampling_rounds: 0 with an environment")


def check_prompt_data(config: Config, kind: str, *, eval_hint: str) -> None:
    """What a method that samples from prompts (GRPO, PPO) needs of data.* and train.eval_generate:
    prompt records only, a held-out source of prompts, and its own evaluation; every violated one."""
    check_independent(config, (lambda view: _check_prompt_sources(view, kind),
                               lambda view: _check_held_out_prompts(view, kind),
                               lambda view: _check_no_eval_generate(view, kind, eval_hint)))


def _check_prompt_sources(config: Config, kind: str) -> None:
    if not config.data.sources or not all(record_kind(s.record).one_per_row for s in config.data.sources):
        raise ConfigError(f"objective.kind={kind} needs prompt sources only (data.sources[i].record: prompt)",
                          key="data.sources", hint='records {"prompt": ..., "answer": ...}; e.g. datasets/tasks/rl')


def _check_held_out_prompts(config: Config, kind: str) -> None:
    held_out, eval_interval = config.data.eval_source, config.train.eval_interval
    if held_out is not None and eval_interval > 0 and not record_kind(held_out.record).one_per_row:
        raise ConfigError(
            f"objective.kind={kind} evaluates prompt records, data.eval_source is record: {held_out.record}",
            key="data.eval_source.record",
            hint='records {"prompt": ..., "answer": ...}; e.g. datasets/tasks/rl/eval, or data.eval_source=null')


def _check_no_eval_generate(config: Config, kind: str, eval_hint: str) -> None:
    if config.train.eval_generate.source is not None:
        raise ConfigError(f"train.eval_generate: objective.kind={kind} evaluates its prompts itself (data.eval_source)",
                          key="train.eval_generate.source", hint=eval_hint)


def resolve_rewards(config: Config) -> list:
    """The configured rule rewards, resolved: an unknown name or a function path that does not
    import is a ConfigError naming objective.grpo.rewards[i].name (exit 2, before any process
    group or run dir: training.objectives.check_objective_config)."""
    return resolve_rule_rewards(config.objective.grpo, "objective.grpo")


def model_rewards(config: Config) -> dict[str, RewardSettings]:
    """{config key of its path: settings} of each configured model reward, in order."""
    return _model_rewards(config.objective.grpo, "objective.grpo")


KIND = ObjectiveKind(
    name="grpo",
    summary="reinforcement learning on prompts with checkable answers",
    objective="training.objectives.grpo:GRPOObjective",
    # Rollouts decode at a new length every step (no CUDA graphs); a step's tokens grow with
    # group_size; the completions answer through the chat template.
    capabilities=ObjectiveCapabilities(cuda_graph_safe=False, chat_model=True),
    settings=GRPOSettings,
    validate=validate,
    resumable=("eval_samples", "eval_temperature"),  # an evaluation only: the ledger does not depend on them
    hashed_only_when_set=("advantage_std", "overlong_buffer", "mask_truncated", "dynamic_sampling_rounds",
                          "rollout_slots", "rewards[].path", "rewards[].strip_thinking", "environment",
                          "rollout_correction"),
    hash_default_section=True,
)
