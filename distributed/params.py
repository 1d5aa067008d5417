"""Parameters of a parallelized model under their plain names, and a hash of their values.

Wrappers change what ``named_parameters()`` reports: DDP adds ``module.``, a
``torch.compile``-wrapped module adds ``_orig_mod.``, a checkpoint wrapper adds
``_checkpoint_wrapped_module.``. FSDP2 and TP keep names but turn parameters into DTensors
(shards). Everything here speaks the names and full values of the unwrapped model, so a
run under any strategy agrees with the same weights under any other.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

# Path segments that wrappers insert between a module and its wrapped child.
WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP / compile / checkpoint wrappers (FSDP2 wraps in place)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(getattr(model, "_checkpoint_wrapped_module", None), nn.Module):
            model = model._checkpoint_wrapped_module
        else:
            return model


def canonical_name(name: str) -> str:
    """``layers.0._checkpoint_wrapped_module.mlp.up_proj.weight`` -> ``layers.0.mlp.up_proj.weight``."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def canonical_named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Every (plain name, parameter), tied parameters under each of their names."""
    for name, param in unwrap(model).named_parameters(remove_duplicate=False):
        yield canonical_name(name), param


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a (possibly DTensor) tensor. Collective for DTensors."""
    if not isinstance(tensor, DTensor):
        return tensor
    mesh = tensor.device_mesh
    if tensor.to_local().device.type != mesh.device_type:  # FSDP CPU offload keeps shards on host
        device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)
        tensor = DTensor.from_local(
            tensor.to_local().to(device), mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride()
        )
    return tensor.full_tensor()


@torch.no_grad()
def param_hash(model: nn.Module) -> str:
    """sha256 over all parameters, identical on every rank and for every strategy.

    Canonical order: sorted by plain name. Each parameter contributes ``name``, ``dtype``
    and ``shape`` as UTF-8 text followed by the sha256 of its full tensor's bytes (its own
    dtype, C-contiguous, native little-endian order); the result is the sha256 of that
    sequence. Hashing per parameter lets the leaf digests run in parallel threads (hashlib
    releases the GIL), which matters at billions of parameters. Collective for sharded
    models: every rank must call it.
    """
    params = sorted(canonical_named_parameters(model), key=lambda item: item[0])
    entries: list[tuple[str, torch.dtype, tuple[int, ...], Future]] = []
    workers = max(1, min(8, (os.cpu_count() or 1)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="param-hash") as pool:
        for name, param in params:
            # Gathering is collective and stays on this thread, in canonical order.
            value = full_tensor(param.detach()).contiguous().cpu()
            entries.append((name, value.dtype, tuple(value.shape), pool.submit(_leaf_digest, value)))
        digest = hashlib.sha256()
        for name, dtype, shape, leaf in entries:
            digest.update(f"{name}|{dtype}|{shape}|".encode())
            digest.update(leaf.result())
    return digest.hexdigest()


def _leaf_digest(value: torch.Tensor) -> bytes:
    return hashlib.sha256(memoryview(value.reshape(-1).view(torch.uint8).numpy())).digest()
