"""Learning-rate schedules as pure functions of the step.

A pure function of ``(step, config)`` needs no state in checkpoints and gives the same value
on resume. Steps count from 1; step ``s`` uses the rate at progress ``s - 1``.
"""

from __future__ import annotations

import math

from core.config import TrainConfig


def lr_at(step: int, config: TrainConfig) -> float:
    """The learning rate for optimizer step ``step`` (1-based)."""
    t = step - 1
    peak, floor = config.lr, config.lr * config.min_lr_ratio
    total = config.schedule_steps or config.max_steps
    if config.warmup_steps > 0 and t < config.warmup_steps:
        return peak * (t + 1) / config.warmup_steps
    if config.schedule == "constant":
        return peak
    span = max(total - config.warmup_steps - 1, 1)  # the last step runs at the floor
    progress = min(max(t - config.warmup_steps, 0) / span, 1.0)
    if config.schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if config.schedule == "linear":
        return peak + (floor - peak) * progress
    # wsd: hold the peak, then decay linearly over the last decay_fraction of the schedule.
    decay_start = 1.0 - config.decay_fraction
    if progress <= decay_start:
        return peak
    return peak + (floor - peak) * (progress - decay_start) / max(config.decay_fraction, 1e-12)


def reshape_warning(step: int, recorded: TrainConfig, requested: TrainConfig) -> str | None:
    """The warning for a resume at ``step`` whose ``train.max_steps`` changes the schedule's
    length (``schedule_steps`` unset, a schedule that decays): the learning rate at ``step``
    under the recorded and the requested settings, and the ``train.schedule_steps`` (a resumable
    key) that keeps the recorded schedule; None when the schedule is unchanged."""
    old_total = recorded.schedule_steps or recorded.max_steps
    new_total = requested.schedule_steps or requested.max_steps
    if old_total == new_total or requested.schedule == "constant" or step > requested.max_steps:
        return None
    before, after = lr_at(step, recorded), lr_at(step, requested)
    return (f"warning: train.max_steps {recorded.max_steps} -> {requested.max_steps} reshapes the "
            f"{requested.schedule} learning-rate schedule: step {step}, where this resume continues, runs at "
            f"lr {after:.6g} (it was {before:.6g} under train.max_steps={recorded.max_steps}), and the steps "
            f"after it follow the new schedule -> add train.schedule_steps={old_total} to keep the recorded one")
