"""Peak memory and throughput of full fine-tuning vs LoRA vs QLoRA (and vs FP8 linears) on one GPU.

    python benchmarks/lora_memory.py --config configs/qwen3-1.7b.yaml --seq-len 2048 \
        --micro-batch 1 --rank 16 --steps 10 --warmup 3 --out bench_out/lora_memory.json
    python benchmarks/lora_memory.py --config configs/tiny.yaml --seq-len 128 --device cpu --steps 2 --warmup 1 \
        --set model.hidden_size=256 --set model.num_kv_heads=4 --set model.head_dim=64   # NF4-sized smoke test

Every case runs in its own process (so one case's allocator state cannot lower or raise
another's peak) on the same shape, sequence length and micro-batch, from the same seeded
random init (no checkpoint download is needed), in the way the training loop runs one GPU:
``parallel.strategy=none``, fp32 parameters with bf16 autocast, the fused chunked output
projection + loss (training/linear_cross_entropy.py), AdamW over the trainable parameters
(fused on CUDA, as training/optimizers/build.py),
the config's attention kernel and determinism mode, optional per-block compile and
activation checkpointing (both as distributed/parallelize.py applies them).

Cases:
- ``full``: every parameter trains;
- ``lora``: adapters of rank ``--rank`` on every linear of every block (models/lora.py), the
  base frozen (no gradients, no optimizer state for it) and its linears stored in bf16, as
  the loop stores them under ``parallel.precision=bf16`` (models.lora.store_base_as: bit-identical
  to an fp32 base under bf16 autocast);
- ``lora_fp32_base``: the same with the frozen linears kept in fp32 (twice the base bytes);
- ``qlora``: the same adapters on an NF4 base (models/nf4.py): only embeddings, norms and
  the head stay in fp32;
- ``fp8_tensorwise`` / ``fp8_rowwise`` (not in the default list): full fine-tuning with the
  blocks' linears in FP8 (``parallel.float8``, distributed/float8.py), converted before
  compile as distributed/parallelize.py does.

``--profile``: one extra step under torch.profiler per case; its ten longest GPU kernel names
(total ms) and the step's GPU-busy vs wall time go into the case's JSON (``profile``).

Reported per case: parameter bytes resident after setup, peak allocated memory over the
training steps (``torch.cuda.max_memory_allocated``, which includes the resident weights),
its ratio to ``full``, tokens/s over the steady steps and its ratio to ``full``, trainable
parameters, and for the adapter cases the PEFT adapter directory's size and save time
(models/lora.save_peft_adapter: what ``export --adapter`` writes) plus the bytes of adapters
and their AdamW state (what an adapter checkpoint holds besides small data/RNG state).
The JSON goes to ``--out``; a table is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = ("full", "lora", "lora_fp32_base", "qlora")
ADAPTER_CASES = ("lora", "lora_fp32_base", "qlora")


def run_case(args: argparse.Namespace) -> dict:
    import torch

    import models
    from core import config as config_lib
    from core.config import LoRAConfig
    from distributed.activation_checkpoint import apply_activation_checkpointing
    from distributed.compile import apply_compile
    from models.lora import apply_lora, save_peft_adapter, store_base_as
    from models.forward import ModelInputs, model_forward
    from models.nf4 import quantize_base
    from training import determinism
    from training.linear_cross_entropy import linear_cross_entropy

    config = config_lib.load(args.config, [f"data.seq_len={args.seq_len}", "parallel.strategy=none", *args.set])
    device = torch.device(args.device)
    determinism.configure(determinism.numerics(config), device,
                          fill_uninitialized_memory=config.determinism.fill_uninitialized_memory)
    cuda = device.type == "cuda"
    model = models.build(config.model, generator=torch.Generator().manual_seed(0), device="cpu")
    if args.case in ADAPTER_CASES:
        apply_lora(model, LoRAConfig(rank=args.rank, alpha=2.0 * args.rank), seed=0)
        if args.case == "lora":
            store_base_as(model, torch.bfloat16)
    model.to(device)  # quantize on the device: torchao's NF4 packing is much faster there
    if args.case == "qlora":
        quantize_base(model)
    if args.case.startswith("fp8_"):
        from distributed.float8 import apply_float8, require_float8

        parallel = dataclasses.replace(config.parallel, float8=args.case.removeprefix("fp8_"))
        require_float8(parallel, device)
        apply_float8(model, parallel, fsdp=False)
    if args.activation_checkpointing != "none":
        apply_activation_checkpointing(model, args.activation_checkpointing)
    if args.compile:
        apply_compile(model, args.compile_mode)
    graphs = args.compile and args.compile_mode == "reduce-overhead"
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0, **({"fused": True} if cuda else {"foreach": True}))
    if cuda:
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        resident = sum(p.numel() * p.element_size() for p in model.parameters())

    generator = torch.Generator().manual_seed(1)
    vocab, seq, micro = config.model.vocab_size, args.seq_len, args.micro_batch
    tokens = torch.randint(0, vocab, (args.warmup + args.steps, micro, seq + 1), generator=generator)
    times = []

    def step(index: int) -> torch.Tensor:
        inputs = tokens[index, :, :-1].to(device)
        labels = tokens[index, :, 1:].to(device)
        if graphs:  # as the loop does before each micro-batch (training/loop.py)
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            loss = model_forward(
                model, ModelInputs(inputs),
                head=lambda hidden, weight: linear_cross_entropy(
                    hidden, weight, labels, chunk_tokens=config.train.loss_chunk_tokens,
                    compute_dtype=torch.bfloat16,
                ),
            ).head / labels.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return loss

    for index in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = step(index)
        times.append(time.perf_counter() - start)
    steady = times[args.warmup:]
    result = {
        "case": args.case,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "resident_bytes": resident,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "tokens_per_s": micro * seq * len(steady) / sum(steady),
        "step_s": sorted(steady)[len(steady) // 2],
        "trainable_params": sum(p.numel() for p in trainable),
        "final_loss": float(loss),
    }
    if args.compile:
        from torch._dynamo.utils import counters

        result["dynamo"] = {"graph_breaks": sum(counters["graph_break"].values()),
                            "break_reasons": [r[:200] for r in list(counters["graph_break"])[:5]],
                            "unique_graphs": counters["stats"]["unique_graphs"],
                            "calls_captured": counters["stats"]["calls_captured"]}
    if args.profile:
        result["profile"] = profile_step(lambda: step(0), cuda)
    if args.memory_peak and cuda:
        result["memory_peak"] = peak_breakdown(lambda: step(0))
    if args.case in ADAPTER_CASES:
        state_bytes = sum(
            t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
        )
        result["adapter_and_optimizer_bytes"] = sum(p.numel() * p.element_size() for p in trainable) + state_bytes
        with tempfile.TemporaryDirectory() as directory:
            start = time.perf_counter()
            save_peft_adapter(model, directory, args.config)
            result["adapter_save_s"] = time.perf_counter() - start
            result["adapter_dir_bytes"] = sum(f.stat().st_size for f in Path(directory).iterdir())
    return result


def profile_step(step, cuda: bool) -> dict:
    """One step under torch.profiler: wall ms, GPU-busy ms (sum of kernel times) and the ten
    kernels with the most total time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
    wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    totals: dict[str, float] = {}
    for event in kernels:
        totals[event.name] = totals.get(event.name, 0.0) + event.device_time / 1e3
    top = sorted(totals.items(), key=lambda item: -item[1])[:10]
    host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:10]
    return {"wall_ms": wall * 1e3, "kernel_ms": sum(totals.values()), "kernels": len(kernels),
            "top": [{"name": name[:120], "ms": round(ms, 3)} for name, ms in top],
            "host_top": [{"name": a.key[:120], "self_ms": round(a.self_cpu_time_total / 1e3, 3), "calls": a.count}
                         for a in host]}


