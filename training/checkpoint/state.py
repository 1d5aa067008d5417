"""What a checkpoint holds besides files: RNG states, the staged copies of an asynchronous
save (host buffers, device snapshots), and the optimizer-state bookkeeping that lets a
never-stepped optimizer load without stepping.

Split from ``training/checkpoint/manager.py``, which keeps the directory protocol and the manager.
"""

from __future__ import annotations

import io
from typing import Any, Callable

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


def _map_tensors(value: Any, fn: Callable[[str, torch.Tensor], torch.Tensor], key: str = "") -> Any:
    """A copy of a state dict's containers with ``fn(key, tensor)`` for each (detached) tensor.

    The containers are rebuilt too, so the result shares no mutable object with ``value``.
    """
    if isinstance(value, torch.Tensor):
        return fn(key, value.detach())
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn, f"{key}[{i}]") for i, v in enumerate(value))
    return value  # ints, floats, strings, bools: immutable


def cuda_bytes(value: Any) -> int:
    """Bytes of the CUDA tensors in a state dict (local shards of DTensors): a snapshot's size."""
    return tensor_bytes(value, cuda_only=True)


def tensor_bytes(value: Any, *, cuda_only: bool = False) -> int:
    """Bytes of the tensors in a state dict (this rank's local shards of DTensors)."""
    if isinstance(value, torch.Tensor):
        return _local(value).nbytes if value.is_cuda or not cuda_only else 0
    if isinstance(value, dict):
        return sum(tensor_bytes(v, cuda_only=cuda_only) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v, cuda_only=cuda_only) for v in value)
    return 0


class HostBuffers:
    """Host copies of state-dict tensors that later training steps cannot change.

    The buffers are kept and refilled by the next asynchronous save, so only the first save
    pays for faulting in fresh host memory (several times the copy itself, on our CPU box). That
    costs one resident host copy of this rank's state, and is safe because a save starts
    only after the previous one finished with the buffers. DTensors stay DTensors.

    The copies are issued on the current stream; the caller synchronizes it before reading.
    This is ``checkpoint.staging: host``, on the loop's thread; a device snapshot is copied
    by ``SnapshotBuffers`` instead.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, state: dict[str, Any]) -> dict[str, Any]:
        return _map_tensors(state, self._copy_tensor)

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


class SnapshotBuffers:
    """Reused pageable host copies of a ``DeviceSnapshot``, filled on the save thread through
    two small pinned chunks.

    Neither plain way worked on an H200 with a Qwen3-1.7B (22 GB with AdamW state): copying
    straight into pageable memory (about 1.5 GB/s, through the driver's own staging) made the
    steps after the save 15 s slower in all, and pinning 22 GB of buffers first (cudaHostAlloc,
    seconds) 10.7 s. Here the only pinned memory is ``2 * chunk_bytes``, allocated on the
    first save and kept: the device-to-host copy into one chunk (asynchronous, on the save
    thread's stream) overlaps the CPU copy out of the other into the pageable buffer.

    ``stream=None`` (a CPU run) does the same copies synchronously, so the chunking is tested
    without a GPU. Like ``HostBuffers``, the buffers are refilled by the next save, and
    DTensors stay DTensors.
    """

    def __init__(self, chunk_bytes: int = 64 << 20) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self._chunk_bytes = chunk_bytes
        self._buffers: dict[str, tuple[tuple, torch.Tensor]] = {}
        self._chunks: list[torch.Tensor] = []

    def copy(self, state: dict[str, Any], stream: torch.cuda.Stream | None = None) -> dict[str, Any]:
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def target(key: str, tensor: torch.Tensor) -> torch.Tensor:
            buffer = self._buffer(key, tensor)
            pairs.append((_local(tensor), _local(buffer)))
            return buffer

        host = _map_tensors(state, target)
        self._copy_chunked(pairs, stream)
        return host

    def _buffer(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        layout = _layout(tensor)
        cached = self._buffers.get(key)
        if cached is not None and cached[0] == layout:
            return cached[1]
        # Contiguous whatever the source's strides, so it can be filled as a flat byte range.
        buffer = torch.empty_like(tensor, device="cpu", memory_format=torch.contiguous_format)
        self._buffers[key] = (layout, buffer)
        return buffer

    def _staging_chunks(self, pinned: bool) -> list[torch.Tensor]:
        if len(self._chunks) != 2 or self._chunks[0].is_pinned() != pinned:
            self._chunks = [torch.empty(self._chunk_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        return self._chunks

    def _copy_chunked(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: torch.cuda.Stream | None) -> None:
        chunks = self._staging_chunks(pinned=stream is not None)
        done = [torch.cuda.Event(), torch.cuda.Event()] if stream is not None else [None, None]
        pending: tuple[int, int, torch.Tensor] | None = None  # (chunk, bytes, destination) not yet drained
        slot = 0

        def drain(chunk: int, nbytes: int, destination: torch.Tensor) -> None:
            if done[chunk] is not None:
                done[chunk].synchronize()
            destination.copy_(chunks[chunk][:nbytes])

        for source, destination in pairs:
            src, dst = _as_bytes(source, stream), _as_bytes(destination, None)
            for start in range(0, src.numel(), self._chunk_bytes):
                nbytes = min(self._chunk_bytes, src.numel() - start)
                # The chunk written now was drained two iterations ago, on this thread.
                if stream is not None:
                    with torch.cuda.stream(stream):
                        chunks[slot][:nbytes].copy_(src[start : start + nbytes], non_blocking=True)
                        done[slot].record(stream)
                else:
                    chunks[slot][:nbytes].copy_(src[start : start + nbytes])
                if pending is not None:
                    drain(*pending)
                pending = (slot, nbytes, dst[start : start + nbytes])
                slot ^= 1
        if pending is not None:
            drain(*pending)


def _as_bytes(tensor: torch.Tensor, stream: torch.cuda.Stream | None) -> torch.Tensor:
    """The tensor's elements as a flat uint8 view (a contiguous copy first if need be)."""
    if not tensor.is_contiguous():
        if stream is not None:
            with torch.cuda.stream(stream):  # allocated and freed in the copy stream's order
                tensor = tensor.contiguous()
        else:
            tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8)


class DeviceSnapshot:
    """A copy of a state dict on the tensors' own device (``checkpoint.staging: device``).

    Taking it blocks the training loop only for allocating and enqueueing one device-memory
    clone per tensor, instead of a device-to-host copy (into freshly pinned memory on the
    first save: 16 s for the 22 GB of a Qwen3-1.7B with AdamW state on an H200). The clones
    run on the current stream and a CUDA event is recorded after them: the optimizer
    kernels the loop enqueues next run after the clones, so they cannot change them.

    ``to_host`` runs on the save thread: a side stream waits for the event, the snapshot is
    copied into the reused ``SnapshotBuffers`` on that stream and the stream is synchronized;
    then the snapshot is dropped, so its device memory returns to the caching allocator (the
    blocks belong to the loop's stream, and the side stream's reads have finished).

    ``device`` is the rank's device; on a CPU the snapshot is a plain clone, so the same path
    runs (and is tested) without a GPU.
    """

    def __init__(self, state: dict[str, Any], device: torch.device) -> None:
        self._state: dict[str, Any] | None = _map_tensors(state, _clone)
        self._device = device
        self._ready: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(device))  # the stream the clones ran on

    def to_host(self, buffers: SnapshotBuffers) -> dict[str, Any]:
        """Copy into ``buffers`` and free the device copy; once, on the save thread."""
        state, self._state = self._state, None  # the last reference: freed when this returns
        if self._ready is None:
            return buffers.copy(state)
        # A new thread's current device is cuda:0, whatever the rank's device: make the rank's
        # current here, so nothing below creates a context on (or allocates from) cuda:0.
        with torch.cuda.device(self._device):
            stream = torch.cuda.Stream(device=self._device)
            stream.wait_event(self._ready)
            host = buffers.copy(state, stream)
            stream.synchronize()  # before the snapshot is freed
        return host


