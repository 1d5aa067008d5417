"""Mesh sizes, the errors that name what does not divide, and single-process topologies."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.config import ParallelConfig
from core.distributed_context import DistributedContext
from core.exceptions import ConfigError
from distributed.topology import MeshShape, build_mesh, mesh_shape


def _parallel(**overrides) -> ParallelConfig:
    return dataclasses.replace(ParallelConfig(device="cpu", backend="gloo"), **overrides)


def _context(world_size: int, rank: int = 0) -> DistributedContext:
    # No process group is created: build_mesh must reject bad sizes before any collective.
    return DistributedContext(
        rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"), backend="gloo", timeout_s=5
    )


@pytest.mark.parametrize(
    "overrides, world, expected",
    [
        (dict(strategy="ddp"), 8, MeshShape(8, 1, 1)),
        (dict(strategy="fsdp"), 8, MeshShape(1, 8, 1)),
        (dict(strategy="fsdp", tp=2), 8, MeshShape(1, 4, 2)),
        (dict(strategy="fsdp", tp=2, dp_replicate=2), 8, MeshShape(2, 2, 2)),
        (dict(strategy="fsdp", dp_replicate=4), 4, MeshShape(4, 1, 1)),
        (dict(strategy="ddp", dp_replicate=4), 4, MeshShape(4, 1, 1)),
        (dict(strategy="none"), 1, MeshShape(1, 1, 1)),
        (dict(strategy="xla_spmd"), 1, MeshShape(1, 1, 1)),
    ],
)
def test_mesh_shape(overrides, world, expected):
    assert mesh_shape(_parallel(**overrides), world) == expected


@pytest.mark.parametrize(
    "overrides, world, key, words",
    [
        (dict(strategy="fsdp", tp=4), 2, "parallel.tp", ["world size 2", "parallel.tp=4"]),
        (dict(strategy="fsdp", tp=2), 6, None, None),  # divides: no error
        (dict(strategy="fsdp", tp=2, dp_replicate=3), 8, "parallel.dp_replicate", ["data-parallel size 4", "dp_replicate=3"]),
        (dict(strategy="ddp", tp=2), 4, "parallel.tp", ["tp=2", "ddp"]),
        (dict(strategy="ddp", dp_replicate=2), 4, "parallel.dp_replicate", ["dp_replicate=2", "fsdp"]),
        (dict(strategy="none"), 2, "parallel.strategy", ["2 ranks"]),
        (dict(strategy="xla_spmd", tp=2), 1, "parallel.tp", ["tp=2", "xla_spmd"]),
        (dict(strategy="fsdp", tp=0), 2, "parallel", ["tp=0"]),
    ],
)
def test_sizes_that_do_not_divide_are_config_errors(overrides, world, key, words):
    parallel = _parallel(**overrides)
    if key is None:
        mesh_shape(parallel, world)
        return
    with pytest.raises(ConfigError) as info:
        build_mesh(parallel, _context(world))
    assert info.value.context["key"] == key
    assert info.value.exit_code == 2
    for word in words:
        assert word in info.value.message


@pytest.mark.parametrize("strategy", ["none", "ddp", "fsdp", "xla_spmd"])
def test_one_process_needs_no_mesh(strategy):
    topology = build_mesh(_parallel(strategy=strategy), _context(1))
    assert topology.mesh is None and topology.dp_mesh is None and topology.tp_mesh is None
    assert (topology.dp_rank, topology.dp_size, topology.tp_size) == (0, 1, 1)


@pytest.mark.parametrize(
    "overrides, world, ep, expected",
    [
        (dict(strategy="fsdp"), 8, 1, MeshShape(1, 8, 1, 1)),
        (dict(strategy="fsdp"), 8, 2, MeshShape(1, 4, 1, 2)),
        (dict(strategy="fsdp", tp=2), 8, 4, MeshShape(1, 1, 2, 4)),
        (dict(strategy="fsdp", tp=2, dp_replicate=2), 8, 2, MeshShape(2, 1, 2, 2)),
    ],
)
def test_expert_parallel_ranks_come_from_the_data_parallel_ones(overrides, world, ep, expected):
    shape = mesh_shape(_parallel(**overrides, ep=ep), world)
    assert shape == expected
    assert shape.dp * shape.tp == world  # the ep ranks read their own rows: dp counts them
    assert shape.as_tuple() == (shape.dp_replicate, shape.dp_shard, shape.ep, shape.tp)


@pytest.mark.parametrize(
    "overrides, world, ep, words",
    [
        (dict(strategy="fsdp"), 6, 4, ["parallel.ep=4", "6 data-parallel ranks"]),
        (dict(strategy="fsdp", tp=2), 8, 8, ["parallel.ep=8", "4 data-parallel ranks"]),
        (dict(strategy="fsdp"), 2, 0, ["parallel.ep=0", ">= 1"]),
        (dict(strategy="ddp"), 4, 2, ["parallel.ep=2", "ddp"]),
        (dict(strategy="none"), 1, 2, ["parallel.ep=2", "fsdp"]),
    ],
)
def test_expert_parallel_sizes_that_do_not_fit_are_config_errors(overrides, world, ep, words):
    with pytest.raises(ConfigError) as info:
        build_mesh(_parallel(**overrides, ep=ep), _context(world))
    assert info.value.context["key"] == "parallel.ep"
    for word in words:
        assert word in info.value.message
