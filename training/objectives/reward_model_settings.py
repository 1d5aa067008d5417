"""``objective.kind=reward_model``: its settings (``objective.reward_model``), checks and
capabilities.

Registered by training/registry.py; the method itself is reward_model.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from core.config import Config
from core.config_errors import check_independent, raise_together
from core.exceptions import ConfigError
from core.objective_kinds import ObjectiveCapabilities, ObjectiveKind
from data.preference import PAIR_ROLE
from data.record_kinds import record_kind


@dataclass(frozen=True)
class RewardModelSettings:
    margin: float = 0.0
    """Fixed margin m of every pair's Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - m): the score gap the loss asks for; finite."""
    margin_from: Literal["fixed", "record"] = "fixed"
    """fixed: every pair's margin is margin; record: each pair's own, its preference record's margin field (a finite number every record must hold; margin must stay 0)."""
    center_coef: float = 0.0
    """Weight c of the centering term c * (r_chosen + r_rejected)^2 added to each pair's loss (keeps the scores near zero); >= 0."""


def validate(config: Config) -> None:
    """objective.reward_model.* (docs/post_training.md, Reward model): constants, preference sources,
    and what the score head needs of the model and the parallel layout; every violated one
    (core/config_errors.py)."""
    check_independent(config, (_check_constants, _check_sources, _check_tied_embeddings, _check_whole_hidden_states))


def _check_constants(config: Config) -> None:
    o, key, found = config.objective.reward_model, "objective.reward_model", []
    if not math.isfinite(o.margin):
        found.append(ConfigError(f"{key}.margin must be finite, got {o.margin!r}", key=f"{key}.margin"))
    elif o.margin_from == "record" and o.margin != 0:
        found.append(ConfigError(f"{key}.margin={o.margin} is the fixed margin, and {key}.margin_from=record reads "
                                 "each pair's margin from its record", key=f"{key}.margin",
                                 hint="set margin: 0 with margin_from: record, or margin_from: fixed"))
    if not (math.isfinite(o.center_coef) and o.center_coef >= 0):
        found.append(ConfigError(f"{key}.center_coef must be >= 0, got {o.center_coef!r}", key=f"{key}.center_coef"))
    raise_together(found)


def _check_sources(config: Config) -> None:
    sources = list(config.data.sources) + ([config.data.eval_source] if config.data.eval_source else [])
    if not config.data.sources or any(not record_kind(s.record).declares(PAIR_ROLE.name) for s in sources):
        raise ConfigError("objective.kind=reward_model needs preference sources only (data.sources[i].record: preference)",
                          key="data.sources", hint='records {"prompt", "chosen", "rejected"}; e.g. datasets/tasks/pref')


def _check_tied_embeddings(config: Config) -> None:
    if not config.model.tie_embeddings:
        # The scores never use the output head: an untied one would get no gradient, which
        # data-parallel replication refuses.
        raise ConfigError("objective.kind=reward_model needs model.tie_embeddings=true: the score head replaces "
                          "the output head, and an untied output head would be an untrained parameter",
                          key="model.tie_embeddings", hint="start from a model with tied embeddings")


def _check_whole_hidden_states(config: Config) -> None:
    if config.parallel.tp > 1:
        raise ConfigError("objective.kind=reward_model reads whole hidden states for its score head; "
                          f"parallel.tp={config.parallel.tp} splits them", key="parallel.tp",
                          hint="train a reward model with parallel.tp: 1 (ddp or fsdp)")


def record_fields(config: Config) -> tuple[str, ...]:
    """The preference records' ``margin`` under margin_from: record (data/preference.py), else nothing."""
    return ("margin",) if config.objective.reward_model.margin_from == "record" else ()


KIND = ObjectiveKind(
    name="reward_model",
    summary="a scalar score head on the trunk, trained on chosen/rejected pairs with the Bradley-Terry loss",
    objective="training.objectives.reward_model:RewardModelObjective",
    # Its data is rendered with the chat template, as DPO's; the loss is on scores, not on
    # next-token logits (no fused head), over a batch of pairs.
    capabilities=ObjectiveCapabilities(chat_model=True),
    settings=RewardModelSettings,
    validate=validate,
    hashed_only_when_set=("margin_from",),  # added after tiny-rm: its config keeps its hash
    record_fields=record_fields,
)
