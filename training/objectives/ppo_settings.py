"""``objective.kind=ppo``: its settings (``objective.ppo``), checks and capabilities.

Everything the config loader needs to know about PPO lives here and reaches core.config
through ``KIND`` (registered by training/registry.py); the method itself is ppo.py, its
formulas ppo_loss.py and its critic critic.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from core.config import Config
from core.config_errors import check_independent, raise_together
from core.exceptions import ConfigError
from core.objective_kinds import ObjectiveCapabilities, ObjectiveKind
from training.objectives.grpo_settings import check_prompt_data
from training.objectives.rollout_correction_settings import RolloutCorrectionSettings, validate_rollout_correction
from training.rollout.environment_settings import EnvironmentSettings, validate_environment
from training.rollout.reward_settings import RewardSettings, check_rewards, resolve_rule_rewards
from training.rollout.reward_settings import model_rewards as _model_rewards


@dataclass(frozen=True)
class PPOSettings:
    group_size: int = 1
    """Completions sampled per prompt (1: one per prompt, as PPO is published); each is its own episode, the critic is the baseline."""
    max_new_tokens: int = 32
    """Generated tokens per completion at most (fewer where data.seq_len ends first)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (> 0)."""
    top_p: float = 1.0
    """Nucleus filter of the rollouts (1 keeps all tokens)."""
    top_k: int = 0
    """Top-k filter of the rollouts (0 keeps all tokens)."""
    rewards: tuple[RewardSettings, ...] = (RewardSettings(),)
    """Rewards summed with their weights into a completion's score (the same rewards as objective.grpo.rewards, a trained reward model included)."""
    on_reward_error: Literal["error", "zero"] = "error"
    """A reward function that raises or returns a non-finite value: stop with a typed error, or score 0 and count it."""
    kl_coef: float = 0.05
    """Weight of the per-token KL penalty in the rewards (the adaptive controller's starting value); 0 with kl_target 0 builds no reference."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """The per-token KL estimate of log p - log p_ref: k1 = d, k2 = d^2 / 2, k3 = exp(-d) + d - 1."""
    kl_target: float = 0.0
    """Adaptive KL: the per-completion KL the coefficient steers toward; 0 keeps kl_coef fixed."""
    kl_horizon: int = 10000
    """Adaptive KL: completions over which the coefficient moves by at most 20%."""
    reference: str = "init"
    """Frozen reference for the KL penalty: init, a Hugging Face directory, or run:RUN_ID[@STEP]."""
    critic: str = "init"
    """The critic's trunk: init (a copy of the policy's starting weights), a Hugging Face directory, or run:RUN_ID[@STEP]."""
    critic_lr: float = 1.0e-4
    """The critic's learning rate (its optimizer and schedule are otherwise train.*)."""
    gamma: float = 1.0
    """GAE discount per response token."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = True
    """Whiten the advantages over the rollout batch's response tokens: (A - mean) / sqrt(var + 1e-8), var unbiased."""
    clip_low: float = 0.2
    """The ratio is clipped to [1 - clip_low, 1 + clip_high]."""
    clip_high: float = 0.2
    """Upper clip range."""
    dual_clip: float = 0.0
    """Dual clip c > 1: the loss of a negative advantage is capped at -c A; 0 is off."""
    value_clip: float = 0.2
    """The critic's new value is clipped to old value +- value_clip in the clipped value loss."""
    vf_coef: float = 0.5
    """Weight of the value loss in the step's loss."""
    ppo_epochs: int = 1
    """Passes over one rollout batch."""
    minibatches: int = 1
    """Minibatches per pass (one optimizer update each); the rollout batch's completions must divide evenly."""
    environment: Optional[EnvironmentSettings] = None
    """Multi-turn episodes with tools, as GRPO's (docs/post_training.md, Agentic rollouts); null: one completion per sample, scored by the rewards."""
    rollout_correction: Optional[RolloutCorrectionSettings] = None
    """Truncated (TIS) and masked (MIS) importance sampling between the sampler's log-probs and the old log-probs of the trainer's forward, as GRPO's (docs/post_training.md, Rollout correction); null: off."""


def validate(config: Config) -> None:
    """objective.ppo.* (docs/post_training.md, PPO) and what PPO needs of data.* and train.*, every
    violated constraint (core/config_errors.py)."""
    check_independent(config, (
        _check_settings,
        lambda view: check_rewards(view.objective.ppo, "objective.ppo"),
        lambda view: validate_rollout_correction(view.objective.ppo.rollout_correction, "objective.ppo"),
        _check_adaptive_kl_start,
        _check_kl_horizon,
        _check_minibatches,
        _check_environment,
        lambda view: check_prompt_data(view, "ppo", eval_hint="use data.eval_source with ppo"),
    ))


