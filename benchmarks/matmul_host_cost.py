"""Host (CPU) time of issuing one small bf16 matmul on CUDA, under each determinism setting.

    python benchmarks/matmul_host_cost.py --out bench_out/matmul_host_cost.json

A step that launches thousands of matmuls on small inputs (LoRA's rank-r products, FP8's
scaled matmuls, a 0.5B model at micro-batch 1) is bound by the host's issue time, not by
the GPU. This measures that time per call: ``--calls`` back-to-back ``torch.mm`` of
(tokens x hidden) @ (hidden x rank) in bf16, whose GPU time is far below their issue time,
timed on the host without synchronizing in between. Each setting runs in its own process,
because ``CUBLAS_WORKSPACE_CONFIG`` is read when CUDA initializes:

- ``default``: no deterministic settings;
- ``workspace``: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` only;
- ``deterministic``: ``torch.use_deterministic_algorithms(True)`` only;
- ``bitwise``: both, as ``determinism.mode=bitwise`` sets them (training/determinism.py).

Also reported: the same for ``F.linear`` under bf16 autocast with an fp32 weight (a cast
plus a matmul, what an fp32 LoRA adapter costs) and for ``torch._scaled_mm`` in FP8 where
the GPU has it. A table is printed; JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "default": {},
    "workspace": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
    "deterministic": {"LOCKSTEP_BENCH_DETERMINISTIC": "1"},
    "bitwise": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "LOCKSTEP_BENCH_DETERMINISTIC": "1"},
}


def measure(calls: int, tokens: int, hidden: int, rank: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.use_deterministic_algorithms(os.environ.get("LOCKSTEP_BENCH_DETERMINISTIC") == "1")
    device = torch.device("cuda")
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    w = torch.randn(rank, hidden, device=device, dtype=torch.bfloat16)
    w32 = w.float()

    def host_us(fn) -> float:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        issued = time.perf_counter() - start
        torch.cuda.synchronize()
        return issued / calls * 1e6

    result = {
        "mm_us": host_us(lambda: torch.mm(x, w.t())),
        "add_us": host_us(lambda: x.add(x)),  # a plain elementwise kernel, for scale
    }
    with torch.autocast("cuda", dtype=torch.bfloat16):
        result["autocast_linear_fp32_weight_us"] = host_us(lambda: F.linear(x, w32))
    if torch.cuda.get_device_capability() >= (8, 9):
        x8 = x.to(torch.float8_e4m3fn)
        w8 = torch.randn(hidden, 32, device=device).to(torch.float8_e4m3fn)  # (K, N), column-major below
        one = torch.ones((), device=device)
        result["scaled_mm_fp8_us"] = host_us(
            lambda: torch._scaled_mm(x8, w8.t().contiguous().t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        )
    result["device"] = torch.cuda.get_device_name()
    result["torch"] = torch.__version__
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.calls, args.tokens, args.hidden, args.rank)))
        return 0
    results = {}
    for name, env in SETTINGS.items():
        child_env = {k: v for k, v in os.environ.items() if k not in ("CUBLAS_WORKSPACE_CONFIG",)}
        child_env.update(env)
        proc = subprocess.run(
            [sys.executable, __file__, "--child", "--calls", str(args.calls), "--tokens", str(args.tokens),
             "--hidden", str(args.hidden), "--rank", str(args.rank)],
            env=child_env, capture_output=True, text=True,
        )
        results[name] = (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
                         else {"error": proc.stderr.strip()[-500:]})
    keys = ["mm_us", "add_us", "autocast_linear_fp32_weight_us", "scaled_mm_fp8_us"]
    print("| setting | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, r in results.items():
        cells = [f"{r[k]:.1f}" if k in r else "-" for k in keys] if "error" not in r else [r["error"][-80:]]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"settings": vars(args), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
