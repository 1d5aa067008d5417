"""``objective.kind=distill``: its settings (``objective.distill``), checks and capabilities.

Everything the config loader needs to know about distillation lives here and reaches
core.config through ``KIND`` (registered by training/registry.py); the method itself is
distill.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from core.config import Config, ObjectiveCapabilities, ObjectiveKind
from core.exceptions import ConfigError


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
    """objective.distill.* (docs/post_training.md, distillation)."""
    o, key = config.objective.distill, "objective.distill"
    if not o.teacher or o.teacher in ("init", "adapter_off"):
        raise ConfigError(f"{key}.teacher must name a Hugging Face directory or run:RUN_ID[@STEP], got {o.teacher!r}",
                          key=f"{key}.teacher", hint="e.g. teacher: run:tiny-teacher-20260101-000000-abcd1234")
    checks = (
        ("temperature", math.isfinite(o.temperature) and o.temperature > 0, "> 0"),
        ("alpha", 0 <= o.alpha <= 1, "in [0, 1]"),
        ("beta", 0 <= o.beta <= 1, "in [0, 1]"),
        ("chunk_tokens", o.chunk_tokens >= 1, ">= 1"),
    )
    for name, ok, expected in checks:
        if not ok:
            raise ConfigError(f"{key}.{name} must be {expected}, got {getattr(o, name)!r}", key=f"{key}.{name}")
    if any(s.record == "preference" or s.record == "prompt" for s in config.data.sources):
        raise ConfigError("objective.kind=distill trains on text, chat or prompt_completion sources",
                          key="data.sources")


KIND = ObjectiveKind(
    name="distill",
    summary="a frozen teacher's distribution",
    # One row of tokens per sequence, as pretraining; its own fused divergence, not the
    # cross-entropy head (parallel.float8_head).
    capabilities=ObjectiveCapabilities(bounded_tokens=True, chat_model=True),
    settings=DistillSettings,
    validate=validate,
    hash_default_section=True,
)
