"""Switch the numerics between ``bitwise`` (repeatable) and ``fast``; build the run's ``Numerics``.

``numerics(config)`` builds the run's one ``Numerics`` (models/numerics.py) from
``determinism.mode``, ``determinism.batch_invariant``, ``model.attention``, ``model.sdpa_backends`` and
``parallel.precision``:
the attention kernels, SDPA backends, matmul policy, dtypes and sampling kernels of the
training forward and of the sampler all come from it (training/builders.py hands it to the model).

``bitwise``: deterministic algorithms everywhere (an op without a deterministic kernel
raises instead of silently varying; new tensors are not NaN-filled unless
``determinism.fill_uninitialized_memory``), the cuBLAS workspace pinned, cuDNN autotuning off,
and, by the ``Numerics``, TF32 off and the flash and cuDNN attention backends off: measured on
H200 with torch 2.11, their backward is not bitwise repeatable, while the memory-efficient and
math backends and compiled flex_attention are (docs/contracts.md).

``fast``: TF32 matmuls, cuDNN autotuning and every attention backend allowed. The mode is
recorded in meta.json; resume and replay compare it.
"""

from __future__ import annotations

import os

import torch

from core.config import Config
from models.numerics import Numerics


def numerics(config: Config) -> Numerics:
    """The run's numerics, from its determinism, model and parallel sections (built once per run)."""
    return Numerics(mode=config.determinism.mode, attention=config.model.attention,
                    sdpa_backends=config.model.sdpa_backends, precision=config.parallel.precision,
                    batch_invariant=config.determinism.batch_invariant)


def configure(numerics: Numerics, device: torch.device, *, fill_uninitialized_memory: bool = False) -> None:
    """Set torch's process-wide switches for ``numerics.mode`` on ``device`` (module docstring);
    ``fill_uninitialized_memory`` is ``determinism.fill_uninitialized_memory`` (bitwise only)."""
    bitwise = numerics.mode == "bitwise"
    if bitwise:
        # Read by cuBLAS when its handle is created (first matmul), so setting it here works.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(bitwise)
    # With deterministic algorithms on, torch also fills every new tensor with NaN (the
    # largest integer for integer dtypes), so that a kernel reading memory that nothing wrote
    # still repeats. That is about 320 fill kernels a step for Qwen2.5-0.5B, whose launches
    # keep the host from running ahead of the GPU: on an H200 bitwise ran 1.9% slower than
    # fast with them and 0.8% without (8% vs 0 under the profiler, whose overhead magnifies
    # host time). Every kernel here writes what it reads, and the bitwise checks on the GPU
    # (repeat, kill/resume) pass without the fill (docs/determinism.md);
    # determinism.fill_uninitialized_memory turns it back on.
    torch.utils.deterministic.fill_uninitialized_memory = bitwise and fill_uninitialized_memory
    torch.backends.cudnn.deterministic = bitwise
    torch.backends.cudnn.benchmark = not bitwise
    numerics.apply(device)  # TF32, SDPA backends
    if device.type == "cuda" and bitwise:
        settle_cublas_workspace_config(device)


WORKSPACE_CONFIG = ":4096:8"
# Compute capabilities (major) whose torch default cuBLAS workspace is 32 MiB, the size
# WORKSPACE_CONFIG asks for (8 buffers of 4096 KiB) in every torch from 2.11 on: Hopper.
DEFAULT_WORKSPACE_IS_CONFIG = (9,)


def settle_cublas_workspace_config(device: torch.device) -> bool:
    """Stop torch re-parsing ``CUBLAS_WORKSPACE_CONFIG`` on every matmul, where that is free.

    torch checks once per process, on its first cuBLAS call, that the variable holds a
    deterministic setting (the answer is cached), but it re-reads and regex-parses the variable
    for the workspace size on every cuBLAS call. Measured on an H200 (torch 2.11,
    benchmarks/matmul_host_cost.py), that raises the host cost of a small bf16 matmul from
    12.8 to 49 us and of an FP8 ``_scaled_mm`` from 26 to 139 us: LoRA's small matmuls and
    FP8 became host-bound in bitwise mode. Where the default size equals what the variable
    asks for (compute capability 9), this runs one matmul (so the check has seen
    the variable) and then removes it: the workspace size and so the kernels are unchanged.
    Elsewhere, or with another value the user set, it does nothing. Returns whether it removed it.
    """
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != WORKSPACE_CONFIG:
        return False
    if torch.cuda.get_device_capability(device)[0] not in DEFAULT_WORKSPACE_IS_CONFIG:
        return False
    probe = torch.ones(8, 8, device=device)
    torch.mm(probe, probe)
    torch.cuda.synchronize(device)
    del os.environ["CUBLAS_WORKSPACE_CONFIG"]
    return True

