"""A plain local copy of a Qwen3-MoE model's full weights, for the Sampler (``ModelFamily.generation_copy``).

As Qwen's (models/qwen/generation_copy.py): the model handed in is the model itself, possibly sharded
in place (FSDP2, tensor parallelism) and possibly with LoRA adapters on its attention, its state under
canonical names; adapters are folded into the base weights, an NF4 base is refused, and the copy
carries the model's own ``Numerics``, which also picks its dtype.
"""

from __future__ import annotations

from typing import Mapping

import torch

from core.distributed_context import full_tensor
from core.exceptions import ConfigError
from models.lora import LoRALinear, lora_modules, merge_lora
from models.nf4 import NF4Linear
from models.qwen3_moe.model import Qwen3MoeForCausalLM, empty_model
from models.qwen3_moe.moe import BIAS


def generation_copy(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Qwen3MoeForCausalLM:
    """A plain local Qwen3MoeForCausalLM with the full weights of ``model``, whose canonical state is ``state``.

    ``state``'s values may be DTensor shards: gathering them is a collective, so call this on every
    rank. A plain model already on the requested device and dtype (default: the model's
    ``numerics.generation_dtype``, else the parameters') is returned as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(model, Qwen3MoeForCausalLM):
        raise ConfigError(f"qwen3_moe's generation copy needs a Qwen3MoeForCausalLM, got {type(model).__name__}",
                          key="model.arch")
    first = next(iter(state.values()))
    sharded = any(isinstance(v, DTensor) for v in state.values())
    adapters = {m.name: m for m in lora_modules(model)}
    if device is None:
        device = torch.device(first.device_mesh.device_type) if isinstance(first, DTensor) else first.device
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = dtype or model.numerics.generation_dtype(device) or first.dtype
    if not sharded and not adapters and (first.device, first.dtype) == (device, dtype):
        return model
    if any(isinstance(m.base_layer, NF4Linear) for m in adapters.values()):
        raise ConfigError("generation_model cannot gather an NF4-quantized base", key="model.quantize_base",
                          hint="export the merged model (python -m training export --merge) and load that")
    fresh = empty_model(model.config, device=device, dtype=dtype)
    fresh.use_numerics(model.numerics)
    for name, source in adapters.items():  # the same adapters (names, rank, alpha, dtype); values follow
        wrapper = LoRALinear(fresh.get_submodule(name), rank=source.rank, alpha=source.alpha, dropout=0.0, name=name)
        wrapper.to(dtype=source.lora_A.weight.dtype)
        wrapper.base_layer.to(dtype=dtype)
        parent, leaf = name.rsplit(".", 1)
        setattr(fresh.get_submodule(parent), leaf, wrapper)
    params = dict(fresh.named_parameters())  # a tied head appears once, as embed_tokens.weight
    tied_head = "lm_head.weight" if fresh.dims.tie_embeddings else None
    unknown = [name for name in state if name not in params and name != tied_head]
    missing = [name for name in params if name not in state]
    if unknown or missing:
        raise ConfigError(f"generation_model: the model's parameters do not match a fresh Qwen3MoeForCausalLM of "
                          f"its config (unexpected: {unknown[:3]}, missing: {missing[:3]})", key="model.arch")
    with torch.no_grad():
        for name, value in state.items():  # the same order on every rank: collectives line up
            if name in params:
                params[name].copy_(full_tensor(value))
    with torch.no_grad():  # the routers' balancing biases (replicated, never sharded): routing as in training
        targets = dict(fresh.routers_with_bias())
        for layer, router in model.routers_with_bias():
            getattr(targets[layer], BIAS).copy_(getattr(router, BIAS))
    fresh.tie_weights()
    if adapters:
        fresh = merge_lora(fresh, inplace=True)
    for param in fresh.parameters():
        param.requires_grad_(False)
    return fresh.eval()
