"""``objective.grpo.rollout_correction`` and ``objective.ppo.rollout_correction``: the settings and
checks of rollout correction, for runs whose sampler's log-probs are not the trainer's.

Torch-free (the settings modules of GRPO and PPO import it, and the launcher reads those before
torch is imported); the formulas are rollout_correction.py. Off by default (the section is null
and hashed only when set), so no existing config, run ID or ledger changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from core.config_errors import raise_together
from core.exceptions import ConfigError


@dataclass(frozen=True)
class RolloutCorrectionSettings:
    tis_cap: Optional[float] = 2.0
    """Token-level truncated importance sampling: each sampled token's policy-gradient term is weighed by min(pi_train / pi_rollout, tis_cap), detached (> 0; 2.0 is verl's rollout_is_threshold and TRL's vllm_importance_sampling_cap before its 3.0); null: no TIS."""
    mis: Optional[Literal["geometric", "product"]] = None
    """Sequence-level masked importance sampling: a completion whose ratio pi_train / pi_rollout leaves [mis_low, mis_high] carries no policy-gradient term. geometric: exp of the mean log-ratio over its sampled tokens (length-normalized, as GSPO's ratio); product: exp of their sum (the whole sequence's likelihood ratio); null: no MIS."""
    mis_low: float = 0.5
    """MIS's lower bound of a completion's ratio (0 < mis_low <= 1; 0.5 is 1 / mis_high, verl's default lower bound)."""
    mis_high: float = 2.0
    """MIS's upper bound of a completion's ratio (>= 1; 2.0 as verl's threshold). With mis: geometric, bounds near 1 (0.999, 1.001) drop what a per-token drift would."""


def validate_rollout_correction(settings: Optional[RolloutCorrectionSettings], section: str) -> None:
    """``<section>.rollout_correction``: a ConfigError naming each key whose value is out of range
    (core/config_errors.py), or the section alone when it corrects nothing."""
    if settings is None:
        return
    key = f"{section}.rollout_correction"
    if settings.tis_cap is None and settings.mis is None:
        raise ConfigError(f"{key} sets neither tis_cap nor mis: it would correct nothing", key=key,
                          hint=f"{key}.tis_cap: 2.0 (token weights), {key}.mis: geometric (drop sequences), "
                               f"or {key}: null")
    s = settings
    checks = (
        ("tis_cap", s.tis_cap is None or (math.isfinite(s.tis_cap) and s.tis_cap > 0), "> 0 (null: no TIS)"),
        ("mis_low", math.isfinite(s.mis_low) and 0 < s.mis_low <= 1, "in (0, 1]"),
        ("mis_high", math.isfinite(s.mis_high) and s.mis_high >= 1, ">= 1 and finite"),
    )
    raise_together([ConfigError(f"{key}.{name} must be {expected}, got {getattr(s, name)!r}", key=f"{key}.{name}",
                                hint="docs/post_training.md, Rollout correction")
                    for name, ok, expected in checks if not ok])
