"""CUDA paths of the runtime guards (skipped without a GPU; CI has none).

Run on a GPU machine: ``python -m pytest tests/runtime/test_cuda.py``.
"""

import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from core.config import RuntimeConfig
from runtime.memory import enable_memory_history, is_out_of_memory, memory_snapshot, oom_snapshot
from runtime.profiler import ProfilerWindow, StepTimer
from runtime.watchdog import Watchdog
from tests import launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cuda", 0)


def _gpu_busy(seconds: float) -> None:
    """Queue a kernel that keeps the GPU busy for about ``seconds`` (host returns at once)."""
    torch.cuda._sleep(int(seconds * 1.5e9))  # cycles; ~1.5-2 GHz clocks


def test_memory_snapshot_reads_the_device():
    x = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    snap = memory_snapshot(DEVICE)
    assert snap["cuda_allocated_bytes"] >= 256 << 20
    assert snap["cuda_reserved_bytes"] >= snap["cuda_allocated_bytes"]
    assert 0 < snap["cuda_free_bytes"] < snap["cuda_total_bytes"]
    del x


def test_oom_snapshot_writes_the_allocator_snapshot_with_history(tmp_path):
    assert enable_memory_history(DEVICE)
    try:
        keep = torch.ones(64 << 20, device=DEVICE)
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(1 << 50, dtype=torch.uint8, device=DEVICE)  # a petabyte
        assert is_out_of_memory(info.value)
        files = oom_snapshot(tmp_path, 0, device=DEVICE, error=info.value)
        assert [f.name for f in files] == ["rank0_memory.json", "rank0_memory_snapshot.pickle"]
        report = json.loads(files[0].read_text())
        assert "OutOfMemoryError" in report["error"] and report["allocator_summary"]
        snapshot = pickle.loads(files[1].read_bytes())
        assert snapshot["segments"] and any(snapshot["device_traces"])
        del keep
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def test_step_timer_waits_for_the_device_at_step_end_only_when_asked():
    torch.cuda.synchronize()
    ahead = StepTimer(device=DEVICE)  # the loop's default: the host runs on into the next step
    ahead.start_step(1)
    with ahead.phase("forward"):
        _gpu_busy(0.3)
    out = ahead.end_step()
    assert out["forward"] < 0.1 and out["device_sync"] == 0.0
    torch.cuda.synchronize()

    timer = StepTimer(device=DEVICE, sync_step_end=True)
    timer.start_step(1)
    with timer.phase("forward"):
        _gpu_busy(0.3)
    out = timer.end_step()
    assert out["forward"] < 0.1 and out["device_sync"] > 0.1  # host time vs. device time

    exact = StepTimer(device=DEVICE, sync_each_phase=True)
    exact.start_step(1)
    with exact.phase("forward"):
        _gpu_busy(0.3)
    out = exact.end_step()
    assert out["forward"] > 0.1 and out["device_sync"] < 0.05


def test_watchdog_dumps_while_the_main_thread_waits_on_the_gpu(tmp_path):
    codes = []
    wd = Watchdog(
        RuntimeConfig(watchdog_timeout_s=0.5, watchdog_exit_grace_s=0),
        rank=0, diagnostics_dir=tmp_path, providers={}, on_abort=None,
        device=DEVICE, exit_fn=codes.append, gil_backstop=False,
    )
    torch.cuda.synchronize()
    wd.start()
    wd.heartbeat(1, "forward")
    _gpu_busy(3.0)
    torch.cuda.synchronize()  # blocked in C; the watchdog thread must still dump
    deadline = time.monotonic() + 10
    while not codes and time.monotonic() < deadline:
        time.sleep(0.05)
    wd.stop()
    assert codes == [6]
    stacks = (tmp_path / "rank0_stacks.txt").read_text()
    assert "synchronize" in stacks and "test_watchdog_dumps_while_the_main_thread" in stacks
    bundle = json.loads((tmp_path / "rank0_watchdog.json").read_text())
    assert bundle["memory"]["value"]["cuda_total_bytes"] > 0