def peak_breakdown(step, top: int = 12) -> dict:
    """One step with the allocator's history recorded: the allocations alive at the step's
    peak, grouped by where they were made (the innermost frame in this repository and the
    innermost frame of all, so compiled graphs show as their generated file), largest first."""
    import torch

    torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=1_000_000)
    try:
        step()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, list]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, list]] = {}
    for trace in snapshot["device_traces"]:
        for event in trace:
            if event["action"] == "alloc":
                live[event["addr"]] = (event["size"], event.get("frames", []))
                total += event["size"]
                if total > peak:
                    peak, at_peak = total, dict(live)
            elif event["action"] == "free_completed" and event["addr"] in live:
                total -= live.pop(event["addr"])[0]
    root = str(ROOT)
    groups: dict[str, list[int]] = {}
    for size, frames in at_peak.values():
        ours = next((f for f in frames if f["filename"].startswith(root)), None)
        inner = frames[0] if frames else None
        where = lambda f: "?" if f is None else f"{Path(f['filename']).name}:{f['line']} {f['name']}"  # noqa: E731
        key = f"{where(ours)} <- {where(inner)}"
        entry = groups.setdefault(key, [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])[:top]
    return {"peak_bytes_in_step": peak, "allocations_at_peak": len(at_peak),
            "groups": [{"where": key, "bytes": b, "count": n} for key, (b, n) in ranked]}


