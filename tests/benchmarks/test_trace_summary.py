"""benchmarks/trace_summary.py on a hand-made trace: GPU busy/idle per step, kernel
families, and the host work that ran while the GPU was idle."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trace_summary():
    spec = importlib.util.spec_from_file_location("trace_summary", ROOT / "benchmarks" / "trace_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _x(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_idle_time_is_attributed_to_the_host_work_inside_it(trace_summary, tmp_path):
    # One 1000 us step: kernels run 0-300 and 500-1000 us; between them the host reads a
    # value (aten::item inside the "optimizer" phase) and the GPU has nothing to do.
    events = [
        _x("lockstep_step#7", "user_annotation", 0, 1000),
        _x("nvjet_sm90_tst_192x192_64x4", "kernel", 0, 300),
        _x("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_8", "kernel", 500, 100),
        _x("Memcpy HtoD", "gpu_memcpy", 600, 50),
        _x("triton_tem_fused_flex_attention_backward", "kernel", 650, 350),
        _x("optimizer", "user_annotation", 250, 270),
        _x("aten::item", "cpu_op", 300, 200),
        _x("cudaStreamSynchronize", "cuda_runtime", 310, 180),
        _x("aten::mm", "cpu_op", 0, 10),  # while the GPU is busy: not idle work
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = trace_summary.summarize(path)

    (row,) = summary["steps"]
    assert row["step"] == 7
    assert row["gpu_busy_ms"] == pytest.approx(0.8)
    assert row["gpu_idle_ms"] == pytest.approx(0.2)
    assert row["idle_gaps"] == 1
    assert row["longest_gap_ms"] == pytest.approx(0.2) and row["longest_gap_at_ms"] == pytest.approx(0.3)

    idle = {r["name"]: r["ms_per_step"] for r in summary["host_during_gpu_idle"]}
    assert idle == pytest.approx({"aten::item": 0.2, "optimizer": 0.2, "cudaStreamSynchronize": 0.18})

    families = summary["per_step_family_ms"]
    assert families["matmul"] == pytest.approx(0.3)
    assert families["attention"] == pytest.approx(0.35)
    assert families["fused/reduction"] == pytest.approx(0.1)  # a cast inside a norm is no copy
    assert families["copy"] == pytest.approx(0.05)


def test_short_launch_gaps_are_not_idle_work(trace_summary):
    gaps = trace_summary.idle_gaps([(0, 100), (105, 200), (400, 500)], 0, 510)
    assert gaps == [(200, 400)]


def test_kernels_count_for_the_phase_that_launched_them(trace_summary, tmp_path):
    # A forward range issues a kernel that runs during the backward range (the host ran ahead), and
    # the backward (from autograd's thread) issues two more; a synchronize sits in the backward.
    def launch(name, ts, dur, correlation, cat="cuda_runtime"):
        return {**_x(name, cat, ts, dur), "args": {"correlation": correlation}}

    def kernel(name, ts, dur, correlation):
        return {**_x(name, "kernel", ts, dur), "args": {"correlation": correlation}}

    events = [
        _x("lockstep_step#3", "user_annotation", 0, 1000),
        _x("forward", "user_annotation", 0, 100),
        _x("backward", "user_annotation", 100, 900),
        launch("cudaLaunchKernel", 10, 5, 1),
        launch("cuLaunchKernel", 150, 5, 2, cat="cuda_driver"),
        launch("cudaLaunchKernel", 160, 5, 3),
        launch("cudaStreamSynchronize", 170, 700, 4),
        kernel("nvjet_gemm", 100, 400, 1),
        kernel("_attention_kernel", 500, 300, 2),
        kernel("_rms_norm_kernel", 800, 50, 3),
        kernel("orphan", 900, 10, 99),  # no launch in the trace
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    phases = trace_summary.summarize(path)["phases"]

    assert phases["forward"]["wall_ms"] == pytest.approx(0.1)
    assert phases["forward"]["gpu_ms"] == pytest.approx(0.4) and phases["forward"]["kernels"] == 1
    assert phases["backward"]["wall_ms"] == pytest.approx(0.9)
    assert phases["backward"]["gpu_ms"] == pytest.approx(0.35) and phases["backward"]["kernels"] == 2
    assert [k["name"] for k in phases["backward"]["top_kernels"]] == ["_attention_kernel", "_rms_norm_kernel"]
    assert phases["backward"]["top_runtime_calls"][0] == {"name": "cudaStreamSynchronize", "ms": 0.7, "calls": 1}
    assert phases["outside phases"]["gpu_ms"] == pytest.approx(0.01)
    assert list(phases)[0] == "forward"  # ordered by GPU time
