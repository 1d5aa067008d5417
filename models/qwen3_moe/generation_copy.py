"""A plain local copy of a Qwen3-MoE model's full weights, for the Sampler (``ModelFamily.generation_copy``).

The generic copy (models/generation_copy.py) with a fresh ``Qwen3MoeForCausalLM`` of the model's
config: LoRA adapters on its attention folded into the base weights, an NF4 base refused, the
model's own ``Numerics`` carried, and the routers' balancing biases (persistent fp32 buffers,
replicated, never sharded) copied so that the copy routes as training does. Adapters on the experts
(``model.qwen3_moe.lora_experts``) are added to the fresh model's experts with the trained values
(gathered in ``state``'s order) and folded as the attention's are: merged, or kept unmerged in the
trainer's dtype under ``determinism.batch_invariant`` (``Numerics.merges_adapters``).
"""

from __future__ import annotations

from typing import Mapping

import torch

from core.distributed_context import full_tensor
from models import generation_copy as generic
from models.lora import adapted_experts, canonical_name, is_adapter_name
from models.qwen3_moe.model import Qwen3MoeForCausalLM, empty_model
from models.qwen3_moe.moe import BIAS


def generation_copy(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Qwen3MoeForCausalLM:
    """A plain local Qwen3MoeForCausalLM with the full weights of ``model``, whose canonical state is ``state``
    (DTensor shards are gathered, a collective: call on every rank); ``model`` itself where it is plain
    and already on ``device`` in ``dtype``."""
    adapters = {name: value for name, value in state.items() if is_adapter_name(name)
                and any(name.startswith(f"{prefix}.lora_") for prefix in _adapted(model))}
    plain = {name: value for name, value in state.items() if name not in adapters}

    def carry(model: Qwen3MoeForCausalLM, fresh: Qwen3MoeForCausalLM) -> None:
        _router_biases(model, fresh)
        _expert_adapters(model, fresh, adapters)

    fresh = generic.generation_copy(model, plain, model_class=Qwen3MoeForCausalLM, build=empty_model, device=device,
                                    dtype=dtype, carry=carry)
    if fresh is not model and model.numerics.merges_adapters:
        for experts in adapted_experts(fresh):
            experts.merge_adapters()
    return fresh


def _adapted(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Canonical name -> experts module of every experts module of ``model`` that carries adapters."""
    adapted = {id(m) for m in adapted_experts(model)}
    return {canonical_name(name): m for name, m in model.named_modules() if id(m) in adapted}


def _expert_adapters(model: Qwen3MoeForCausalLM, fresh: Qwen3MoeForCausalLM,
                     values: Mapping[str, torch.Tensor]) -> None:
    """The experts' adapters of ``model`` added to ``fresh`` with their trained ``values`` (full tensors
    gathered in ``values``' order, the same on every rank)."""
    for name, source in _adapted(model).items():
        target = fresh.get_submodule(name)
        target.add_adapters(rank=source.rank, alpha=source.alpha, dropout=0.0, seed=0, name=name)
        if not model.numerics.merges_adapters:  # the trainer's unmerged adapters, in its dtype
            dtype = source.lora_A["gate_proj"].dtype
            target.lora_A.to(model.numerics.unmerged_dtype(target.gate_proj.device, dtype))
            target.lora_B.to(model.numerics.unmerged_dtype(target.gate_proj.device, dtype))
    params = dict(fresh.named_parameters())
    with torch.no_grad():
        for name, value in values.items():
            params[name].copy_(full_tensor(value))


def _router_biases(model: Qwen3MoeForCausalLM, fresh: Qwen3MoeForCausalLM) -> None:
    """Each router's balancing bias from ``model`` into ``fresh`` (same layers: same config)."""
    targets = dict(fresh.routers_with_bias())
    for layer, router in model.routers_with_bias():
        getattr(targets[layer], BIAS).copy_(getattr(router, BIAS))
