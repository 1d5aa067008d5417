"""Explicit randomness: every random stream is derived from (seed, purpose, step, rank).

No code calls a global ``torch.manual_seed``; components receive a generator or a derived
integer seed, so adding a random draw in one place never shifts the numbers of another.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, purpose: str, step: int = 0, rank: int = 0) -> int:
    """A 63-bit seed that depends on every argument and nothing else."""
    text = f"{seed}:{purpose}:{step}:{rank}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def generator(seed: int, purpose: str, step: int = 0, rank: int = 0) -> torch.Generator:
    """A CPU generator for (seed, purpose, step, rank)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(derive_seed(seed, purpose, step, rank))
    return gen