def table(results: list[dict]) -> str:
    full = next((r for r in results if r.get("case") == "full" and "error" not in r), None)
    gib = 1024**3
    lines = [
        "| case | resident GiB | peak GiB | peak / full | tokens/s | vs full | trainable | adapter dir MiB | save s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error'][-120:]} |||||||")
            continue
        peak = r["peak_bytes"]
        ratio = f"{peak / full['peak_bytes']:.2f}" if full and peak and full["peak_bytes"] else "-"
        speed = f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}x" if full else "-"
        adapter = f"{r['adapter_dir_bytes'] / 2**20:.1f}" if "adapter_dir_bytes" in r else "-"
        save = f"{r['adapter_save_s']:.2f}" if "adapter_save_s" in r else "-"
        lines.append(
            f"| {r['case']} | {r['resident_bytes'] / gib:.2f} | {peak / gib if peak else 0:.2f} | {ratio} | "
            f"{r['tokens_per_s']:.0f} | {speed} | {r['trainable_params'] / 1e6:.1f}M | {adapter} | {save} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/qwen3-1.7b.yaml")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--activation-checkpointing", default="none", choices=("none", "full", "selective"))
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (as parallel.compile)")
    parser.add_argument("--compile-mode", default="default", choices=("default", "reduce-overhead"),
                        help="with --compile, as parallel.compile_mode: reduce-overhead replays each block as CUDA graphs")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", action="store_true", help="profile one extra step per case (JSON 'profile')")
    parser.add_argument("--memory-peak", action="store_true",
                        help="record one extra step's allocations: what is alive at its peak, by origin (JSON 'memory_peak')")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in a child process
    args = parser.parse_args()

    if args.case is not None:
        print(json.dumps(run_case(args)))
        return 0
    results = []
    for case in args.cases.split(","):
        child = [
            "--config", args.config, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
            "--rank", str(args.rank), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--activation-checkpointing", args.activation_checkpointing, "--device", args.device, "--case", case,
        ] + (["--compile", "--compile-mode", args.compile_mode] if args.compile else []) + (["--profile"] if args.profile else []) + (
            ["--memory-peak"] if args.memory_peak else []) + [
            f"--set={item}" for item in args.set]
        proc = subprocess.run([sys.executable, __file__, *child], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode == 0:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        else:
            results.append({"case": case, "error": proc.stderr.strip()[-2000:]})
        print(json.dumps(results[-1]), flush=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("case", "out")}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    print(table(results))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
