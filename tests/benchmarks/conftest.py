"""Fixtures of the benchmark tests that run train.main in this process (test_moe_step.py, test_vl_step.py)."""

from __future__ import annotations

import gc
import signal

import pytest
import torch
import torch.utils.deterministic

from runtime.signals import STOP_SIGNALS


@pytest.fixture
def restore_process_state(monkeypatch):
    """What train.main sets for the whole process (determinism switches, signal handlers, the cuBLAS
    workspace variable), put back for the tests that run after this one in the same worker."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # bitwise mode's value; restored afterwards
    flags = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory,
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    collecting = gc.isenabled()
    yield
    torch.use_deterministic_algorithms(flags[0])
    torch.utils.deterministic.fill_uninitialized_memory = flags[1]
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags[2:4]
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[4:]
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    if collecting:
        gc.enable()
