"""Parameters of a parallelized model under their plain names, and a hash of their values.

Wrappers change what ``named_parameters()`` reports: DDP adds ``module.``, a
``torch.compile``-wrapped module adds ``_orig_mod.``, a checkpoint wrapper adds
``_checkpoint_wrapped_module.``. FSDP2 and TP keep names but turn parameters into DTensors
(shards). Everything here speaks the names and full values of the unwrapped model, so a
run under any strategy agrees with the same weights under any other.
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from core.distributed_context import full_tensor

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
    """``blocks.0._checkpoint_wrapped_module.ffn.weight`` -> ``blocks.0.ffn.weight``."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def canonical_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict under plain names (DTensor shards stay shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(unwrap(model))


def canonical_named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Every (plain name, parameter), tied parameters under each of their names."""
    for name, param in unwrap(model).named_parameters(remove_duplicate=False):
        yield canonical_name(name), param


def dequantized_shards(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded packed tensor (torchao's NF4 under FSDP2) as a DTensor of the plain values
    its local shard dequantizes to, so that gathering it moves plain tensors; anything else
    unchanged.

    Gathering the packed DTensor itself sends each of NF4's packed parts through a
    functional collective, and on gloo its wait crashed the process now and then (SIGSEGV or
    SIGABRT "malloc(): unaligned tcache chunk detected" in ``wait_tensor``, in one of seven
    two-rank runs of ``tests/models/test_lora.py``'s QLoRA case). The values are the same bit
    for bit: a shard holds whole quantization blocks (torchao's sharding requires it), the
    block statistics that span shards are replicated, and dequantizing is elementwise.
    """
    if not isinstance(tensor, DTensor) or not is_packed(tensor.to_local()):
        return tensor
    local = tensor.to_local()
    values = torch.ops.aten._to_copy(local, dtype=local.dtype)
    return DTensor.from_local(values, tensor.device_mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride())


@torch.no_grad()
def param_hash(model: nn.Module) -> str:
    """sha256 over all parameters, identical on every rank and for every strategy.

    Canonical order: sorted by plain name. Each parameter contributes ``name``, ``dtype``,
    ``shape`` and a 128-bit fingerprint of its full tensor's bits as UTF-8 text; the result
    is the sha256 of that sequence. The fingerprint (``fingerprint``) is exact integer
    arithmetic computed where the tensor lives, so hashing a 1.7B model on a GPU takes
    milliseconds instead of the seconds a copy to host plus a byte-wise sha256 took (16 s,
    then 6 s with threads, on an H200 machine), and a CPU and a GPU agree on it. Collective
    for sharded models (DTensors are gathered one by one): every rank must call it.
    """
    params = sorted(canonical_named_parameters(model), key=lambda item: item[0])
    entries: list[tuple[str, torch.dtype, tuple[int, ...], torch.Tensor]] = []
    for name, param in params:
        # Gathering is collective: every rank, in canonical order.
        value = full_tensor(dequantized_shards(param.detach()))
        if value.device.type not in ("cpu", "cuda"):  # lazy devices (XLA): read it once
            value = value.cpu()
        entries.append((name, value.dtype, tuple(value.shape), fingerprint(value)))
    if entries:  # one device-to-host read for all of them
        device = entries[0][3].device
        sums = torch.stack([fp.to(device) for _, _, _, fp in entries]).cpu()
    else:
        sums = torch.zeros(0, 2, dtype=torch.int64)
    digest = hashlib.sha256()
    for (name, dtype, shape, _), pair in zip(entries, sums.tolist()):
        digest.update(f"{name}|{dtype}|{shape}|{pair[0] & _U64:016x}{pair[1] & _U64:016x}|".encode())
    return digest.hexdigest()


_U64 = (1 << 64) - 1
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Odd 64-bit constants (as signed int64), from the golden ratio and splitmix64.
_K = (-7046029254386353131, -4658895280553007687, -7723592293110705685, 1609587929392839161)
_CHUNK = 1 << 24


def is_packed(tensor: torch.Tensor) -> bool:
    """A wrapper tensor subclass that packs its values (a quantized weight): its bits cannot
    be viewed as one plain tensor, and their layout may depend on how it was sharded and
    gathered, so it is hashed by the plain values it dequantizes to."""
    if type(tensor) in (torch.Tensor, nn.Parameter) or isinstance(tensor, DTensor):
        return False
    return hasattr(tensor, "__tensor_flatten__")


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Two position-weighted sums of a tensor's bit patterns, int64 (2,), on its device.

    Each element's bits (as an integer of the element's width) are mixed and multiplied by an
    odd weight derived from its flat index; the products are summed modulo 2**64. Integer
    sums do not depend on the order of addition, so the result is exact and the same on any
    device and for any kernel. Any single changed element changes both sums; two
    independent weightings make structured collisions vanishingly unlikely. Not a
    cryptographic hash: it detects divergence, it does not resist tampering.
    """
    if is_packed(tensor):  # a quantized subclass (torchao's NF4): the values it stands for
        return fingerprint(torch.ops.aten._to_copy(tensor, dtype=tensor.dtype))
    flat = tensor.detach().contiguous().reshape(-1)
    words = flat.view(_INT_OF_WIDTH[flat.element_size()])
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start : start + _CHUNK].to(torch.int64)
        index = torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device)
        mixed = (w ^ (w >> 17)) * _K[2]
        sums[0] += (w * ((index * _K[0]) | 1)).sum()
        sums[1] += ((mixed ^ (mixed >> 31)) * ((index * _K[1] + _K[3]) | 1)).sum()
    return sums
