"""The tiny model the sampler tests generate with (test_sampler.py, test_scheduler.py,
test_sampler_episodes.py; the ``sampler_model`` fixture in tests/models/conftest.py)."""

from __future__ import annotations

import torch

import models
from core.config import ModelConfig

QWEN3 = ModelConfig(
    arch="qwen3", vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, attention="sdpa",
)


def build_sampler_model() -> torch.nn.Module:
    """``QWEN3`` from seed 5, in training mode (a rank parallelizes it before sampling)."""
    return models.build(QWEN3, generator=torch.Generator().manual_seed(5))
