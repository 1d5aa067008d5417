"""What a checkpoint holds besides files: RNG states, host copies for asynchronous saves,
and the optimizer-state bookkeeping that lets a never-stepped optimizer load without stepping.

Split from ``training/checkpointing.py``, which keeps the directory protocol and the manager.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.tensor import DTensor

from core.exceptions import CheckpointError

OPTIM_KEY = "optim"
OPTIM_STATE_PREFIX = "state."  # flattened optimizer keys: state.<fqn>.<name>

RNG_STATE_VERSION = 1
RNG_KEY_VERSION = "version"
RNG_KEY_CPU = "cpu"
RNG_KEY_DEVICE_TYPE = "device_type"
RNG_KEY_DEVICE = "device"


# --------------------------------------------------------------------------- RNG


def capture_rng_state(device: torch.device | str) -> dict[str, Any]:
    """This process's torch CPU generator state, plus the CUDA generator's on a CUDA device."""
    device = torch.device(device)
    return {
        RNG_KEY_VERSION: RNG_STATE_VERSION,
        RNG_KEY_CPU: torch.get_rng_state(),
        RNG_KEY_DEVICE_TYPE: device.type,
        RNG_KEY_DEVICE: torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def restore_rng_state(state: dict[str, Any], device: torch.device | str) -> None:
    """Restore a ``capture_rng_state`` result. A CUDA state is restored only onto CUDA."""
    device = torch.device(device)
    if state.get(RNG_KEY_VERSION) != RNG_STATE_VERSION:
        raise CheckpointError(
            f"RNG state version {state.get(RNG_KEY_VERSION)!r} is not {RNG_STATE_VERSION}",
            hint="resume with the Lockstep version that wrote the checkpoint",
        )
    torch.set_rng_state(state[RNG_KEY_CPU])
    if state[RNG_KEY_DEVICE] is not None and device.type == state[RNG_KEY_DEVICE_TYPE] == "cuda":
        torch.cuda.set_rng_state(state[RNG_KEY_DEVICE], device)


def encode_rng_state(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


# --------------------------------------------------------------------------- state dicts


def has_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    return any(bool(state) for state in optimizer.state.values())


class HostBuffers:
    """Host copies of state-dict tensors that later training steps cannot change.

    The buffers are kept and refilled by the next asynchronous save, so only the first save
    pays for faulting in fresh host memory (several times the copy itself, on our CPU box). That
    costs one resident host copy of this rank's state, and is safe because a save starts
    only after the previous one finished with the buffers. DTensors stay DTensors.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, value: Any, key: str = "") -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(key, value.detach())
        if isinstance(value, dict):
            return {k: self.copy(v, f"{key}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.copy(v, f"{key}[{i}]") for i, v in enumerate(value))
        return value  # ints, floats, strings, bools: immutable

    def _copy_tensor(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or _layout(buffer) != _layout(tensor):
            if tensor.is_cuda and not isinstance(tensor, DTensor):
                # Pinned memory: the device-to-host copy runs at full PCIe speed, async.
                buffer = torch.empty_like(tensor, device="cpu", pin_memory=True)
                buffer.copy_(tensor, non_blocking=True)
                self._buffers[key] = buffer
            else:
                buffer = self._buffers[key] = tensor.to("cpu", copy=True)
        else:
            _local(buffer).copy_(_local(tensor), non_blocking=_local(buffer).is_pinned())
        return buffer


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _layout(tensor: torch.Tensor) -> tuple:
    spec = (tensor.device_mesh, tensor.placements) if isinstance(tensor, DTensor) else None
    return type(tensor), tensor.shape, tensor.stride(), tensor.dtype, _local(tensor).shape, spec


def _placeholder(param: torch.Tensor, meta: Any) -> Any:
    if isinstance(meta, BytesStorageMetadata):
        return 0  # DCP replaces non-tensor values wholesale
    if meta.size == torch.Size([]):
        return torch.zeros((), dtype=meta.properties.dtype)
    return torch.zeros_like(param, dtype=meta.properties.dtype)


def add_optimizer_placeholders(optimizer: torch.optim.Optimizer, metadata: dict[str, Any]) -> None:
    """Give each parameter without state a zero placeholder per state name in the checkpoint."""
    prefix = f"{OPTIM_KEY}.{OPTIM_STATE_PREFIX}"
    specs: dict[str, Any] = {}
    for key, meta in metadata.items():
        if key.startswith(prefix):
            specs.setdefault(key.rsplit(".", 1)[1], meta)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad and not optimizer.state.get(param):
                optimizer.state[param] = {name: _placeholder(param, m) for name, m in specs.items()}


def drop_state_absent_from_checkpoint(
    optimizer: torch.optim.Optimizer, osd: dict[str, Any], saved_keys: set[str]
) -> None:
    """Parameters that had no optimizer state at save time get none after load either."""
    owner = {id(v): p for p, s in optimizer.state.items() for v in s.values() if isinstance(v, torch.Tensor)}
    keys_by_fqn: dict[str, list[str]] = {}
    for key in osd:
        if key.startswith(OPTIM_STATE_PREFIX):
            keys_by_fqn.setdefault(key[len(OPTIM_STATE_PREFIX) :].rsplit(".", 1)[0], []).append(key)
    for fqn, keys in keys_by_fqn.items():
        present = [k for k in keys if f"{OPTIM_KEY}.{k}" in saved_keys]
        if len(present) == len(keys):
            continue
        if present:
            missing = sorted(set(keys) - set(present))
            raise CheckpointError(
                f"the checkpoint's optimizer state for {fqn} lacks {missing}",
                key=fqn,
                hint="load with the optimizer type and settings the checkpoint was saved with",
            )
        params = {owner[id(osd[k])] for k in keys if id(osd[k]) in owner}
        if not params:
            raise CheckpointError(f"optimizer state of {fqn} holds no tensors; cannot drop it", key=fqn)
        for k in keys:
            del osd[k]
        for param in params:
            optimizer.state.pop(param, None)


def check_nothing_left_behind(saved_keys: set[str], request: dict[str, dict[str, Any]]) -> None:
    """Refuse a checkpoint that holds model/optimizer entries this model would silently skip."""
    requested = {f"{top}.{key}" for top, sub in request.items() for key in sub}
    skipped = []
    for key in saved_keys:
        parts = key.split(".")
        if not any(".".join(parts[:n]) in requested for n in range(2, len(parts) + 1)):
            skipped.append(key)
    if skipped:
        skipped.sort()
        raise CheckpointError(
            f"the checkpoint holds {len(skipped)} entries this model/optimizer has no place for, "
            f"e.g. {skipped[:3]}",
            hint="load into the same architecture and optimizer the checkpoint was saved with",
        )
