"""Host and device memory: per-step readings, allocation history, out-of-memory dumps.

- ``memory_snapshot(device)``: a dict of bytes (process RSS/VMS, host available, and on
  CUDA allocated/reserved/peaks and free/total). Safe to call from the watchdog thread: it
  never initializes CUDA.
- ``memory_metrics(device)``: the same in GiB with names for the metrics tracker.
- ``enable_memory_history(device)``: start recording CUDA allocations with stack traces
  (``runtime.record_memory_history``); costs some speed, so off by default.
- ``oom_snapshot(diagnostics_dir, rank, device=...)``: on an out-of-memory error, write
  ``rank<R>_memory.json`` (readings, error, allocator summary) and, on CUDA,
  ``rank<R>_memory_snapshot.pickle`` (``torch.cuda.memory._snapshot()``; open it at
  https://pytorch.org/memory_viz). It holds allocation stacks only if history was enabled.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path
from typing import Any

import psutil
import torch

GIB = float(1 << 30)
DEFAULT_HISTORY_ENTRIES = 100_000


def _cuda_ready(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized()


def memory_snapshot(device: torch.device | str) -> dict[str, int]:
    """Memory readings in bytes for this process and ``device``."""
    device = torch.device(device)
    info = psutil.Process().memory_info()
    host = psutil.virtual_memory()
    out = {
        "rss_bytes": int(info.rss),
        "vms_bytes": int(info.vms),
        "host_available_bytes": int(host.available),
        "host_total_bytes": int(host.total),
    }
    if _cuda_ready(device):
        free, total = torch.cuda.mem_get_info(device)
        out.update(
            cuda_allocated_bytes=int(torch.cuda.memory_allocated(device)),
            cuda_reserved_bytes=int(torch.cuda.memory_reserved(device)),
            cuda_max_allocated_bytes=int(torch.cuda.max_memory_allocated(device)),
            cuda_max_reserved_bytes=int(torch.cuda.max_memory_reserved(device)),
            cuda_free_bytes=int(free),
            cuda_total_bytes=int(total),
        )
    return out


def memory_metrics(device: torch.device | str) -> dict[str, float]:
    """Per-step memory metrics in GiB (``mem/rss_gib``, ``mem/cuda_max_allocated_gib``...)."""
    snap = memory_snapshot(device)
    keys = ("rss", "cuda_allocated", "cuda_reserved", "cuda_max_allocated")
    return {f"mem/{k}_gib": snap[f"{k}_bytes"] / GIB for k in keys if f"{k}_bytes" in snap}


def enable_memory_history(device: torch.device | str, *, max_entries: int = DEFAULT_HISTORY_ENTRIES) -> bool:
    """Record CUDA allocation history (with stacks) for ``oom_snapshot``; False on CPU."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    torch.cuda.memory._record_memory_history(max_entries=max_entries, device=device)
    return True


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a device or host out-of-memory error."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def oom_snapshot(
    diagnostics_dir: Path,
    rank: int,
    *,
    device: torch.device | str = "cpu",
    error: BaseException | None = None,
) -> list[Path]:
    """Write what is known about memory at an out-of-memory error; returns the files."""
    diagnostics_dir = Path(diagnostics_dir)
    diagnostics_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(device)
    report: dict[str, Any] = {
        "rank": rank,
        "time": time.time(),
        "device": str(device),
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "memory": memory_snapshot(device),
    }
    written = []
    if _cuda_ready(device):
        report["allocator_summary"] = torch.cuda.memory_summary(device, abbreviated=True)
        snapshot_path = diagnostics_dir / f"rank{rank}_memory_snapshot.pickle"
        with open(snapshot_path, "wb") as handle:
            pickle.dump(torch.cuda.memory._snapshot(device), handle)
        written.append(snapshot_path)
    json_path = diagnostics_dir / f"rank{rank}_memory.json"
    json_path.write_text(json.dumps(report, indent=2, default=repr) + "\n")
    written.insert(0, json_path)
    return written


def check_training_state_fits(
    state_bytes: int, device: torch.device | str, *, ranks_sharing: int, what: str, key: str = "model"
) -> None:
    """Refuse, before anything is allocated, a training state that cannot fit where it must live.

    ``state_bytes`` is one rank's lower bound (the weights of every model the run builds, the
    trained one's gradients and optimizer state; no activations); ``ranks_sharing`` ranks of
    this node keep theirs in the same memory (all local ranks on a CPU host, one rank per GPU).
    A ConfigError (exit 2) under ``key`` names the estimate and the memory available."""
    from core.exceptions import ConfigError

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        available, total = torch.cuda.mem_get_info(device)
        where, need = f"{device} ({total / GIB:.1f} GiB total)", state_bytes
    else:
        host = psutil.virtual_memory()
        available = host.available
        where, need = f"host memory ({host.total / GIB:.1f} GiB total)", state_bytes * ranks_sharing
    if need > available:
        raise ConfigError(
            f"{what}: at least {need / GIB:.2f} GiB is needed for weights, gradients and optimizer state "
            f"({ranks_sharing} rank(s) sharing {where}), but only {available / GIB:.2f} GiB is available",
            key=key,
            hint="shrink the model, shard it (parallel.strategy=fsdp over more ranks) or use a larger device",
        )
