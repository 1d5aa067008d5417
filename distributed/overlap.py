"""Matmuls that leave SMs free for the gradient reduction running beside the backward.

Overlapped data parallelism (DDP's bucket all-reduces, FSDP's reduce-scatters) runs NCCL
kernels on a side stream while the backward's matmuls run on the compute stream. NCCL holds
some SMs for as long as a collective lasts. cuBLAS sizes a matmul's grid for every SM of the
card, so beside a collective its last wave of tiles waits for SMs that NCCL holds, and the
matmul takes up to twice as long. On four H200s with Qwen2.5-0.5B at 4,096 tokens per GPU,
the backward's largest matmul kernels took 70% longer than on one GPU
(docs/performance.md).

``parallel.backward_sm_carveout=N`` makes every cuBLAS matmul issued during the backward
target all SMs but ``N``, so its waves fit beside NCCL's kernels. It uses torch's
experimental SM carveout, which cuBLAS honours on its Lt path, so the backward's matmuls also
go through cuBLASLt while the carveout is set. The forward (where DDP sends nothing) keeps the
whole card. Each setting picks its own kernels, deterministically: bitwise mode stays
bitwise for a given value. A different value changes the numbers, so a resume keeps the
value the run started with (the key is not in ``core.config.RESUMABLE_KEYS``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from core.exceptions import ConfigError


def carveout_available() -> bool:
    """This torch can set an SM carveout for matmuls, and run them through cuBLASLt."""
    return hasattr(torch._C, "_set_sm_carveout_experimental") and hasattr(torch.backends.cuda, "preferred_blas_library")


def check_carveout(sms: int, device: torch.device) -> None:
    """Raise ``ConfigError`` if ``parallel.backward_sm_carveout=sms`` cannot apply on ``device``."""
    if sms == 0:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"parallel.backward_sm_carveout={sms} reserves CUDA SMs, but the run trains on {device.type}",
            key="parallel.backward_sm_carveout",
            hint="set parallel.backward_sm_carveout=0 off CUDA",
        )
    if not carveout_available():
        raise ConfigError(
            f"parallel.backward_sm_carveout={sms} needs torch._C._set_sm_carveout_experimental, "
            f"which torch {torch.__version__} does not have",
            key="parallel.backward_sm_carveout",
            hint="set parallel.backward_sm_carveout=0, or use a torch that has it (2.7 and later)",
        )
    count = torch.cuda.get_device_properties(device).multi_processor_count
    if sms >= count:
        raise ConfigError(
            f"parallel.backward_sm_carveout={sms} leaves no SM for matmuls: {device} has {count}",
            key="parallel.backward_sm_carveout",
            hint=f"choose a value below {count}, e.g. the number of channels NCCL uses (16-32)",
        )


@contextlib.contextmanager
def matmul_carveout(sms: int) -> Iterator[None]:
    """Inside the block, cuBLAS matmuls run through cuBLASLt on all SMs but ``sms``; ``0``
    changes nothing. The settings are process-wide (the backward's CUDA work runs on the
    autograd engine's device thread, which reads them too) and restored on exit."""
    if sms <= 0:
        yield
        return
    backend = torch.backends.cuda.preferred_blas_library()
    previous = torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(previous)
        torch.backends.cuda.preferred_blas_library(backend)
