"""training/determinism.py: what each determinism mode switches in torch."""

from __future__ import annotations

import pytest
import torch
import torch.utils.deterministic

from core.config import DeterminismConfig
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
    determinism.configure(DeterminismConfig(mode="bitwise"), torch.device("cpu"))
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.utils.deterministic.fill_uninitialized_memory
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.deterministic


def test_bitwise_can_fill_new_tensors_with_nan():
    determinism.configure(DeterminismConfig(mode="bitwise", fill_uninitialized_memory=True), torch.device("cpu"))
    assert torch.utils.deterministic.fill_uninitialized_memory
    assert torch.isnan(torch.empty(64)).all()


def test_fast_allows_nondeterministic_kernels_and_tf32():
    determinism.configure(DeterminismConfig(mode="fast", fill_uninitialized_memory=True), torch.device("cpu"))
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.utils.deterministic.fill_uninitialized_memory
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.benchmark
