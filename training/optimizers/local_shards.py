"""Elementwise optimizer steps on the local shards of DTensor parameters.

Under FSDP2 (and TP) every parameter, gradient and optimizer state is a DTensor. An
elementwise update (AdamW, Lion, schedule-free AdamW) needs nothing from other ranks, but
called on DTensors each of its ops goes through DTensor's Python dispatch, host time that
small FSDP steps wait for. Measured (docs/performance.md, "2026-11-27h"): the optimizer
phase of Qwen2.5-0.5B on two H200s at 4,096 tokens per GPU took 13.9-14.7 ms of host time
a step against 15.6-16.9 ms through DTensor; on a CPU host a fused AdamW step over 337
FSDP2 shards took a quarter of the time.

``on_local_shards`` runs ``step`` on the local tensors instead: for the length of the call
the parameter groups list each DTensor's local shard, with the local shard of its
gradient as ``.grad`` and the local shards of its state. The kernels are the ones the
DTensor path dispatches to, on the same tensors, so the update is bit for bit the same.
Outside ``step`` nothing changes: ``optimizer.state`` holds DTensors keyed by the
DTensor parameters, so checkpoints (DCP, any world size) save and load as before.
State that a first step creates for a local shard is stored back as a DTensor with its
parameter's mesh, placements, shape and stride, as DTensor's ``zeros_like`` would have.
FP8 training's weights (torchao's wrapper around the fp32 shard, ``parallel.float8``) step
on the fp32 tensor inside the wrapper: their state was plain DTensors through DTensor's
dispatch too, and stays so (tests/distributed/test_float8.py).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor


def on_local_shards(step):
    """Decorate an optimizer's ``step`` to run it on local shards (elementwise updates only)."""

    @functools.wraps(step)
    def wrapper(self, *args, **kwargs):
        with local_shards(self):
            return step(self, *args, **kwargs)

    return wrapper


@contextlib.contextmanager
def local_shards(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within the block, ``optimizer`` sees the local shards of its DTensor parameters
    (unless its ``step_on_local_shards`` attribute is False: then DTensor dispatches)."""
    if not getattr(optimizer, "step_on_local_shards", True):
        yield
        return
    swaps: list[tuple[DTensor, torch.Tensor, dict]] = []  # (param, local, its state on the way in)
    originals = [group["params"] for group in optimizer.param_groups]
    state = optimizer.state
    try:
        for group, params in zip(optimizer.param_groups, originals):
            locals_ = []
            for param in params:
                if not _swappable(param):
                    locals_.append(param)
                    continue
                local = _plain_local(param)
                local.grad = None if param.grad is None else param.grad._local_tensor
                before = dict(state[param]) if param in state else {}
                if before:
                    state[local] = {k: _local(v) for k, v in before.items()}
                swaps.append((param, local, before))
                locals_.append(local)
            group["params"] = locals_
        yield
    finally:
        for group, params in zip(optimizer.param_groups, originals):
            group["params"] = params
        for param, local, before in swaps:
            local.grad = None
            after = state.pop(local, None) or {}
            for key, value in after.items():  # what the step created or replaced, as DTensors
                if key not in before or value is not _local(before[key]):
                    state[param][key] = _like_param(value, param, local)


def _swappable(param: torch.Tensor) -> bool:
    """A DTensor parameter whose gradient is split the same way (no pending sums) into plain
    local tensors, of at least one dimension (a 0-dim parameter's state could not be told
    from a step counter), holding a plain tensor (``_plain_local``)."""
    if not isinstance(param, DTensor) or param.dim() == 0 or _plain_local(param) is None:
        return False
    grad = param.grad
    if grad is None:
        return True
    return (
        isinstance(grad, DTensor)
        and type(grad._local_tensor) is torch.Tensor
        and grad.placements == param.placements
        and grad.device_mesh == param.device_mesh
    )


def _plain_local(param: DTensor) -> torch.Tensor | None:
    """The plain tensor that holds ``param``'s local shard: the local tensor itself, or the
    fp32 tensor inside torchao's FP8 weight wrapper (``parallel.float8`` under FSDP), which
    the wrapper hands every op to, so an update of it is the wrapper's update. None for any
    other tensor subclass, which keeps the DTensor path."""
    local = param._local_tensor
    if type(local) is torch.Tensor:
        return local
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")  # imported wherever FP8 weights exist
    if fsdp_utils is not None and isinstance(local, fsdp_utils.WeightWithDynamicFloat8CastTensor):
        inner = local._tensor
        return inner if type(inner) is torch.Tensor else None
    return None


def _local(value):
    return value._local_tensor if isinstance(value, DTensor) else value


def _like_param(value, param: DTensor, local: torch.Tensor):
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape:
        return DTensor.from_local(
            value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return value


class LocalShardAdamW(torch.optim.AdamW):
    """torch's AdamW, stepping on the local shards of DTensor parameters (same update)."""

    step = on_local_shards(torch.optim.AdamW.step)
