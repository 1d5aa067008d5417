"""A plain local copy of a Qwen3-MoE model's full weights, for the Sampler (``ModelFamily.generation_copy``).

The generic copy (models/generation_copy.py) with a fresh ``Qwen3MoeForCausalLM`` of the model's
config: LoRA adapters on its attention folded into the base weights, an NF4 base refused, the
model's own ``Numerics`` carried, and the routers' balancing biases (persistent fp32 buffers,
replicated, never sharded) copied so that the copy routes as training does.
"""

from __future__ import annotations

from typing import Mapping

import torch

from models import generation_copy as generic
from models.qwen3_moe.model import Qwen3MoeForCausalLM, empty_model
from models.qwen3_moe.moe import BIAS


def generation_copy(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Qwen3MoeForCausalLM:
    """A plain local Qwen3MoeForCausalLM with the full weights of ``model``, whose canonical state is ``state``
    (DTensor shards are gathered, a collective: call on every rank); ``model`` itself where it is plain
    and already on ``device`` in ``dtype``."""
    return generic.generation_copy(model, state, model_class=Qwen3MoeForCausalLM, build=empty_model, device=device,
                                   dtype=dtype, carry=_router_biases)


def _router_biases(model: Qwen3MoeForCausalLM, fresh: Qwen3MoeForCausalLM) -> None:
    """Each router's balancing bias from ``model`` into ``fresh`` (same layers: same config)."""
    targets = dict(fresh.routers_with_bias())
    for layer, router in model.routers_with_bias():
        getattr(targets[layer], BIAS).copy_(getattr(router, BIAS))
