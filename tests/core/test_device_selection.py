"""Which device a rank trains on, and the typed error when the node's ranks would share a GPU
(NCCL refuses that only at the first collective, in its own words)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.config import ParallelConfig
from core.distributed_context import ProcessInfo, select_device
from core.exceptions import ConfigError


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` visible GPUs."""

    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_count


def test_cpu_is_chosen_without_a_gpu_or_when_asked(gpus):
    gpus(0)
    assert select_device(ParallelConfig(device="auto"), 1, 2, environ={}) == torch.device("cpu")
    gpus(8)
    assert select_device(ParallelConfig(device="cpu"), 3, 16, environ={}) == torch.device("cpu")


def test_each_local_rank_gets_its_own_gpu(gpus):
    gpus(4)
    devices = [select_device(ParallelConfig(device="auto"), r, 4, environ={}) for r in range(4)]
    assert devices == [torch.device("cuda", r) for r in range(4)]


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_more_ranks_than_gpus_is_a_config_error_naming_the_counts(gpus, device):
    gpus(1)
    with pytest.raises(ConfigError) as info:
        select_device(ParallelConfig(device=device), 1, 2, environ={})
    text = str(info.value)
    assert "2 ranks on this node but 1 visible GPU" in text
    assert info.value.context["key"] == "parallel.device"
    assert "--nproc_per_node=1" in text and "parallel.device=cpu" in text


def test_a_launcher_that_gives_each_process_its_own_gpu_is_accepted(gpus):
    gpus(1)  # e.g. Slurm with --gpus-per-task=1: every process sees one GPU, its own
    environ = {"CUDA_VISIBLE_DEVICES": "3"}
    assert select_device(ParallelConfig(device="cuda"), 5, 8, environ=environ) == torch.device("cuda", 0)


def test_cuda_without_a_visible_gpu_is_a_config_error(gpus):
    gpus(0)
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        select_device(ParallelConfig(device="cuda"), 0, 1, environ={})


def test_local_world_size_comes_from_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ProcessInfo.from_env() == ProcessInfo(rank=9, world_size=16, local_rank=1, local_world_size=8)


def test_without_local_world_size_the_local_rank_bounds_it(monkeypatch):
    # A launcher other than torchrun may set LOCAL_RANK only: 16 ranks over 2 nodes must not
    # read as 16 ranks on this node.
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "11")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert ProcessInfo.from_env().local_world_size == 4


def test_prepare_process_refuses_shared_gpus_before_writing_anything(gpus, monkeypatch, tmp_path):
    from core.config import load
    from training import session

    gpus(1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # no launcher watch thread
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    root = tmp_path / "runs"
    config = load(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml", [f"run.root={root}"])
    with pytest.raises(ConfigError, match="2 ranks on this node but 1 visible GPU"):
        session.prepare_process(config)
    assert not root.exists()  # not even the NCCL flight-recorder dir
