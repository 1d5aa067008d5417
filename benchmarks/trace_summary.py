"""Summarize a chrome trace written by ``runtime.profile_*`` (runtime/profiler.py).

    python benchmarks/trace_summary.py runs/<run>/artifacts/traces/rank0_steps6-8.json [--top 25] [--json out.json]

For every recorded step (the ``lockstep_step#N`` ranges) it prints the host wall time, the
time some GPU kernel or copy was running (the union of their intervals), and the GPU idle
time inside the step; then GPU time by kernel family (matmul, attention, cross entropy,
optimizer, elementwise/fused, copies, communication) and the longest kernels by name.
Idle time inside a step is what the host costs the GPU (launch gaps, host syncs, Python);
the families say where the busy time goes. For the idle time it also lists the host work
that ran while the GPU had nothing to do: every host range (trainer phases, aten ops, CUDA
runtime calls, Python functions) with the milliseconds per step it overlapped an idle gap.
Ranges nest, so an outer range (a phase) counts the idle time of everything inside it.

Per trainer phase (runtime/profiler.py's ranges: ``prepare``, ``forward``, ``backward``, ...) it
also sums the GPU time of the kernels *launched* from it (a kernel is matched to its launch by the
trace's correlation id, and the launch to the innermost phase range holding it; a backward's
launches come from autograd's own thread, inside the backward range), beside the phase's host
wall time: a phase whose kernels take far less than its wall time is host-bound (or waits on a
sync), one whose kernels take about its wall time is GPU-bound. With each, its busiest kernels and
its longest CUDA runtime calls (syncs, allocations).
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
from collections import defaultdict
from pathlib import Path

STEP_PREFIX = "lockstep_step#"

FAMILIES = (  # first match wins; matched against the lowercased kernel name
    ("communication", ("nccl",)),
    ("attention", ("flex", "flash", "fmha", "attention", "triton_tem_fused")),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "cublas", "matmul", "wgmma")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("cross_entropy", ("log_softmax", "nll_loss", "cross_entropy", "softmax", "logsumexp")),
    # Inductor names a fused kernel after its ops (``triton_per_fused__to_copy_..._rsqrt``):
    # a cast inside a norm is not a copy. poi = pointwise, per/red = with a reduction.
    ("fused/elementwise", ("triton_poi",)),
    ("fused/reduction", ("triton_per", "triton_red")),
    ("copy", ("memcpy", "memset", "copy_", "cat", "to_copy")),
    ("reduction", ("reduce", "norm")),
    ("fused/elementwise", ("triton", "elementwise", "vectorized", "unrolled")),
)


def family(name: str) -> str:
    lowered = name.lower()
    for fam, keys in FAMILIES:
        if any(key in lowered for key in keys):
            return fam
    return "other"


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
PHASE_NAMES = ("data_wait", "prepare", "forward", "backward", "optimizer", "communication", "settle", "checkpoint")
"""runtime/profiler.py's phase ranges (``StepTimer.phase`` annotates each with its name)."""
MIN_GAP_US = 20.0  # idle stretches shorter than this are launch jitter, not host work


def idle_gaps(busy: list[tuple[float, float]], start: float, stop: float) -> list[tuple[float, float]]:
    """The stretches of [start, stop) that no interval of ``busy`` covers, in time order."""
    gaps, cursor = [], start
    for s, e in sorted(busy):
        if s > cursor and s - cursor >= MIN_GAP_US:
            gaps.append((cursor, min(s, stop)))
        cursor = max(cursor, e)
    if stop - cursor >= MIN_GAP_US:
        gaps.append((cursor, stop))
    return gaps


def host_work_in_gaps(host: list[tuple[str, float, float]], gaps: list[tuple[float, float]]) -> dict[str, float]:
    """Microseconds each host range name overlapped the (sorted, disjoint) gaps."""
    starts = [g[0] for g in gaps]
    overlap: dict[str, float] = defaultdict(float)
    for name, s, e in host:
        i = max(bisect.bisect_right(starts, s) - 1, 0)
        while i < len(gaps) and gaps[i][0] < e:
            lo, hi = max(s, gaps[i][0]), min(e, gaps[i][1])
            if hi > lo:
                overlap[name] += hi - lo
            i += 1
    return overlap