def test_cuda_profiler_window_records_kernels(tmp_path):
    window = ProfilerWindow(RuntimeConfig(profile_start_step=1, profile_steps=1), trace_dir=tmp_path, rank=0, device=DEVICE)
    window.before_step(1)
    a = torch.randn(1024, 1024, device=DEVICE)
    (a @ a).sum().item()
    window.after_step(1)
    trace = json.loads((tmp_path / "rank0_steps1-1.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])


def test_nccl_flight_recorder_tracker_and_guard_on_a_one_rank_group(tmp_path):
    script = textwrap.dedent(
        f"""
        import json, os, pickle, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        import torch, torch.distributed as dist
        from core.config import MetricsConfig, RuntimeConfig
        from experiments.tracking import MetricsTracker
        from runtime.health import NonFiniteGuard
        from runtime.watchdog import Watchdog, configure_nccl_diagnostics

        out = Path({str(tmp_path)!r})
        env = configure_nccl_diagnostics(out / "diagnostics", 60)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29631", RANK="0", WORLD_SIZE="1")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)

        class OneRank:  # a real NCCL all-reduce under the DistributedContext interface
            rank, world_size, device = 0, 1, torch.device("cuda", 0)
            def all_reduce(self, t, op="sum"):
                dist.all_reduce(t)
                return t

        tracker = MetricsTracker(MetricsConfig(), dist=OneRank(), run_dir=out / "run", total_steps=2,
                                 flops_per_token=None, peak_flops=None, print_fn=print)
        tracker.log(1, {{"loss": 2.0, "step_time": 0.5}})
        tracker.log(2, {{"loss": 1.0, "step_time": 0.5}})
        tracker.close()
        guard = NonFiniteGuard("skip", dist=OneRank())
        ok = guard.check(torch.tensor(1.0, device=device), torch.tensor(float("nan"), device=device))
        wd = Watchdog(RuntimeConfig(), rank=0, diagnostics_dir=out / "diagnostics", providers={{}},
                      on_abort=None, device=device, gil_backstop=False)
        summary = wd.dump("check")
        trace = pickle.loads((out / "diagnostics" / "rank0_flight_recorder_nccl.pkl").read_bytes())
        names = [e["profiling_name"] for e in trace["entries"]]
        assert str(out / "diagnostics" / "rank0_flight_recorder_nccl.pkl") in summary["files"]
        print(json.dumps({{"ok": ok, "skipped": guard.skipped, "names": names, "env": env,
                          "torch": torch.__version__}}))
        dist.destroy_process_group()
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is False and result["skipped"] == 1
    assert sum("all_reduce" in n for n in result["names"]) >= 3, result  # FR buffer size was honoured
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["metrics"]["loss"]["mean"] for r in records] == [2.0, 1.0]  # reduced on the GPU via NCCL


def _nccl_hang_worker(rank: int, port: int, run_dir: str) -> None:
    """NCCL: rank 1 hangs at step 2; rank 0's all-reduce is queued and it blocks reading the
    result, as a training loop does when it logs the loss."""
    import traceback

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        from core.distributed_context import DistributedContext
        from runtime.faults import FaultInjector, parse_faults
        from runtime.watchdog import configure_nccl_diagnostics

        diag = Path(run_dir) / "diagnostics"
        configure_nccl_diagnostics(diag, 60)
        device = torch.device("cuda", rank)
        dist = DistributedContext(rank=rank, world_size=2, local_rank=rank, device=device, backend="nccl", timeout_s=300)
        dist.init_process_group()
        watchdog = Watchdog(
            RuntimeConfig(watchdog_timeout_s=3.0, watchdog_exit_grace_s=5.0),
            rank=rank, diagnostics_dir=diag, providers={}, on_abort=None, device=device,
        )
        faults = FaultInjector(parse_faults(["hang@2:1"]), rank=rank)
        timer = StepTimer(device=device, listeners=[watchdog])
        watchdog.start()
        for step in range(1, 5):
            timer.start_step(step)
            faults.before_step(step)
            with timer.phase("communication"):
                loss = dist.all_reduce(torch.ones(1024, device=device))
            with timer.phase("optimizer"):
                loss.sum().item()
            timer.end_step()
        os._exit(0)
    except BaseException:
        Path(run_dir, f"rank{rank}_error.txt").write_text(traceback.format_exc())
        os._exit(99)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_two_ranks_one_hung_both_dump_and_exit_6(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    codes = launch.spawn_ranks(_nccl_hang_worker, lambda r: (r, port, str(tmp_path)), timeout=180, fresh=True)
    errors = [f.read_text() for f in tmp_path.glob("rank*_error.txt")]
    assert codes == [6, 6], errors
    diag = tmp_path / "diagnostics"
    assert "maybe_hang" in (diag / "rank1_stacks.txt").read_text()
    assert "_nccl_hang_worker" in (diag / "rank0_stacks.txt").read_text()
    bundle = json.loads((diag / "rank0_watchdog.json").read_text())
    assert bundle["last_step"] == 2 and bundle["last_phase"] == "optimizer"  # blocked in .item()
    trace = pickle.loads((diag / "rank0_flight_recorder_nccl.pkl").read_bytes())
    states = [e["state"] for e in trace["entries"] if "all_reduce" in e["profiling_name"]]
    assert states[-1] != "completed", states  # the step-2 all-reduce never finished


def test_bitwise_mode_stops_cublas_reparsing_its_workspace_variable():
    # training.determinism.settle_cublas_workspace_config, in a fresh process (the variable
    # must be set before CUDA starts, and torch caches its check once per process).
    code = textwrap.dedent(
        """
        import os, torch
        from models.numerics import Numerics
        from training import determinism
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        determinism.configure(Numerics(mode="bitwise"), torch.device("cuda", 0))
        major = torch.cuda.get_device_capability(0)[0]
        removed = "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        assert removed == (major in determinism.DEFAULT_WORKSPACE_IS_CONFIG), (major, removed)
        a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(a @ a, a @ a)  # cuBLAS still runs under deterministic algorithms
        try:  # an op without a deterministic CUDA kernel is still refused
            torch.histc(torch.rand(100, device="cuda"), bins=10)
            raise AssertionError("histc ran under deterministic algorithms")
        except RuntimeError as exc:
            assert "deterministic" in str(exc), exc
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
