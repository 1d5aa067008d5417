"""DistributedDataParallel: a full replica per data-parallel rank, gradients all-reduced.

Built over the 1-D ``dp_replicate`` mesh dimension. When tensor parallelism is on, that
mesh is a slice of the 3-D mesh and DDP prepares the TP-sharded (DTensor) parameters
itself, so DDP and TP compose. Buffers are not broadcast every forward: every rank builds
them identically (RoPE tables), and the broadcast would cost a collective per step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Wrap ``model`` (already on ``device``); returns the DDP module."""
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        device_mesh=dp_mesh,
        gradient_as_bucket_view=True,
    )
