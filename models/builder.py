"""``build``: a ready-to-train model from a ModelConfig, of the family ``model.arch`` names."""

from __future__ import annotations

import torch

from core.config import ModelConfig
from models.hf_weights import empty_model, load_pretrained

# The seed used when no generator is passed, so that build() is still reproducible.
DEFAULT_INIT_SEED = 0


def build(
    config: ModelConfig,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.nn.Module:
    """The model of ``config``'s family (``ModelFamily.build``) with fp32 parameters on ``device`` (default CPU).

    Without ``config.init_from`` the weights are drawn from ``generator`` (a CPU generator;
    default: one seeded with DEFAULT_INIT_SEED) by the model's ``init_weights``; equal generators
    give bit-identical models on any device. With ``config.init_from`` the weights are read from
    that Hugging Face directory, the shape is taken from its config.json (the YAML's shape fields
    are replaced, as ModelConfig.init_from documents; ``model.config`` holds the result), and
    the generator is not used.
    """
    if config.init_from is not None:
        return load_pretrained(config.init_from, base=config, device=device)
    model = empty_model(config, device=device)
    model.init_weights(generator if generator is not None else torch.Generator().manual_seed(DEFAULT_INIT_SEED))
    return model