def _clone(key: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type not in ("cuda", "cpu"):
        # A lazy (XLA) clone records only; the save thread would then run the graph.
        raise CheckpointError(
            f"checkpoint.staging=device snapshots CUDA and CPU tensors, not {tensor.device.type} ones",
            key=key,
            hint="set checkpoint.staging=host (auto chooses host there)",
        )
    # A DTensor's clone is a DTensor with the same mesh, placements, shape and stride (a
    # pointwise op on the local shard, no communication), so DCP plans the same shards.
    return tensor.clone()


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


def add_optimizer_placeholders(optimizer: torch.optim.Optimizer, metadata: dict[str, Any],
                               optim_key: str = OPTIM_KEY) -> None:
    """Give each parameter without state a zero placeholder per state name in the checkpoint
    (the state under ``optim_key``: a trained part's, see ``training.checkpoint.manager.part_keys``)."""
    prefix = f"{optim_key}.{OPTIM_STATE_PREFIX}"
    specs: dict[str, Any] = {}
    for key, meta in metadata.items():
        if key.startswith(prefix):
            specs.setdefault(key.rsplit(".", 1)[1], meta)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad and not optimizer.state.get(param):
                optimizer.state[param] = {name: _placeholder(param, m) for name, m in specs.items()}


def drop_state_absent_from_checkpoint(
    optimizer: torch.optim.Optimizer, osd: dict[str, Any], saved_keys: set[str], optim_key: str = OPTIM_KEY
) -> None:
    """Parameters that had no optimizer state at save time get none after load either."""
    owner = {id(v): p for p, s in optimizer.state.items() for v in s.values() if isinstance(v, torch.Tensor)}
    keys_by_fqn: dict[str, list[str]] = {}
    for key in osd:
        if key.startswith(OPTIM_STATE_PREFIX):
            keys_by_fqn.setdefault(key[len(OPTIM_STATE_PREFIX) :].rsplit(".", 1)[0], []).append(key)
    for fqn, keys in keys_by_fqn.items():
        present = [k for k in keys if f"{optim_key}.{k}" in saved_keys]
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


def check_frozen(expected: dict[str, dict[str, str]], saved: dict[str, dict[str, str]]) -> None:
    """A frozen model (reference, teacher, base) must be the one the checkpoint was made with."""
    for role in sorted(set(expected) | set(saved)):
        now, then = expected.get(role), saved.get(role)
        if now != then:
            raise CheckpointError(
                f"the frozen {role} model differs from the checkpoint's: "
                f"checkpoint {then or 'none'}, now {now or 'none'}",
                hint="resume with the frozen model the run started with (same path and weights)",
            )
