"""Gradient helpers that give the same answer under every strategy.

``clip_grad_norm_`` returns the norm of the *whole* model's gradient. Plain and DDP
gradients are full tensors (identical on all ranks after DDP's all-reduce), so torch's own
norm applies. FSDP and TP gradients are DTensor shards: each rank sums ``|g|^p`` over its
local shards, the partial sums are all-reduced over the mesh dimensions the gradients are
sharded on (not the replicated ones, which would count them twice), and the p-th root is
taken. Shards are grouped by (mesh, sharded dims) so the cost is one small all-reduce per
group and dimension, not per parameter; where a mesh has an expert-parallel dimension of size
> 1, by the ranks those dims span instead, so the experts' squares (on the ep mesh) and the
other parameters' (on the flattened data-parallel one) add in one group as they do at ep=1.

``no_sync`` skips the gradient reduction of the micro-batches before the last one.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel

from distributed import expert_parallel

EXPERT_DIM = "ep"
"""The mesh dimension expert parallelism splits experts over (distributed/topology.py's MESH_DIMS)."""


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (``<= 0``: measure only).

    Returns the global norm before clipping: a plain fp32 scalar tensor, equal on every
    rank. Collective under FSDP/TP: every rank must call it.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    if any(isinstance(g, DTensor) for g in grads):
        total = _sharded_total_norm(grads, float(norm_type))
    else:
        total = torch.nn.utils.get_total_norm(grads, norm_type).float()
    if max_norm > 0:
        _scale_(grads, max_norm, total)
    return total


def _sharded_total_norm(grads: list[torch.Tensor], p: float) -> torch.Tensor:
    views = [_local_view(grad) for grad in grads]
    by_ranks = any(mesh is not None and EXPERT_DIM in (mesh.mesh_dim_names or ())
                   and mesh.size(mesh.mesh_dim_names.index(EXPERT_DIM)) > 1 for mesh, _, _ in views)
    groups: dict[object, tuple[DeviceMesh | None, tuple[int, ...], list[torch.Tensor]]] = {}
    for mesh, dims, local in views:
        # Under expert parallelism the experts live on another mesh than the parameters around them,
        # over the same ranks: grouped by those ranks, the squares add in one group in parameter
        # order, as they do at ep=1.
        key = _reduced_ranks(mesh, dims) if by_ranks else (mesh, dims)
        groups.setdefault(key, (mesh, dims, []))[2].append(local)
    total: torch.Tensor | None = None
    for mesh, dims, locals_ in groups.values():  # insertion order: the same on every rank
        norm = torch.nn.utils.get_total_norm(locals_, p).float()
        if mesh is not None:
            norm = norm.to(_mesh_device(mesh))
        part = norm if math.isinf(p) else norm.pow(p)
        for dim in dims:
            op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
            dist.all_reduce(part, op=op, group=mesh.get_group(dim))
        if total is None:
            total = part
        else:
            part = part.to(total.device)
            total = torch.maximum(total, part) if math.isinf(p) else total + part
    assert total is not None
    return total if math.isinf(p) else total.pow(1.0 / p)


def _reduced_ranks(mesh: DeviceMesh | None, dims: tuple[int, ...]) -> tuple[int, ...]:
    """The global ranks whose partial sums a gradient on ``mesh`` split over ``dims`` adds up (this rank's slice)."""
    if mesh is None:
        return ()
    coordinate = mesh.get_coordinate()
    ranks = mesh.mesh[tuple(slice(None) if i in dims else c for i, c in enumerate(coordinate))]
    return tuple(sorted(ranks.flatten().tolist()))


def _local_view(grad: torch.Tensor) -> tuple[DeviceMesh | None, tuple[int, ...], torch.Tensor]:
    """(mesh, mesh dims the gradient is split over, this rank's piece)."""
    if not isinstance(grad, DTensor):
        return None, (), grad
    if any(pl.is_partial() for pl in grad.placements):  # pending sums: finish them first
        grad = grad.redistribute(
            placements=[Replicate() if pl.is_partial() else pl for pl in grad.placements]
        )
    dims = tuple(i for i, pl in enumerate(grad.placements) if not pl.is_replicate())
    return grad.device_mesh, dims, grad.to_local()


def _scale_(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # One multi-tensor kernel per (device, dtype) rather than one kernel per parameter.
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        groups.setdefault((local.device, local.dtype), []).append(local)
    for (device, dtype), locals_ in groups.items():
        torch._foreach_mul_(locals_, coef.to(device=device, dtype=dtype))


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally inside the block (DDP ``no_sync``; FSDP skips its
    reduce-scatter); the first backward after it reduces everything accumulated."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            with expert_parallel.accumulating(model):  # experts split over ep: sums kept by source
                yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield
