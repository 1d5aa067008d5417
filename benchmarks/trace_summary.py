"""Summarize a chrome trace written by ``runtime.profile_*`` (runtime/profiler.py).

    python benchmarks/trace_summary.py runs/<run>/artifacts/traces/rank0_steps6-8.json [--top 25] [--json out.json]

For every recorded step (the ``lockstep_step#N`` ranges) it prints the host wall time, the
time some GPU kernel or copy was running (the union of their intervals), and the GPU idle
time inside the step; then GPU time by kernel family (matmul, attention, cross entropy,
optimizer, elementwise/fused, copies, communication) and the longest kernels by name.
Idle time inside a step is what the host costs the GPU (launch gaps, host syncs, Python);
the families say where the busy time goes.
"""

from __future__ import annotations

import argparse
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
    ("cross_entropy", ("log_softmax", "nll_loss", "cross_entropy", "softmax")),
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


def summarize(path: Path, top: int = 25) -> dict:
    trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    steps = []
    gpu = []
    for ev in events:
        if ev.get("ph") != "X":
            continue
        name, cat = ev.get("name", ""), ev.get("cat", "")
        start, dur = float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
        if name.startswith(STEP_PREFIX) and cat in ("user_annotation", "cpu_instant_event", "python_function", ""):
            steps.append((int(name[len(STEP_PREFIX):]), start, start + dur))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append((name if cat == "kernel" else cat, start, start + dur))
    steps.sort()
    step_rows = []
    for step, start, stop in steps:
        inside = [(max(s, start), min(e, stop)) for _, s, e in gpu if e > start and s < stop]
        busy = union_length(inside)
        step_rows.append({"step": step, "wall_ms": (stop - start) / 1e3, "gpu_busy_ms": busy / 1e3,
                          "gpu_idle_ms": (stop - start - busy) / 1e3})
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
    }


def print_summary(summary: dict) -> None:
    print(f"trace: {summary['trace']}")
    print(f"{'step':>6} {'wall ms':>9} {'gpu busy':>9} {'gpu idle':>9}")
    for row in summary["steps"]:
        print(f"{row['step']:>6} {row['wall_ms']:>9.1f} {row['gpu_busy_ms']:>9.1f} {row['gpu_idle_ms']:>9.1f}")
    print("GPU time per step by family (ms; kernels may overlap across streams):")
    for fam, ms in summary["per_step_family_ms"].items():
        print(f"  {fam:<20} {ms:8.2f}")
    print("longest kernels (ms per step, calls per step):")
    for row in summary["top_kernels"]:
        print(f"  {row['ms_per_step']:8.2f} {row['calls_per_step']:6.1f}  {row['name']}")


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
