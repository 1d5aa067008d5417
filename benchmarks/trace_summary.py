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
