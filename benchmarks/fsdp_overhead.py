"""What FSDP2 costs the host, measured on one device: the same model trained plain and
fully sharded over a one-rank mesh.

    python benchmarks/fsdp_overhead.py --shape qwen3-1.7b --seq 2048 --micro-batch 4 \
        --steps 8 --warmup 3 --out bench_out/fsdp_overhead.json
    python benchmarks/fsdp_overhead.py --shape tiny --seq 128 --micro-batch 2 --device cpu --steps 2 --warmup 1

Why one device: on several GPUs the time the host spends issuing a step's work mixes with
the collectives' waits. On a one-rank mesh FSDP2 runs its whole machinery (pre-forward
all-gather with copy-in/copy-out, DTensor parameters, post-backward reduce-scatter, the
optimizer over DTensors) with nothing to wait for, so the difference from the plain model
is its host cost. Where that cost exceeds the GPU's work, the GPU waits, on every GPU count.

What runs, per variant (``none``: the plain model under bf16 autocast, as one GPU trains;
``fsdp``: ``distributed.parallelize`` with a one-rank ``DeviceMesh``, bf16 by FSDP's
mixed-precision policy, as several GPUs train): the shape's preset (``configs/<shape>.yaml``,
compile and activation checkpointing as it sets them, ``--override`` for more), the trainer's
loss, AdamW and gradient clipping, one micro-batch of random packed documents per step,
placed on the device as the trainer places it (``ParallelPlan.place_batch``).
``--warmup`` steps (the first compiles), then ``--steps`` timed steps, each ended by a device
sync. Per step: wall time and the host time to issue forward, backward and optimizer (no
sync inside; a host phase that takes as long as the step means the device waited on it).
On CUDA, 2 more steps under ``torch.profiler`` give the GPU's busy and idle time per step
(``benchmarks/trace_summary.py``) and the host work that ran while it was idle. Columns are
medians over the timed steps; ``host_ms`` is the median of each step's forward + backward +
optimizer issue time.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import hf_baseline as hfb  # noqa: E402
from benchmarks import trace_summary  # noqa: E402

VARIANTS = ("none", "fsdp")


def build(variant: str, config, device: torch.device):
    """The model (plain or sharded over a one-rank mesh), its optimizer and precision."""
    import models
    from core import seeding
    from core.distributed_context import DistributedContext
    from distributed.fsdp import is_fully_sharded
    from distributed.parallelize import parallelize
    from distributed.topology import MESH_DIMS, Topology, mesh_shape
    from torch.distributed.device_mesh import init_device_mesh
    from training.plan import ParallelPlan
    from training.optimizers.build import build_optimizer
    from training import determinism
    from training.precision import Precision

    numerics = determinism.numerics(config)  # the run's, as training/builders.py builds it
    model = models.build(config.model, generator=seeding.generator(config.train.seed, "model_init"))
    model.use_numerics(numerics)
    parallel = dataclasses.replace(config.parallel, strategy="fsdp" if variant == "fsdp" else "none")
    shape = mesh_shape(parallel, 1)
    mesh = init_device_mesh(device.type, shape.as_tuple(), mesh_dim_names=MESH_DIMS) if variant == "fsdp" else None
    ctx = DistributedContext.from_env(parallel)
    topology = Topology(shape=shape, dp_rank=0, tp_rank=0, mesh=mesh)
    model = parallelize(model, parallel, ctx, topology)
    if variant == "fsdp" and not is_fully_sharded(model):
        raise SystemExit("fsdp variant: the model was not sharded")
    plan = ParallelPlan(topology=topology, strategy=parallel.strategy, device=device,
                        fsdp_applied=is_fully_sharded(model))
    precision = Precision(numerics, device=device, wrapper_casts=plan.fsdp_applied)
    return model, build_optimizer(model, config.train, device), precision, plan


def random_batch(config, micro: int, seq: int, generator: torch.Generator):
    """One micro-batch of packed random documents (64..seq tokens each), as the pipeline lays them out."""
    from data.batch import IGNORE_INDEX, Batch

    vocab = config.model.vocab_size
    ids = torch.randint(vocab, (micro, seq), generator=generator)
    labels = torch.roll(ids, -1, dims=1)
    positions = torch.empty_like(ids)
    documents = torch.empty_like(ids)
    for row in range(micro):
        start, doc = 0, 0
        while start < seq:
            length = min(seq - start, int(torch.randint(64, max(65, seq // 2), (1,), generator=generator)))
            positions[row, start : start + length] = torch.arange(length)
            documents[row, start : start + length] = doc
            labels[row, start + length - 1] = IGNORE_INDEX  # no target across a document end
            start, doc = start + length, doc + 1
    return Batch(step=1, input_ids=ids, labels=labels, position_ids=positions, document_ids=documents,
                 sequence_index=list(range(micro)), provenance=[[] for _ in range(micro)], state={})


def run_variant(variant: str, config, args, device: torch.device) -> dict:
    from distributed.grad import clip_grad_norm_
    from training.losses import CausalLMLoss
    from training.step import model_loss

    model, optimizer, precision, plan = build(variant, config, device)
    loss_fn = CausalLMLoss(chunk_tokens=config.train.loss_chunk_tokens, compiled=config.parallel.compile)
    generator = torch.Generator().manual_seed(0)
    batches = [random_batch(config, args.micro_batch, args.seq, generator) for _ in range(2)]
    targets = max(1, batches[0].num_target_tokens())
    place = plan.place_batch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(i: int) -> dict[str, float]:
        batch = batches[i % len(batches)]
        t0 = time.perf_counter()
        with precision.autocast():
            loss = model_loss(model, batch, loss_fn, place, fuse_head=loss_fn.fuses_head)
        t1 = time.perf_counter()
        (loss / targets).backward()
        t2 = time.perf_counter()
        clip_grad_norm_(model, config.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        sync()
        t4 = time.perf_counter()
        return {"forward_ms": (t1 - t0) * 1e3, "backward_ms": (t2 - t1) * 1e3,
                "optimizer_ms": (t3 - t2) * 1e3, "step_ms": (t4 - t0) * 1e3}

    for i in range(args.warmup):
        step(i)
    sync()
    times = [step(i) for i in range(args.steps)]
    for t in times:
        t["host_ms"] = t["forward_ms"] + t["backward_ms"] + t["optimizer_ms"]
    result = {name: statistics.median(t[name] for t in times) for name in times[0]}
    result["tokens_per_s"] = args.micro_batch * args.seq / (result["step_ms"] / 1e3)
    if args.profile and device.type == "cuda":
        result["profile"] = profile(step)
    model = optimizer = None  # free them now (step() above still refers to both)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def profile(step) -> dict:
    """Busy/idle device time per step, and the host work during idle gaps, over 2 steps."""
    from torch.profiler import ProfilerActivity, profile as torch_profile, record_function

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(2):
            with record_function(f"{trace_summary.STEP_PREFIX}{i}"):
                step(i)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        summary = trace_summary.summarize(path, top=10)
    steps = summary["steps"]
    return {
        "wall_ms": statistics.mean(s["wall_ms"] for s in steps),
        "busy_ms": statistics.mean(s["gpu_busy_ms"] for s in steps),
        "idle_ms": statistics.mean(s["gpu_idle_ms"] for s in steps),
        "idle_gaps": statistics.mean(s["idle_gaps"] for s in steps),
        "host_during_idle": summary["host_during_gpu_idle"],
    }


def init_one_rank_group(device: torch.device) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_table(results: dict) -> None:
    cols = ("step_ms", "forward_ms", "backward_ms", "optimizer_ms", "host_ms", "tokens_per_s")
    print(f"{'variant':8} " + " ".join(f"{c:>13}" for c in cols) + f" {'busy_ms':>9} {'idle_ms':>9}")
    for name, r in results.items():
        prof = r.get("profile", {})
        busy = f"{prof['busy_ms']:9.1f}" if prof else f"{'-':>9}"
        idle = f"{prof['idle_ms']:9.1f}" if prof else f"{'-':>9}"
        print(f"{name:8} " + " ".join(f"{r[c]:13.1f}" for c in cols) + f" {busy} {idle}")
    if "none" in results and "fsdp" in results:
        a, b = results["none"], results["fsdp"]
        print(f"fsdp - none: step {b['step_ms'] - a['step_ms']:+.1f} ms, host forward "
              f"{b['forward_ms'] - a['forward_ms']:+.1f} ms, backward {b['backward_ms'] - a['backward_ms']:+.1f} ms, "
              f"optimizer {b['optimizer_ms'] - a['optimizer_ms']:+.1f} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-1.7b", choices=list(hfb.PRESETS))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default="none,fsdp")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--override", action="append", default=[], help="a config override key=value (repeatable)")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")

    from core.config import load

    path, extra = hfb.preset_args(args.shape)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # where DistributedContext puts local rank 0
    overrides = [*extra, f"data.seq_len={args.seq}", f"parallel.device={device.type}", *args.override]
    if device.type == "cpu":
        overrides.append("parallel.precision=fp32")
    config = load(ROOT / path, overrides)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    init_one_rank_group(device)
    try:
        results = {v: run_variant(v, config, args, device) for v in variants}
    finally:
        dist.destroy_process_group()
    print_table(results)
    record = {
        "benchmark": "fsdp_overhead",
        "shape": args.shape,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "compile": config.parallel.compile,
        "activation_checkpointing": config.parallel.activation_checkpointing,
        "overrides": overrides,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "results": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
