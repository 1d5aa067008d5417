"""The checks of the optimizer's keys (train.optimizer, train.muon_*, train.lion_*, schedule-free)
on a loaded config, registered with core.config's loader (core/config_checks.py,
training/registry.py). Torch-free: the launcher checks a config before torch is imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.config_errors import raise_together
from core.exceptions import ConfigError

if TYPE_CHECKING:
    from core.config import Config


def validate_optimizer(config: Config) -> None:
    """The optimizer's keys of train.*: ranges, and what schedule-free AdamW needs; every violated
    one (core/config_errors.py)."""
    raise_together(_optimizer_errors(config.train))


def _optimizer_errors(t) -> list[ConfigError]:
    found = []
    if t.optimizer == "schedule_free_adamw" and t.schedule != "constant":
        found.append(ConfigError(
            f"train.optimizer=schedule_free_adamw averages its iterates instead of decaying the LR; "
            f"train.schedule={t.schedule} would decay it as well",
            key="train.schedule",
            hint="set train.schedule=constant (train.warmup_steps still applies)",
        ))
    if not 1 <= t.muon_ns_steps < 100:
        found.append(ConfigError(f"train.muon_ns_steps must lie in [1, 100), got {t.muon_ns_steps}",
                                 key="train.muon_ns_steps"))
    for key, value in (("muon_momentum", t.muon_momentum), ("lion_beta1", t.lion_beta1), ("lion_beta2", t.lion_beta2)):
        if not 0.0 <= value < 1.0:
            found.append(ConfigError(f"train.{key} must lie in [0, 1), got {value}", key=f"train.{key}"))
    if t.optimizer == "schedule_free_adamw" and not 0.0 < t.beta1 < 1.0:
        found.append(ConfigError(f"train.beta1 must lie in (0, 1) for schedule_free_adamw, got {t.beta1}",
                                 key="train.beta1"))
    return found
