"""The model trained through torch_xla SPMD (``parallel.strategy: xla_spmd``).

One process drives every XLA device of the host. The program is written as for a single
device; sharding annotations tell the XLA compiler how to split it:

- a 1-D mesh named ``"fsdp"`` over all devices;
- every parameter sharded on dim 0 over that axis (FSDP-style: the compiler inserts the
  all-gathers before use and reduce-scatters the gradients), or replicated when dim 0 does
  not divide by the device count; optimizer state follows its parameter;
- every batch tensor sharded on dim 0, the batch dimension (data parallelism).

XLA tensors are lazy: operations are recorded and run when the graph is synced. Calling
``sync()`` exactly once per optimizer step, after ``optimizer.step()``, makes every step the
same graph, so it is compiled once and replayed.

Checkpoints go through torch.distributed.checkpoint with torch_xla's SPMD planners: each
shard is written from its device without gathering the full tensor, into the same format
(reshardable) as the torch strategies. Single-host only (``build_mesh`` rejects
``xla_spmd`` on several processes).

The training loop calls::

    model, mesh, device = setup_xla_spmd(model, config.parallel)
    optimizer = build_optimizer(model.parameters())     # after setup: params live on XLA
    for each step:
        for each micro-batch:
            batch = {k: shard_batch(v.to(device), mesh) for k, v in micro.items()}
            loss = loss_fn(model(...), batch); loss.backward()
        clip_grad_norm_(model, max_norm); optimizer.step(); optimizer.zero_grad()
        sync()
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch import nn
from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner, prime_optimizer

from core.config import ParallelConfig
from core.exceptions import ConfigError
from distributed.safe_dcp import SafeFileSystemReader

MESH_AXIS = "fsdp"

__all__ = [
    "MESH_AXIS",
    "load_checkpoint",
    "parameter_spec",
    "prime_optimizer",
    "save_checkpoint",
    "setup_xla_spmd",
    "shard_batch",
    "sync",
]


def setup_xla_spmd(model: nn.Module, parallel: ParallelConfig) -> tuple[nn.Module, xs.Mesh, torch.device]:
    """Turn on SPMD, build the mesh, move ``model`` to XLA and annotate its parameters.

    Must run before any other tensor is placed on an XLA device (SPMD mode is global to the
    process). Returns the same model object, the mesh and the XLA device.
    """
    if parallel.strategy != "xla_spmd":
        raise ConfigError(
            f"setup_xla_spmd needs parallel.strategy=xla_spmd, got {parallel.strategy}",
            key="parallel.strategy",
        )
    if not xr.is_spmd():
        xr.use_spmd()
    count = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(count), (count,), (MESH_AXIS,))
    device = torch_xla.device()
    tied = _tied_parameter_slots(model)
    model.to(device)
    _retie(tied)  # moving to XLA replaces each parameter per module, splitting tied ones
    for param in model.parameters():
        xs.mark_sharding(param, mesh, parameter_spec(tuple(param.shape), count))
    return model, mesh, device


def parameter_spec(shape: tuple[int, ...], mesh_size: int) -> tuple[str | None, ...]:
    """Partition spec of a parameter: dim 0 over the mesh if it divides, else replicated."""
    if not shape:
        return ()
    first = MESH_AXIS if shape[0] % mesh_size == 0 else None
    return (first,) + (None,) * (len(shape) - 1)


def shard_batch(tensor: torch.Tensor, mesh: xs.Mesh) -> torch.Tensor:
    """Annotate an XLA batch tensor as split over the mesh on dim 0 (in place; returned)."""
    xs.mark_sharding(tensor, mesh, (MESH_AXIS,) + (None,) * (tensor.dim() - 1))
    return tensor


def sync() -> None:
    """Cut and run the recorded graph: once per optimizer step."""
    torch_xla.sync()


def save_checkpoint(state_dict: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``state_dict`` (model/optimizer state on XLA, any nesting) as a DCP checkpoint."""
    sync()
    dcp.save(state_dict, checkpoint_id=Path(path), planner=SPMDSavePlanner(), no_dist=True)


def load_checkpoint(state_dict: dict[str, Any], path: str | os.PathLike) -> None:
    """Read a DCP checkpoint into ``state_dict``'s XLA tensors in place (shardings kept).

    Loading is in place, so optimizer state must exist first: on a fresh optimizer call
    ``prime_optimizer(optimizer)`` (a zero-gradient step) before taking its state_dict.
    """
    # The restricted metadata reader: loading a checkpoint never runs code (docs/checkpoints.md).
    dcp.load(state_dict, storage_reader=SafeFileSystemReader(Path(path)), planner=SPMDLoadPlanner(), no_dist=True)
    sync()


def _tied_parameter_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) slots that hold one shared Parameter, per shared parameter."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            slots.setdefault(id(param), []).append((module, name))
    return [group for group in slots.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    for (owner, owner_name), *others in groups:
        shared = getattr(owner, owner_name)
        for module, name in others:
            setattr(module, name, shared)