def _check_settings(config: Config) -> None:
    p, key = config.objective.ppo, "objective.ppo"
    checks = (
        ("group_size", p.group_size >= 1, ">= 1"),
        ("max_new_tokens", p.max_new_tokens >= 1, ">= 1"),
        ("temperature", math.isfinite(p.temperature) and p.temperature > 0, "> 0"),
        ("top_p", 0 < p.top_p <= 1, "in (0, 1]"),
        ("top_k", p.top_k >= 0, ">= 0"),
        ("kl_coef", math.isfinite(p.kl_coef) and p.kl_coef >= 0, ">= 0"),
        ("kl_target", math.isfinite(p.kl_target) and p.kl_target >= 0, ">= 0 (0: a fixed kl_coef)"),
        ("kl_horizon", p.kl_horizon >= 1, ">= 1"),
        ("critic_lr", math.isfinite(p.critic_lr) and p.critic_lr > 0, "> 0"),
        ("gamma", 0 <= p.gamma <= 1, "in [0, 1]"),
        ("lam", 0 <= p.lam <= 1, "in [0, 1]"),
        ("clip_low", 0 <= p.clip_low < 1, "in [0, 1)"),
        ("clip_high", math.isfinite(p.clip_high) and p.clip_high >= 0, ">= 0"),
        ("dual_clip", p.dual_clip == 0 or (math.isfinite(p.dual_clip) and p.dual_clip > 1), "0 (off) or > 1"),
        ("value_clip", math.isfinite(p.value_clip) and p.value_clip > 0, "> 0"),
        ("vf_coef", math.isfinite(p.vf_coef) and p.vf_coef >= 0, ">= 0"),
        ("ppo_epochs", 1 <= p.ppo_epochs <= 16, "in 1..16"),
        ("minibatches", 1 <= p.minibatches <= 64, "in 1..64"),
    )
    raise_together([ConfigError(f"{key}.{name} must be {expected}, got {getattr(p, name)!r}", key=f"{key}.{name}")
                    for name, ok, expected in checks if not ok])


# The three constraints below relate keys of objective.ppo that _check_settings checks on their
# own; each is asked only with valid values of them (a finite kl_target, group_size >= 1, ...).


def _check_adaptive_kl_start(config: Config) -> None:
    p, key = config.objective.ppo, "objective.ppo"
    if math.isfinite(p.kl_target) and p.kl_target > 0 and p.kl_coef == 0:
        raise ConfigError(f"{key}.kl_target={p.kl_target} needs a starting kl_coef > 0", key=f"{key}.kl_coef",
                          hint="the adaptive coefficient is scaled from kl_coef; it cannot leave 0")


def _check_kl_horizon(config: Config) -> None:
    global_batch_size, p, key = config.train.global_batch_size, config.objective.ppo, "objective.ppo"
    rows = global_batch_size * p.group_size
    valid = p.group_size >= 1 and p.kl_horizon >= 1 and math.isfinite(p.kl_target)
    if valid and p.kl_target > 0 and p.kl_horizon < rows:
        raise ConfigError(
            f"{key}.kl_horizon={p.kl_horizon} is below a step's {rows} completions (train.global_batch_size "
            f"{global_batch_size} x group_size {p.group_size}): the adaptive KL coefficient is "
            f"multiplied by 1 + e * {rows} / kl_horizon, e in [-0.2, 0.2], after each step, which must stay in [0.8, 1.2]",
            key=f"{key}.kl_horizon", hint=f"set kl_horizon >= {rows} (Ziegler et al. use 10000), or kl_target 0")


def _check_minibatches(config: Config) -> None:
    global_batch_size, p, key = config.train.global_batch_size, config.objective.ppo, "objective.ppo"
    rows = global_batch_size * p.group_size
    if p.group_size >= 1 and 1 <= p.minibatches <= 64 and rows % p.minibatches:
        raise ConfigError(
            f"{key}.minibatches={p.minibatches} does not divide the rollout batch's {rows} completions "
            f"(train.global_batch_size {global_batch_size} x group_size {p.group_size})",
            key=f"{key}.minibatches", hint="choose a divisor of global_batch_size x group_size")


def _check_environment(config: Config) -> None:
    p = config.objective.ppo
    if p.environment is not None:
        validate_environment(p.environment, "objective.ppo", max_new_tokens=p.max_new_tokens,
                             model_rewards=bool(model_rewards(config)))


def resolve_rewards(config: Config) -> list:
    """The configured rule rewards, resolved: an unknown name or a function path that does not import
    is a ConfigError naming objective.ppo.rewards[i].name (exit 2, before any process group or run dir)."""
    return resolve_rule_rewards(config.objective.ppo, "objective.ppo")


def model_rewards(config: Config) -> dict[str, RewardSettings]:
    """{config key of its path: settings} of each configured model reward (a trained reward model), in order."""
    return _model_rewards(config.objective.ppo, "objective.ppo")


KIND = ObjectiveKind(
    name="ppo",
    summary="reinforcement learning with a critic on prompts with checkable answers",
    objective="training.objectives.ppo:PPOObjective",
    # Rollouts decode at a new length every step (no CUDA graphs); the completions answer
    # through the chat template.
    capabilities=ObjectiveCapabilities(cuda_graph_safe=False, chat_model=True, ledger_over_updates=True),
    settings=PPOSettings,
    validate=validate,
    # added later (model rewards, episodes): earlier configs keep their hashes
    hashed_only_when_set=("rewards[].path", "rewards[].strip_thinking", "environment", "rollout_correction"),
)
