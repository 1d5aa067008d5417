"""runtime/memory.py on CPU: readings, out-of-memory detection and the OOM dump."""

import json

import psutil
import torch

from runtime.memory import enable_memory_history, is_out_of_memory, memory_metrics, memory_snapshot, oom_snapshot


def test_snapshot_reads_this_process():
    snap = memory_snapshot("cpu")
    assert abs(snap["rss_bytes"] - psutil.Process().memory_info().rss) < 256 << 20
    assert 0 < snap["host_available_bytes"] <= snap["host_total_bytes"]
    assert not any(k.startswith("cuda") for k in snap)


def test_metrics_are_gib():
    metrics = memory_metrics(torch.device("cpu"))
    assert set(metrics) == {"mem/rss_gib"}
    assert 0.01 < metrics["mem/rss_gib"] < 64


def test_out_of_memory_detection():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried... out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_oom_snapshot_on_cpu_writes_what_is_available(tmp_path):
    files = oom_snapshot(tmp_path / "diag", 2, device="cpu", error=MemoryError("boom"))
    assert [f.name for f in files] == ["rank2_memory.json"]
    report = json.loads(files[0].read_text())
    assert report["rank"] == 2 and report["error"] == "MemoryError: boom"
    assert report["memory"]["rss_bytes"] > 0


def test_memory_history_is_cuda_only():
    assert enable_memory_history("cpu") is False
