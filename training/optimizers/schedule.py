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
