"""A plain local copy of a Qwen2.5-VL model's full weights, for the sampler (``ModelFamily.generation_copy``).

The model handed in is the model itself (possibly sharded in place by FSDP2), unwrapped by
training/rollout/generation_model.py. The copy carries the model's ``Numerics``, which also picks
its dtype. Adapters are not folded here: a model with LoRA adapters is refused (export it merged).
"""

from __future__ import annotations

from typing import Mapping

import torch

from core.distributed_context import full_tensor
from core.exceptions import ConfigError
from models.qwen_vl.model import QwenVLForConditionalGeneration, empty_model


def generation_copy(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *,
                    device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> QwenVLForConditionalGeneration:
    """A plain local model with ``model``'s full weights (``state``: its canonical state; DTensor shards are
    gathered, a collective: call on every rank); ``model`` itself where it is plain and already on
    ``device`` in ``dtype``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(model, QwenVLForConditionalGeneration):
        raise ConfigError(f"qwen2_5_vl's generation copy needs its own model, got {type(model).__name__}",
                          key="model.arch")
    params = dict(model.named_parameters())
    if set(params) - set(state) or any(".lora_" in name or "base_layer" in name for name in state):
        raise ConfigError("qwen2_5_vl's generation copy takes a plain model: its state has parts the model lacks",
                          key="model.lora.rank", hint="export the merged model and generate from that")
    first = next(iter(state.values()))
    sharded = any(isinstance(v, DTensor) for v in state.values())
    if device is None:
        device = torch.device(first.device_mesh.device_type) if isinstance(first, DTensor) else first.device
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = dtype or model.numerics.generation_dtype(device) or first.dtype
    if not sharded and (first.device, first.dtype) == (device, dtype):
        return model
    fresh = empty_model(model.config, device=device, dtype=dtype)
    fresh.use_numerics(model.numerics)
    targets = dict(fresh.named_parameters())
    with torch.no_grad():
        for name, value in state.items():  # the same order on every rank: the gathers line up
            if name in targets:
                targets[name].copy_(full_tensor(value))
    fresh.tie_weights()
    for param in fresh.parameters():
        param.requires_grad_(False)
    return fresh.eval()
