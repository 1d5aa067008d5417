"""Process environment that must be in place before the process group and CUDA start.

NCCL and cuBLAS read these variables once, when they initialise, so ``train.py`` applies
them before ``DistributedContext.from_env`` (which owns the process group). A value the
user already exported wins: these are defaults, and the returned dict records what was
actually set, for meta.json.
"""

from __future__ import annotations

import os
from typing import Mapping

from core.config import ParallelConfig

# A failed or timed-out NCCL collective tears the process down instead of leaving the
# rank hanging, so torchrun sees the failure and stops (or restarts) the whole job.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}

# cuBLAS picks its workspace per stream; a fixed configuration is what
# torch.use_deterministic_algorithms(True) needs for repeatable matmuls on CUDA >= 10.2.
DETERMINISTIC_CUDA_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def collective_env(parallel: ParallelConfig) -> dict[str, str]:
    """Variables the chosen backend wants (none for gloo or a single process)."""
    if parallel.backend == "gloo" or parallel.device == "cpu" or parallel.strategy == "xla_spmd":
        return {}
    return dict(NCCL_ENV)


def apply_env(env: Mapping[str, str]) -> dict[str, str]:
    """Export each variable the user has not set; returns the ones this call set."""
    applied = {}
    for key, value in env.items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied


def prepare_process_env(parallel: ParallelConfig, *, deterministic: bool) -> dict[str, str]:
    """Apply the collective defaults (and cuBLAS's deterministic workspace if asked).

    Call once per process before ``DistributedContext.from_env`` and before any CUDA work.
    """
    env = collective_env(parallel)
    if deterministic:
        env.update(DETERMINISTIC_CUDA_ENV)
    return apply_env(env)
