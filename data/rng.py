"""Counter-based randomness on top of ``core.seeding``: each draw is a pure function of its coordinates.

A value is derived from ``(seed, purpose, *counters)`` through ``core.seeding.derive_seed``
(the project's one derivation), so a stream can resume at any counter without replaying the
draws before it, and no generator state has to be saved.
"""

from __future__ import annotations

import random

from core.seeding import derive_seed


def derive(seed: int, purpose: str, *counters: int) -> int:
    """A 63-bit integer fixed by the seed, the purpose and the counters."""
    return derive_seed(seed, ":".join([purpose, *map(str, counters)]))


def uniform(seed: int, purpose: str, *counters: int) -> float:
    """A float in [0, 1) fixed by its coordinates (53 random bits)."""
    return (derive(seed, purpose, *counters) >> 10) * (1.0 / (1 << 53))


def shuffled(items: list, seed: int, purpose: str, *counters: int) -> list:
    """A permutation of ``items`` fixed by the coordinates (Python's stable Mersenne Twister)."""
    out = list(items)
    random.Random(derive(seed, purpose, *counters)).shuffle(out)
    return out