def innermost(ranges: list[tuple[float, float, str]], at: float) -> str | None:
    """The name of the latest-starting range of ``ranges`` (sorted by start) that holds ``at``."""
    i = bisect.bisect_right(ranges, (at, float("inf"), "")) - 1
    while i >= 0:
        start, stop, name = ranges[i]
        if start <= at < stop:
            return name
        i -= 1
    return None


def phase_attribution(events: list[dict], window: tuple[float, float], n_steps: int, top: int = 8) -> dict:
    """Per phase name: host wall ms, the GPU ms and count of the kernels launched from it, its
    busiest kernels and its longest CUDA runtime calls, each per step (module docstring)."""
    phases: list[tuple[float, float, str]] = []
    launches: dict[int, float] = {}
    runtime: list[tuple[str, float, float]] = []
    gpu: list[tuple[str, float, float, int]] = []
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat, name = ev.get("cat", ""), ev.get("name", "")
        start, dur = float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
        if start + dur <= window[0] or start >= window[1]:
            continue
        correlation = (ev.get("args") or {}).get("correlation")
        if cat == "user_annotation" and name in PHASE_NAMES:
            phases.append((start, start + dur, name))
        elif cat in LAUNCH_CATEGORIES:
            runtime.append((name, start, dur))
            if correlation is not None:
                launches[correlation] = start
        elif cat in GPU_CATEGORIES:
            gpu.append((name if cat == "kernel" else cat, start, dur, correlation))
    phases.sort()
    n = max(n_steps, 1)
    out: dict[str, dict] = {}

    def entry(phase: str) -> dict:
        return out.setdefault(phase, {"wall_ms": 0.0, "gpu_ms": 0.0, "kernels": 0,
                                      "by_kernel": defaultdict(lambda: [0.0, 0]), "by_call": defaultdict(lambda: [0.0, 0])})

    for start, stop, name in phases:
        entry(name)["wall_ms"] += (stop - start) / 1e3
    for name, start, dur, correlation in gpu:
        launched = launches.get(correlation)
        phase = innermost(phases, launched) if launched is not None else None
        row = entry(phase or "outside phases")
        row["gpu_ms"] += dur / 1e3
        row["kernels"] += 1
        kernel = row["by_kernel"][re.sub(r"\s+", " ", name)[:100]]
        kernel[0] += dur / 1e3
        kernel[1] += 1
    for name, start, dur in runtime:
        phase = innermost(phases, start)
        call = entry(phase or "outside phases")["by_call"][name]
        call[0] += dur / 1e3
        call[1] += 1
    result = {}
    for phase, row in sorted(out.items(), key=lambda kv: -kv[1]["gpu_ms"]):
        result[phase] = {
            "wall_ms": row["wall_ms"] / n, "gpu_ms": row["gpu_ms"] / n, "kernels": row["kernels"] / n,
            "top_kernels": [{"name": k, "ms": v[0] / n, "calls": v[1] / n}
                            for k, v in sorted(row["by_kernel"].items(), key=lambda kv: -kv[1][0])[:top]],
            "top_runtime_calls": [{"name": k, "ms": v[0] / n, "calls": v[1] / n}
                                  for k, v in sorted(row["by_call"].items(), key=lambda kv: -kv[1][0])[:top]]}
    return result


