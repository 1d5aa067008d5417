"""training/determinism.py: what each determinism mode switches in torch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.utils.deterministic

from models.numerics import Numerics
from training import determinism


@pytest.fixture(autouse=True)
def _restore_torch_flags():
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.utils.deterministic.fill_uninitialized_memory = saved[1]
    torch.backends.cuda.matmul.allow_tf32 = saved[2]
    (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) = saved[3:]


def test_bitwise_turns_on_deterministic_algorithms_without_nan_filling():
    determinism.configure(Numerics(mode="bitwise"), torch.device("cpu"))
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.utils.deterministic.fill_uninitialized_memory
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.deterministic


def test_bitwise_can_fill_new_tensors_with_nan():
    determinism.configure(Numerics(mode="bitwise"), torch.device("cpu"), fill_uninitialized_memory=True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    assert torch.isnan(torch.empty(64)).all()


def test_fast_allows_nondeterministic_kernels_and_tf32():
    determinism.configure(Numerics(mode="fast"), torch.device("cpu"), fill_uninitialized_memory=True)
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.utils.deterministic.fill_uninitialized_memory
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.benchmark


def test_the_cublas_workspace_variable_stays_where_dropping_it_would_change_the_workspace(monkeypatch):
    # settle_cublas_workspace_config removes the variable only when it holds ":4096:8" and
    # the GPU's default workspace is that size (Hopper); the removal itself runs in
    # tests/runtime/test_cuda.py on a GPU.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own choice: kept
    assert not determinism.settle_cublas_workspace_config(torch.device("cuda", 0))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # Ampere: smaller default
    assert not determinism.settle_cublas_workspace_config(torch.device("cuda", 0))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
