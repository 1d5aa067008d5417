"""A plain local copy of a model's full weights, for the sampler: what every family's ``generation_copy`` does.

The model handed in is the model itself (possibly sharded in place by FSDP2 or tensor parallelism,
possibly with LoRA adapters), with its state under canonical names; whatever wrapped it from outside
(DDP, compile, checkpoint wrappers) was removed by the layer that applied it
(training/rollout/generation_model.py). The copy is a fresh model of the family (its ``build``),
filled parameter by parameter; it carries the model's own ``Numerics`` (models/numerics.py), which
also picks its dtype (``generation_dtype``; under ``batch_invariant`` the trainer's, the sampler's
forwards then under the trainer's autocast), so the sampler runs under the object the training
forward runs under.
A family's row function (``ModelFamily.generation_copy``) calls ``generation_copy`` with its model
class and its builder, saying whether it folds LoRA adapters and what else the copy must carry.
"""

from __future__ import annotations

from typing import Callable, Mapping, TypeVar

import torch
from torch import nn

from core.distributed_context import full_tensor
from core.exceptions import ConfigError
from models.lora import LoRALinear, lora_modules, merge_lora
from models.nf4 import NF4Linear

M = TypeVar("M", bound=nn.Module)


def generation_copy(
    model: nn.Module, state: Mapping[str, torch.Tensor], *, model_class: type[M],
    build: Callable[..., M], device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    fold_lora: bool = True, carry: Callable[[M, M], None] | None = None,
) -> M:
    """A plain local ``model_class`` with the full weights of ``model``, whose canonical state is ``state``.

    ``state``'s values may be DTensor shards: gathering them is a collective, so call this on every
    rank (the parameters are gathered in ``state``'s order, the same on every rank). A plain
    ``model_class`` already on the requested device and dtype (default: the model's
    ``numerics.generation_dtype``, else the parameters') is returned as it is; otherwise
    ``build(model.config, device=, dtype=)`` makes a fresh model that receives the full weights.
    LoRA adapters are folded into the base weights (``fold_lora``; else a model with adapters is a
    ConfigError); an NF4 base is refused. ``carry(model, fresh)``, where given, copies what the
    parameters do not hold (a family's persistent buffers) before the copy is frozen. Memory: one
    full copy of the weights per rank in ``dtype``, plus one gathered parameter at a time.
    """
    from torch.distributed.tensor import DTensor

    arch = getattr(getattr(model, "config", None), "arch", model_class.__name__)
    if not isinstance(model, model_class):
        raise ConfigError(f"{arch}'s generation copy needs a {model_class.__name__}, got {type(model).__name__}",
                          key="model.arch")
    adapters = {m.name: m for m in lora_modules(model)}
    if adapters and not fold_lora:
        raise ConfigError(f"{arch}'s generation copy takes a plain model, but it has LoRA adapters "
                          f"({sorted(adapters)[:3]})", key="model.lora.rank",
                          hint="export the merged model (python -m training export --merge) and generate from that")
    first = next(iter(state.values()))
    sharded = any(isinstance(v, DTensor) for v in state.values())
    if device is None:
        device = torch.device(first.device_mesh.device_type) if isinstance(first, DTensor) else first.device
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype is None:
        dtype = model.numerics.generation_dtype(device) or first.dtype
    if type(model) is model_class and not sharded and not adapters and (first.device, first.dtype) == (device, dtype):
        return model
    if any(isinstance(m.base_layer, NF4Linear) for m in adapters.values()):
        raise ConfigError("generation_model cannot gather an NF4-quantized base", key="model.quantize_base",
                          hint="export the merged model (python -m training export --merge) and load that")
    fresh = build(model.config, device=device, dtype=dtype)
    fresh.use_numerics(model.numerics)
    merge = model.numerics.merges_adapters  # batch_invariant: the copy runs the trainer's unmerged adapters
    for name, source in adapters.items():  # the same adapters (names, rank, alpha, dtype); values follow
        wrapper = LoRALinear(fresh.get_submodule(name), rank=source.rank, alpha=source.alpha, dropout=0.0, name=name)
        adapter_dtype, base_dtype = source.lora_A.weight.dtype, dtype
        if not merge:  # each part as the trainer computes it
            adapter_dtype = model.numerics.unmerged_dtype(device, adapter_dtype)
            base_dtype = model.numerics.unmerged_dtype(device, source.base_layer.weight.dtype)
        wrapper.to(dtype=adapter_dtype)
        wrapper.base_layer.to(dtype=base_dtype)
        parent, leaf = name.rsplit(".", 1)
        setattr(fresh.get_submodule(parent), leaf, wrapper)
    params = dict(fresh.named_parameters())  # a tied head appears once, under the embedding's name
    tied = {name for name, _ in fresh.named_parameters(remove_duplicate=False)} - set(params)
    buffers = {name for name, _ in fresh.named_buffers()}  # carried by ``carry``, not read from ``state``
    unknown = [name for name in state if name not in params and name not in tied and name not in buffers]
    missing = [name for name in params if name not in state]
    if unknown or missing:
        raise ConfigError(f"generation_model: the model's parameters do not match a fresh {model_class.__name__} of "
                          f"its config (unexpected: {unknown[:3]}, missing: {missing[:3]})", key="model.arch",
                          hint=f"the model has parts this function does not know; pass a plain {model_class.__name__}")
    with torch.no_grad():
        for name, value in state.items():  # the same order on every rank: collectives line up
            if name in params:
                params[name].copy_(full_tensor(value))
        if carry is not None:
            carry(model, fresh)
    fresh.tie_weights()
    if adapters and merge:
        fresh = merge_lora(fresh, inplace=True)
    for param in fresh.parameters():
        param.requires_grad_(False)
    return fresh.eval()
