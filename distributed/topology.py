"""How the ranks are arranged: a DeviceMesh with named dimensions, and who feeds which data.

The mesh is always four-dimensional, ``("dp_replicate", "dp_shard", "ep", "tp")``, with the
tensor-parallel dimension innermost so that a TP group is made of consecutive ranks (the
GPUs of one node, joined by the fastest links). Dimensions of size 1 are kept so code can
slice by name without asking which parallelisms are on.

- ``ddp``: every rank holds a full replica: ``dp_replicate = world``, ``dp_shard = 1``,
  ``ep = 1``, ``tp = 1`` (tensor and expert parallelism compose with fsdp only).
- ``fsdp``: ``dp_shard * ep = world / (tp * dp_replicate)``; ``dp_replicate > 1`` is HSDP
  (shard inside a group, replicate across groups).
- ``none`` (one process) and ``xla_spmd`` (one process drives every XLA device) need no
  torch mesh.

Expert parallelism (``parallel.ep``) borrows its ranks from the data-parallel ones, as it
usually does: an ep group is ``ep`` consecutive data-parallel ranks (inside the tp groups'
order), each reading its own data, so ``dp_size`` counts them. The parameters outside the
experts are sharded over the whole shard dimension, ``dp_shard x ep`` (flattened to one
mesh dimension, ``dp_shard_ep``, when ``ep > 1``); ``ep_mesh`` is the dimension the
experts of a plan's stacks are split over (distributed/expert_parallel.py), and
``expert_dp_mesh`` the data-parallel part FSDP shards those experts over further. At ``ep = 1`` the data-parallel mesh is the one
without the axis. A model whose plan declares no experts refuses ``ep > 1``
(distributed.model_structure.check_expert_parallel).

All ranks of one TP group read the same data, so the data pipeline is built with
``rank=topology.dp_rank, world_size=topology.dp_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from core.config import ParallelConfig
from core.distributed_context import DistributedContext
from core.exceptions import ConfigError

MESH_DIMS = ("dp_replicate", "dp_shard", "ep", "tp")
SHARD_EP_DIM = "dp_shard_ep"
"""The flattened ``("dp_shard", "ep")`` dimension that FSDP shards over when ``ep > 1``."""


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the four mesh dimensions (their product is the world size)."""

    dp_replicate: int
    """Replicas of the (sharded) model: DDP's ranks, or HSDP's replica groups."""
    dp_shard: int
    """Data-parallel ranks that shard the model together, outside the expert-parallel ones."""
    tp: int
    """Tensor-parallel degree: ranks that split each block's projections."""
    ep: int = 1
    """Expert-parallel degree: data-parallel ranks that split a plan's experts (1: none)."""

    @property
    def dp(self) -> int:
        """Data-parallel ranks: every rank of one tp group reads the same rows."""
        return self.dp_replicate * self.dp_shard * self.ep

    def as_tuple(self) -> tuple[int, int, int, int]:
        """The sizes in ``MESH_DIMS`` order."""
        return (self.dp_replicate, self.dp_shard, self.ep, self.tp)


@dataclass(frozen=True)
class Topology:
    """This rank's place in the mesh. ``mesh`` is None when no torch mesh is needed."""

    shape: MeshShape
    """The mesh's sizes."""
    dp_rank: int
    """This rank's data-parallel index (which rows it reads)."""
    tp_rank: int
    """This rank's index in its tensor-parallel group."""
    mesh: Optional[DeviceMesh]
    """The named mesh over every rank; None with one process."""

    @property
    def dp_size(self) -> int:
        return self.shape.dp

    @property
    def tp_size(self) -> int:
        return self.shape.tp

    @property
    def ep_size(self) -> int:
        return self.shape.ep

    @property
    def dp_mesh(self) -> Optional[DeviceMesh]:
        """The data-parallel part: 2-D ``(dp_replicate, shard)`` for HSDP, else 1-D; the shard
        dimension is ``dp_shard``, or ``dp_shard_ep`` (``dp_shard x ep``) when ``ep > 1``."""
        if self.mesh is None:
            return None
        shard, shard_size = ("dp_shard", self.shape.dp_shard) if self.shape.ep == 1 else \
            (SHARD_EP_DIM, self.shape.dp_shard * self.shape.ep)
        if self.shape.dp_replicate > 1 and shard_size > 1:
            return self.mesh["dp_replicate", shard]
        if self.shape.dp_replicate > 1:
            return self.mesh["dp_replicate"]
        return self.mesh[shard]

    @property
    def expert_dp_mesh(self) -> Optional[DeviceMesh]:
        """What FSDP shards expert-parallel experts over: the data-parallel part without ``ep`` (the
        experts are split over ``ep`` already), ``(dp_replicate, dp_shard)`` for HSDP, else 1-D."""
        if self.mesh is None:
            return None
        if self.shape.dp_replicate > 1 and self.shape.dp_shard > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        if self.shape.dp_replicate > 1:
            return self.mesh["dp_replicate"]
        return self.mesh["dp_shard"]

    @property
    def tp_mesh(self) -> Optional[DeviceMesh]:
        return None if self.mesh is None else self.mesh["tp"]

    @property
    def ep_mesh(self) -> Optional[DeviceMesh]:
        """The expert-parallel dimension: the ranks a plan's experts are split over."""
        return None if self.mesh is None else self.mesh["ep"]

    def describe(self) -> dict[str, int]:
        return {
            "dp_replicate": self.shape.dp_replicate,
            "dp_shard": self.shape.dp_shard,
            "ep": self.shape.ep,
            "tp": self.shape.tp,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "tp_rank": self.tp_rank,
        }


