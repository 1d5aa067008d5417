"""distributed/overlap.py: the backward's SM carveout is checked where it cannot apply, and
changes nothing when off."""

from __future__ import annotations

import pytest
import torch

from core.exceptions import ConfigError
from distributed.overlap import check_carveout, matmul_carveout
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
