"""``objective.kind=distill``: its settings (``objective.distill``), checks and capabilities.

Everything the config loader needs to know about distillation lives here and reaches
core.config through ``KIND`` (registered by training/registry.py): ``validate`` runs at every
load; ``check_teacher`` reads the teacher's config and tokenizer, so it runs once before any
process group (``DistillObjective.check_config``) and again when the teacher is built. The
method itself is distill.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from core.config import Config
from core.config_errors import check_independent, raise_together
from core.exceptions import ConfigError
from core.objective_kinds import ObjectiveCapabilities, ObjectiveKind
from data.preference import PAIR_ROLE
from data.record_kinds import record_kind

KEY = "objective.distill.teacher"


@dataclass(frozen=True)
class DistillSettings:
    teacher: str = ""
    """Frozen teacher: a Hugging Face directory or run:RUN_ID[@STEP]; same tokenizer and vocabulary as the student."""
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    """Divergence between teacher and student next-token distributions (docs/post_training.md)."""
    temperature: float = 1.0
    """Softmax temperature of both distributions (the divergence is scaled by T^2)."""
    alpha: float = 0.0
    """Weight of the hard-label cross entropy: loss = (1 - alpha) T^2 D + alpha CE."""
    beta: float = 0.5
    """jsd: the teacher's weight in the mixture (0 is forward KL, 1 reverse KL)."""
    chunk_tokens: int = 4096
    """Tokens per chunk of the fused projection + divergence (never full-batch vocabulary logits)."""


def validate(config: Config) -> None:
    """objective.distill.* (docs/post_training.md, distillation) and its sources: every violated
    constraint (core/config_errors.py)."""
    check_independent(config, (_check_settings, _check_sources))


def _check_settings(config: Config) -> None:
    o, key, found = config.objective.distill, "objective.distill", []
    if not o.teacher or o.teacher in ("init", "adapter_off"):
        found.append(ConfigError(
            f"{key}.teacher must name a Hugging Face directory or run:RUN_ID[@STEP], got {o.teacher!r}",
            key=f"{key}.teacher", hint="e.g. teacher: run:tiny-teacher-20260101-000000-abcd1234"))
    checks = (
        ("temperature", math.isfinite(o.temperature) and o.temperature > 0, "> 0"),
        ("alpha", 0 <= o.alpha <= 1, "in [0, 1]"),
        ("beta", 0 <= o.beta <= 1, "in [0, 1]"),
        ("chunk_tokens", o.chunk_tokens >= 1, ">= 1"),
    )
    found += [ConfigError(f"{key}.{name} must be {expected}, got {getattr(o, name)!r}", key=f"{key}.{name}")
              for name, ok, expected in checks if not ok]
    raise_together(found)


def _check_sources(config: Config) -> None:
    if any(record_kind(s.record).one_per_row or record_kind(s.record).declares(PAIR_ROLE.name)
           for s in config.data.sources):
        raise ConfigError("objective.kind=distill trains on text, chat or prompt_completion sources",
                          key="data.sources")


def check_teacher(config: Config) -> None:
    """The teacher must share the student's vocabulary (and, for a run, its tokenizer)."""
    from training.objectives.frozen import frozen_model_config, frozen_tokenizer  # torch: only where a run uses it

    teacher = frozen_model_config(config, config.objective.distill.teacher, key=KEY)
    check_vocab(student_vocab(config), teacher.vocab_size, config.objective.distill.teacher)
    tokenizer = frozen_tokenizer(config, config.objective.distill.teacher, key=KEY)
    if tokenizer is not None and tokenizer != config.data.tokenizer:
        raise ConfigError(
            f"the teacher run was trained with data.tokenizer={tokenizer!r}, the student uses "
            f"{config.data.tokenizer!r}", key=KEY, hint="distill between models of the same tokenizer")


def student_vocab(config: Config) -> int:
    from models.hf_config import model_config_from_hf

    model = config.model
    if model.init_from is not None:
        model = model_config_from_hf(model.init_from, base=dataclasses.replace(model))
    return model.vocab_size


def check_vocab(student: int, teacher: int, source: str) -> None:
    if student != teacher:
        raise ConfigError(
            f"the teacher's vocabulary has {teacher} tokens, the student's {student}: distillation compares "
            "next-token distributions token by token and needs the same tokenizer",
            key=KEY, file=source, hint="pick a teacher trained with the student's tokenizer",
        )


KIND = ObjectiveKind(
    name="distill",
    summary="a frozen teacher's distribution",
    objective="training.objectives.distill:DistillObjective",
    # One row of tokens per sequence, as pretraining; its own fused divergence, not the
    # cross-entropy head (parallel.float8_head).
    capabilities=ObjectiveCapabilities(bounded_tokens=True, chat_model=True),
    settings=DistillSettings,
    validate=validate,
    hash_default_section=True,
)
