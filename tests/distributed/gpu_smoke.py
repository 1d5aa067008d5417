"""GPU check of parallelize (not collected by pytest; needs 2 CUDA GPUs and NCCL).

    torchrun --standalone --nproc_per_node=2 tests/distributed/gpu_smoke.py

Trains the toy model under several strategies and checks, on rank 0: compiled FSDP / TP and
CPU-offloaded fp32 runs agree with eager DDP, a bf16 FSDP run (flex attention) repeated is
bitwise equal (deterministic algorithms on), and every run starts from the same param_hash.
Exits non-zero on the first failed check; prints one JSON line of all results.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from core.config import ParallelConfig  # noqa: E402
from distributed.init import prepare_process_env  # noqa: E402
from tests.distributed import scenarios  # noqa: E402

RUNS = [
    ("ddp", dict(strategy="ddp"), {}),
    ("fsdp_compile_ac", dict(strategy="fsdp", compile=True, activation_checkpointing="full"), {}),
    ("tp_compile", dict(strategy="fsdp", tp=2, compile=True), {}),
    ("fsdp_offload", dict(strategy="fsdp", cpu_offload=True), {}),
    ("fsdp_bf16_flex_a", dict(strategy="fsdp", precision="bf16"), {"attention": "flex"}),
    ("fsdp_bf16_flex_b", dict(strategy="fsdp", precision="bf16"), {"attention": "flex"}),
]
FP32_RUNS = ("fsdp_compile_ac", "tp_compile", "fsdp_offload")


def main() -> int:
    prepare_process_env(ParallelConfig(device="cuda", backend="nccl"), deterministic=True)
    torch.use_deterministic_algorithms(True)
    results = scenarios.many(RUNS, device="cuda")
    if int(os.environ["RANK"]) != 0:
        return 0
    failures = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    def close(a: list[float], b: list[float], rtol: float) -> bool:
        return all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))

    ref = results["ddp"]
    for name in FP32_RUNS:
        check(close(results[name]["losses"], ref["losses"], 1e-4), f"{name} losses vs ddp")
        check(close(results[name]["grad_norms"], ref["grad_norms"], 1e-4), f"{name} grad norms vs ddp")
    a, b = results["fsdp_bf16_flex_a"], results["fsdp_bf16_flex_b"]
    check(a["losses"] == b["losses"] and a["hash_after"] == b["hash_after"], "bf16 FSDP repeat not bitwise equal")
    check(close(a["losses"], ref["losses"], 2e-2), "bf16 far from fp32")
    check(len({r["hash_before"] for r in results.values()}) == 1, "param_hash differs at start")
    summary = {name: {k: r[k] for k in ("losses", "grad_norms", "hash_after")} for name, r in results.items()}
    print(json.dumps({"failures": failures, "results": summary}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