def mesh_shape(parallel: ParallelConfig, world_size: int) -> MeshShape:
    """The mesh sizes for ``parallel`` on ``world_size`` ranks, or a ConfigError naming
    the sizes that do not divide. Needs no process group, so it can run at config time."""
    ep = parallel.ep
    if parallel.tp < 1 or parallel.dp_replicate < 1:
        raise ConfigError(
            f"parallel.tp={parallel.tp} and parallel.dp_replicate={parallel.dp_replicate} "
            "must be >= 1",
            key="parallel",
        )
    if ep < 1:
        raise ConfigError(f"parallel.ep={ep} must be >= 1", key="parallel.ep", hint="set parallel.ep=1 (no expert parallelism)")
    if parallel.strategy in ("none", "xla_spmd"):
        _reject_mesh_options(parallel, world_size)
        return MeshShape(1, 1, 1)
    if world_size % parallel.tp:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tp={parallel.tp}",
            key="parallel.tp",
            hint=f"use a tp degree that divides {world_size}, or a world size that is a "
            f"multiple of {parallel.tp}",
        )
    dp = world_size // parallel.tp
    if parallel.strategy == "ddp":
        if ep > 1:
            raise ConfigError(
                f"parallel.ep={ep} is not supported with parallel.strategy=ddp",
                key="parallel.ep",
                hint="use parallel.strategy=fsdp for expert parallelism, or set parallel.ep=1",
            )
        if parallel.tp > 1:
            # DDP turns TP's DTensor parameters into local shards outside forward, so
            # gradient norms and parameter hashes would see shards as whole tensors.
            raise ConfigError(
                f"parallel.tp={parallel.tp} is not supported with parallel.strategy=ddp",
                key="parallel.tp",
                hint="use parallel.strategy=fsdp for tensor parallelism (with "
                "parallel.dp_replicate equal to the data-parallel size for DDP-like replication)",
            )
        if parallel.dp_replicate not in (1, dp):
            raise ConfigError(
                f"parallel.dp_replicate={parallel.dp_replicate} is for fsdp (HSDP); ddp "
                f"replicates over all {dp} data-parallel ranks",
                key="parallel.dp_replicate",
                hint="set parallel.dp_replicate=1, or use parallel.strategy=fsdp",
            )
        return MeshShape(dp_replicate=dp, dp_shard=1, tp=parallel.tp)
    if dp % parallel.dp_replicate:
        raise ConfigError(
            f"data-parallel size {dp} (world size {world_size} / parallel.tp={parallel.tp}) "
            f"is not divisible by parallel.dp_replicate={parallel.dp_replicate}",
            key="parallel.dp_replicate",
            hint=f"use a dp_replicate that divides {dp}",
        )
    shard = dp // parallel.dp_replicate
    if shard % ep:
        raise ConfigError(
            f"parallel.ep={ep} borrows its ranks from the {shard} data-parallel ranks that shard the model "
            f"(world size {world_size} / (parallel.tp={parallel.tp} x parallel.dp_replicate={parallel.dp_replicate})), "
            "and does not divide them",
            key="parallel.ep",
            hint=f"use an ep degree that divides {shard}",
        )
    return MeshShape(parallel.dp_replicate, shard // ep, parallel.tp, ep)



def build_mesh(parallel: ParallelConfig, dist: DistributedContext) -> Topology:
    """Validate the sizes, then build the named DeviceMesh over the existing process group.

    Collective: every rank must call it, with the same config.
    """
    shape = mesh_shape(parallel, dist.world_size)
    if dist.world_size == 1 or parallel.strategy in ("none", "xla_spmd"):
        return Topology(shape=shape, dp_rank=0, tp_rank=0, mesh=None)
    mesh = init_device_mesh(dist.device.type, shape.as_tuple(), mesh_dim_names=MESH_DIMS)
    if shape.ep > 1:
        mesh["dp_shard", "ep"]._flatten(SHARD_EP_DIM)  # FSDP's shard dimension (Topology.dp_mesh)
    replicate_idx, shard_idx, ep_idx, tp_idx = mesh.get_coordinate()
    return Topology(
        shape=shape,
        dp_rank=(replicate_idx * shape.dp_shard + shard_idx) * shape.ep + ep_idx,
        tp_rank=tp_idx,
        mesh=mesh,
    )


def _reject_mesh_options(parallel: ParallelConfig, world_size: int) -> None:
    name = parallel.strategy
    if world_size > 1:
        raise ConfigError(
            f"parallel.strategy={name} runs one process, not {world_size} ranks",
            key="parallel.strategy",
            hint="use ddp or fsdp for several ranks"
            + ("; xla_spmd drives all devices of one host from one process" if name == "xla_spmd" else ""),
        )
    if parallel.tp > 1:
        raise ConfigError(
            f"parallel.tp={parallel.tp} needs parallel.strategy ddp or fsdp, not {name}",
            key="parallel.tp",
            hint="set parallel.tp=1",
        )
    if parallel.dp_replicate > 1:
        raise ConfigError(
            f"parallel.dp_replicate={parallel.dp_replicate} needs parallel.strategy=fsdp, "
            f"not {name}",
            key="parallel.dp_replicate",
            hint="set parallel.dp_replicate=1",
        )
    ep = parallel.ep
    if ep > 1:
        raise ConfigError(
            f"parallel.ep={ep} needs parallel.strategy=fsdp, not {name}",
            key="parallel.ep",
            hint="set parallel.ep=1",
        )
