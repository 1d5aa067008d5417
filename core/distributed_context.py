"""The single source of truth for rank, world size, device and backend.

``DistributedContext.from_env`` reads torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``...) or, without it, describes a single process. The process
group is created here and always destroyed by ``close()``; use the context as a ``with``
block so that also happens on error. Every other layer asks this object, never the
environment, who it is.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from core.config import ParallelConfig
from core.exceptions import ConfigError

LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "GROUP_RANK",
    "ROLE_RANK",
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "CUDA_VISIBLE_DEVICES",
)


@dataclass(frozen=True)
class ProcessInfo:
    """Rank facts read from the launcher's environment, before any process group exists."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int = 1

    @classmethod
    def from_env(cls) -> "ProcessInfo":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            local_rank=local_rank,
            # torchrun sets it; without it, local rank i shows at least i + 1 ranks per node.
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1))),
        )


def select_device(
    parallel: ParallelConfig, local_rank: int, local_world_size: int = 1, *, environ: dict[str, str] | None = None
) -> torch.device:
    """This rank's device: ``cuda:<local_rank>`` when CUDA is wanted (``cuda``, or ``auto``
    with a GPU visible), else the CPU.

    A ConfigError, before any process group exists, when the node's ranks would share a
    GPU: NCCL refuses that, but only at the first collective and in its own words. A
    launcher that hands each process one GPU of its own (``CUDA_VISIBLE_DEVICES`` set, one
    device visible) is the exception: every rank then uses its ``cuda:0``.
    """
    env = os.environ if environ is None else environ
    want_cuda = parallel.device == "cuda" or (parallel.device == "auto" and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 0:
        raise ConfigError(
            "parallel.device=cuda, but no CUDA device is visible",
            key="parallel.device",
            hint="check CUDA_VISIBLE_DEVICES and the driver (nvidia-smi), or set parallel.device=cpu",
        )
    own_gpu = count == 1 and "CUDA_VISIBLE_DEVICES" in env
    if local_world_size > count and not own_gpu:
        raise ConfigError(
            f"{local_world_size} ranks on this node but {count} visible GPU(s): ranks would share a GPU "
            f"(parallel.device={parallel.device})",
            key="parallel.device",
            hint=f"start at most {count} ranks per node (torchrun --nproc_per_node={count}), "
            "or train on the CPU with parallel.device=cpu",
        )
    return torch.device("cuda", local_rank % count)


def select_backend(parallel: ParallelConfig, device: torch.device) -> str:
    if parallel.backend != "auto":
        return parallel.backend
    return "nccl" if device.type == "cuda" else "gloo"


class DistributedContext:
    """Who this process is and how it talks to the others.

    Collectives are no-ops (returning their input) in a single process, so callers never
    branch on the world size.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        device: torch.device,
        backend: str,
        timeout_s: float,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._owns_group = False
        self._object_group: Any = None

    @classmethod
    def from_env(cls, parallel: ParallelConfig) -> "DistributedContext":
        info = ProcessInfo.from_env()
        device = select_device(parallel, info.local_rank, info.local_world_size)
        ctx = cls(
            rank=info.rank,
            world_size=info.world_size,
            local_rank=info.local_rank,
            device=device,
            backend=select_backend(parallel, device),
            timeout_s=parallel.timeout_s,
        )
        ctx.init_process_group()
        return ctx

    # ------------------------------------------------------------------ lifecycle

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def init_process_group(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if not self.is_distributed or dist.is_initialized():
            return
        kwargs: dict[str, Any] = {"backend": self.backend, "timeout": self.timeout}
        if self.device.type == "cuda":
            kwargs["device_id"] = self.device
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps one store across worker restarts: without a prefix per
            # attempt, a restarted worker would read the previous attempt's peer addresses.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=self.timeout)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            kwargs.update(store=dist.PrefixStore(f"attempt_{attempt}", store), rank=self.rank,
                          world_size=self.world_size)
        dist.init_process_group(**kwargs)
        self._owns_group = True
        # Object collectives go over gloo so they never stage pickles through GPU memory.
        self._object_group = (
            dist.new_group(backend="gloo", timeout=self.timeout) if self.backend != "gloo" else None
        )

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    def __enter__(self) -> "DistributedContext":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ collectives

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier(group=self._object_group)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of ``tensor`` (sum, max, min, avg); returns it."""
        return self._all_reduce(tensor, op, group=None)

    def host_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of a CPU ``tensor`` over gloo; returns it.

        For values the host needs at once (target counts, the metric table): a device
        collective would queue behind the GPU's work, and reading its result would make the
        host wait for that work too, so the GPU would idle while the host prepares the next
        step.
        """
        return self._all_reduce(tensor, op, group=self._object_group)

    def _all_reduce(self, tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
        if self.is_distributed:
            ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                   "min": dist.ReduceOp.MIN}
            dist.all_reduce(tensor, op=ops[op], group=group)
            if op == "avg":
                tensor /= self.world_size
        return tensor

    @property
    def host(self) -> "HostCollective":
        """This context's collectives on CPU tensors (``host_all_reduce``)."""
        return HostCollective(self)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.is_distributed:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self._object_group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.is_distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._object_group)
        return out

    def any_true(self, flag: bool) -> bool:
        """True on every rank if any rank passes True (one small collective over gloo).

        The loop asks at every step's end. A device collective there would make the host wait
        for the GPU's whole queue (the update it just enqueued) before it could prepare the
        next step, leaving the GPU idle while it does; on four GPUs that wait cost more than
        the gradient all-reduce (docs/performance.md)."""
        if not self.is_distributed:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        self.host_all_reduce(t, op="max")
        return bool(t.item() > 0)

    def describe(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "device": str(self.device),
            "backend": self.backend,
            "timeout_s": self.timeout.total_seconds(),
        }

    def __repr__(self) -> str:
        return f"DistributedContext(rank={self.rank}/{self.world_size}, device={self.device})"


def launcher_env() -> dict[str, str]:
    """The launcher's variables, recorded in meta.json."""
    return {k: os.environ[k] for k in LAUNCHER_ENV if k in os.environ}


@dataclass(frozen=True)
class HostCollective:
    """The rank facts and an ``all_reduce`` over CPU tensors (gloo): the interface of
    ``experiments.tracking.Collective`` with ``device`` cpu."""

    context: DistributedContext

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self.context.host_all_reduce(tensor, op)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a (possibly DTensor) tensor. Collective for DTensors: every rank of
    the tensor's mesh must call it, in the same order. Shards kept on the host (FSDP's CPU
    offload) are moved to the mesh's device for the gather."""
    from torch.distributed.tensor import DTensor  # on use: most importers of this module never gather

    if not isinstance(tensor, DTensor):
        return tensor
    mesh = tensor.device_mesh
    if tensor.to_local().device.type != mesh.device_type:
        device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)
        tensor = DTensor.from_local(
            tensor.to_local().to(device), mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride()
        )
    return tensor.full_tensor()
