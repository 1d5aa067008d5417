"""``objective.kind=sft``: no settings of its own; its check of the data and its capabilities.

Registered by training/registry.py; the method itself is sft.py.
"""

from __future__ import annotations

from core.config import Config
from core.exceptions import ConfigError
from core.objective_kinds import ObjectiveCapabilities, ObjectiveKind
from data.fields import TARGET_MASK
from data.record_kinds import record_kind


def validate(config: Config) -> None:
    """SFT trains on the tokens the data marks: a chat or prompt_completion source, unless
    data.loss_on=all makes every token of a text source a target."""
    if not any(record_kind(s.record).declares(TARGET_MASK.name) for s in config.data.sources) \
            and config.data.loss_on != "all":
        raise ConfigError(
            "objective.kind=sft needs chat or prompt_completion sources (data.sources[i].record)",
            key="data.sources",
            hint="declare the record kind of the fine-tuning source, e.g. record: chat",
        )


KIND = ObjectiveKind(
    name="sft",
    summary="supervised fine-tuning on chat data",
    objective="training.objectives.sft:SFTObjective",
    # causal_lm's loss over the marked tokens: the same fused head and token bound.
    capabilities=ObjectiveCapabilities(fused_head=True, bounded_tokens=True, chat_model=True),
    validate=validate,
)
