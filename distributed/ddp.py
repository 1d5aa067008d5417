"""DistributedDataParallel: a full replica per data-parallel rank, gradients all-reduced.

Built over the 1-D ``dp_replicate`` mesh dimension. When tensor parallelism is on, that
mesh is a slice of the 3-D mesh and DDP prepares the TP-sharded (DTensor) parameters
itself, so DDP and TP compose. Buffers are not broadcast every forward: every rank builds
them identically (RoPE tables), and the broadcast would cost a collective per step.

Parameters stored as a quantized tensor subclass (QLoRA's frozen NF4 base, models/nf4.py)
are left out of DDP altogether. DDP broadcasts rank 0's parameters when it wraps the model;
its coalesced broadcast flattens plain storages, and an NF4 weight has none of its own (its
bytes live in inner tensors), so on two ranks the broadcast scrambled the base that every
rank had quantized identically (tests/training/test_qlora_e2e.py). They are frozen, so DDP
has no gradient of theirs to reduce either.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from distributed.params import is_packed


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Wrap ``model`` (already on ``device``); returns the DDP module."""
    packed = [name for name, param in model.named_parameters() if is_packed(param)]
    if packed:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, packed)
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        device_mesh=dp_mesh,
        gradient_as_bucket_view=True,
    )