def summarize(path: Path, top: int = 25) -> dict:
    trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    steps = []
    gpu = []
    host = []
    for ev in events:
        if ev.get("ph") != "X":
            continue
        name, cat = ev.get("name", ""), ev.get("cat", "")
        start, dur = float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
        if name.startswith(STEP_PREFIX) and cat in ("user_annotation", "cpu_instant_event", "python_function", ""):
            steps.append((int(name[len(STEP_PREFIX):]), start, start + dur))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append((name if cat == "kernel" else cat, start, start + dur))
        elif cat in HOST_CATEGORIES:
            host.append((re.sub(r"\s+", " ", name)[:120], start, start + dur))
    steps.sort()
    step_rows = []
    idle_host: dict[str, float] = defaultdict(float)
    for step, start, stop in steps:
        inside = [(max(s, start), min(e, stop)) for _, s, e in gpu if e > start and s < stop]
        busy = union_length(inside)
        gaps = idle_gaps(inside, start, stop)
        for name, us in host_work_in_gaps([h for h in host if h[2] > start and h[1] < stop], gaps).items():
            if not name.startswith(STEP_PREFIX):
                idle_host[name] += us
        longest = max(gaps, key=lambda g: g[1] - g[0], default=(start, start))
        step_rows.append({"step": step, "wall_ms": (stop - start) / 1e3, "gpu_busy_ms": busy / 1e3,
                          "gpu_idle_ms": (stop - start - busy) / 1e3, "idle_gaps": len(gaps),
                          "longest_gap_ms": (longest[1] - longest[0]) / 1e3,
                          "longest_gap_at_ms": (longest[0] - start) / 1e3})
    window = (steps[0][1], steps[-1][2]) if steps else (float("-inf"), float("inf"))
    by_family: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, s, e in gpu:
        if e <= window[0] or s >= window[1]:
            continue
        by_family[family(name)] += (e - s) / 1e3
        entry = by_name[re.sub(r"\s+", " ", name)[:120]]
        entry[0] += (e - s) / 1e3
        entry[1] += 1
    n = max(len(steps), 1)
    return {
        "trace": str(path),
        "steps": step_rows,
        "per_step_family_ms": {k: v / n for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": k, "ms_per_step": v[0] / n, "calls_per_step": v[1] / n}
            for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        ],
        "host_during_gpu_idle": [
            {"name": k, "ms_per_step": v / 1e3 / n} for k, v in sorted(idle_host.items(), key=lambda kv: -kv[1])[:top]
        ],
        "phases": phase_attribution(events, window, len(steps)),
    }


def print_summary(summary: dict) -> None:
    print(f"trace: {summary['trace']}")
    print(f"{'step':>6} {'wall ms':>9} {'gpu busy':>9} {'gpu idle':>9} {'gaps':>5} {'longest gap (at ms)':>20}")
    for row in summary["steps"]:
        print(f"{row['step']:>6} {row['wall_ms']:>9.1f} {row['gpu_busy_ms']:>9.1f} {row['gpu_idle_ms']:>9.1f} "
              f"{row['idle_gaps']:>5} {row['longest_gap_ms']:>9.2f} ({row['longest_gap_at_ms']:.1f})")
    print("GPU time per step by family (ms; kernels may overlap across streams):")
    for fam, ms in summary["per_step_family_ms"].items():
        print(f"  {fam:<20} {ms:8.2f}")
    print("longest kernels (ms per step, calls per step):")
    for row in summary["top_kernels"]:
        print(f"  {row['ms_per_step']:8.2f} {row['calls_per_step']:6.1f}  {row['name']}")
    print("host ranges while the GPU was idle (ms per step; nested ranges each count):")
    for row in summary["host_during_gpu_idle"]:
        print(f"  {row['ms_per_step']:8.2f}  {row['name']}")
    print("per phase (ms per step): host wall, GPU time of the kernels it launched, kernels")
    for phase, row in summary.get("phases", {}).items():
        print(f"  {phase:<16} wall {row['wall_ms']:9.1f}  gpu {row['gpu_ms']:9.1f}  kernels {row['kernels']:8.0f}")
        for kernel in row["top_kernels"][:5]:
            print(f"      {kernel['ms']:8.2f} ms {kernel['calls']:7.0f}x  {kernel['name']}")
        for call in row["top_runtime_calls"][:4]:
            print(f"      {call['ms']:8.2f} ms {call['calls']:7.0f}x  (runtime) {call['name']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", type=Path, default=None, help="also write the summaries here")
    args = parser.parse_args(argv)
    summaries = [summarize(path, args.top) for path in args.traces]
    for summary in summaries:
        print_summary(summary)
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
