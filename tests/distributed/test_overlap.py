"""distributed/overlap.py: the backward's SM carveout is checked where it cannot apply, and
changes nothing when off."""

from __future__ import annotations

import pytest
import torch

from core.exceptions import ConfigError
from distributed.overlap import check_carveout, matmul_carveout
from tests import launch
from tests.e2e_config import e2e_args
from training.plan import ParallelPlan


def test_carveout_off_the_gpu_names_the_key_and_what_to_do():
    check_carveout(0, torch.device("cpu"))  # off: nothing to check
    with pytest.raises(ConfigError) as info:
        check_carveout(16, torch.device("cpu"))
    assert info.value.context["key"] == "parallel.backward_sm_carveout"
    assert "trains on cpu" in str(info.value) and "parallel.backward_sm_carveout=0" in str(info.value)


def test_no_carveout_leaves_the_matmul_settings_alone():
    backend, carveout = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    with matmul_carveout(0):
        assert torch.backends.cuda.preferred_blas_library() == backend
        assert torch._C._get_sm_carveout_experimental() == carveout
    plan = ParallelPlan(topology=None, strategy="none", device=torch.device("cpu"))
    with plan.backward_context():
        assert torch._C._get_sm_carveout_experimental() == carveout


def test_a_carveout_on_cpu_ranks_exits_2_naming_the_key(e2e_workdir):
    """Through the entry point: two gloo ranks with DDP, where no SM can be reserved."""
    result = launch.train(e2e_workdir, e2e_args(max_steps=1, name="carveout", overrides=[
        "parallel.strategy=ddp", "parallel.backward_sm_carveout=8"]), nproc=2)
    assert result.exit_code == 2, result.stderr
    assert "parallel.backward_sm_carveout=8" in result.stderr and "trains on cpu" in result.stderr
    assert not list((e2e_workdir / "runs").glob("carveout-*/checkpoints/LATEST"))
