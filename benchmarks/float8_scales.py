"""FP8 all-gather scales under FSDP2 on GPUs: precomputed once per forward against torchao's
per-weight path, bitwise.

    torchrun --nproc-per-node 2 benchmarks/float8_scales.py --out bench_out/float8_scales.json

On every rank: a small Qwen-shaped model (2 blocks, hidden 512) with FP8 tensorwise linears,
sharded by ``distributed.fsdp.apply_fsdp`` over all ranks, trains 4 AdamW steps under bf16
autocast twice, once with ``distributed.float8.PrecomputeFloat8Scales`` (what
``parallelize`` registers: the scales, and the weights' FP8 casts, made once per forward)
and once with torchao computing each weight's scale and cast inside its all-gather. For each
combination of ``reshard_after_forward`` and per-block compile, the losses must be bitwise
equal, and every scale the hook stored must equal torchao's ``tensor_to_scale`` of the
weight the forward began with. It also times what the all-gathers' inputs cost the host
per FP8 weight, on a model with Qwen3-1.7B's count of FP8 weights (196), each small:
torchao's cast inside each weight's ``fsdp_pre_all_gather`` against the hook's batched
casts (``precast_local_shards``) and the cached result each gather then returns (median of
20, the device synchronized around each). Prints a table, writes JSON,
and exits 1 if a check failed. Needs CUDA GPUs with FP8 tensor cores and torchao; without CUDA
it runs on CPU ranks over gloo with torchao's FP8 emulation, on a narrower model of the same
layout (hidden 128: a check of the bits, not of speed; the test suite does, without the
compiled cases: ``--no-compile``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import models  # noqa: E402
from core.config import ModelConfig, ParallelConfig  # noqa: E402
from distributed.compile import apply_compile  # noqa: E402
from distributed.float8 import apply_float8, precast_local_shards, precompute_scales_each_forward  # noqa: E402
from distributed.fsdp import apply_fsdp  # noqa: E402
from models.forward import ModelInputs, model_forward  # noqa: E402

SHAPE = ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_layers=2, num_heads=8,
                    num_kv_heads=2, head_dim=64, tie_embeddings=False)
# On CPU ranks (torchao's FP8 emulation, a check of the bits and not of speed): the same layout, narrower.
CPU_SHAPE = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=32, tie_embeddings=False)
STEPS = 4
# Qwen3-1.7B's count of FP8 weights (28 blocks of 7), each small: what the host pays per weight.
HOST_SHAPE = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=28, num_heads=4,
                         num_kv_heads=2, head_dim=16, tie_embeddings=False)


def train(parallel: ParallelConfig, mesh, device: torch.device, *, compile_blocks: bool, hook: bool,
          tokens: torch.Tensor) -> dict:
    """STEPS steps; the losses, and how many stored scales differed from torchao's."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_utils import tensor_to_scale

    shape = SHAPE if device.type == "cuda" else CPU_SHAPE
    model = models.build(shape, generator=torch.Generator().manual_seed(0)).to(device)
    apply_float8(model, parallel, fsdp=True, emulate=device.type != "cuda")
    if compile_blocks:
        apply_compile(model, "default")
    apply_fsdp(model, mesh, parallel, device)
    if hook and not precompute_scales_each_forward(model, parallel):
        raise RuntimeError("precompute_scales_each_forward registered no hook")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, mismatched = [], 0
    for _ in range(STEPS):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model_forward(model, ModelInputs(tokens[:, :-1])).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if hook:  # sharded again and not yet stepped: the weights this forward began with
            for module in model.modules():
                if isinstance(module, Float8Linear):
                    local = module.weight._local_tensor
                    expected = tensor_to_scale(local._tensor, local._dtype, reduce_amax=True, device_mesh=mesh)
                    stored = local._precomputed_scale
                    mismatched += stored is None or not torch.equal(stored, expected)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "scales_mismatched": mismatched}


def time_gather_inputs(mesh, device: torch.device, repeats: int = 20) -> dict:
    """Host microseconds per FP8 weight to produce the all-gathers' inputs, on HOST_SHAPE
    (small weights, so the casts' own compute is negligible beside the host's work):
    torchao's per-weight cast against the batched casts plus each gather's cached return."""
    import time

    from torchao.float8.float8_linear import Float8Linear

    parallel = ParallelConfig(strategy="fsdp", precision="bf16", float8="tensorwise")
    model = models.build(HOST_SHAPE, generator=torch.Generator().manual_seed(0)).to(device)
    apply_float8(model, parallel, fsdp=True, emulate=device.type != "cuda")
    apply_fsdp(model, mesh, parallel, device)
    precompute_scales_each_forward(model, parallel)
    with torch.autocast(device.type, dtype=torch.bfloat16):  # the hook stores every scale; sharded again after
        model_forward(model, ModelInputs(torch.zeros(1, 16, dtype=torch.long, device=device))).logits.float().sum().backward()
    weights = [m.weight for m in model.modules() if isinstance(m, Float8Linear)]
    shards = [weight._local_tensor for weight in weights]

    def torchao_casts():
        for shard in shards:
            type(shard).fsdp_pre_all_gather(shard, mesh)

    def batched_casts():
        precast_local_shards(weights, [shard._precomputed_scale for shard in shards], shards[0]._dtype)
        for shard in shards:
            shard.fsdp_pre_all_gather(mesh)

    timings = {}
    with torch.no_grad():
        for name, fn in (("torchao", torchao_casts), ("batched", batched_casts)):
            samples = []
            for _ in range(repeats + 2):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                samples.append(time.perf_counter() - start)
            samples = sorted(samples[2:])
            timings[f"{name}_us_per_weight"] = samples[len(samples) // 2] / len(shards) * 1e6
    shape = tuple(shards[0].shape)
    return {"weights": len(shards), "shape": f"{HOST_SHAPE.hidden_size}x{HOST_SHAPE.hidden_size} and the like "
            f"(local shard {shape[0]}x{shape[1]})", **timings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out/float8_scales.json"))
    parser.add_argument("--no-compile", action="store_true", help="only the cases without per-block compile")
    args = parser.parse_args()
    from torch.distributed.device_mesh import init_device_mesh

    rank = int(os.environ["RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    vocab = (SHAPE if device.type == "cuda" else CPU_SHAPE).vocab_size
    tokens = torch.randint(0, vocab, (4, 129), generator=torch.Generator().manual_seed(1)).to(device)
    cases = []
    for reshard in (True, False):
        for compile_blocks in (False,) if args.no_compile else (False, True):
            parallel = ParallelConfig(strategy="fsdp", precision="bf16", float8="tensorwise",
                                      reshard_after_forward=reshard)
            hooked = train(parallel, mesh, device, compile_blocks=compile_blocks, hook=True, tokens=tokens)
            per_weight = train(parallel, mesh, device, compile_blocks=compile_blocks, hook=False, tokens=tokens)
            cases.append({
                "reshard_after_forward": reshard, "compile": compile_blocks,
                "losses_hook": hooked["losses"], "losses_per_weight": per_weight["losses"],
                "losses_equal": hooked["losses"] == per_weight["losses"],
                "scales_mismatched": hooked["scales_mismatched"],
            })
    host = time_gather_inputs(mesh, device)
    ok = all(case["losses_equal"] and case["scales_mismatched"] == 0 for case in cases)
    if rank == 0:
        print("| reshard_after_forward | compile | losses (hook) | losses bitwise equal | scales not equal |")
        print("|---|---|---|---|---|")
        for case in cases:
            losses = ", ".join(f"{value:.6f}" for value in case["losses_hook"])
            print(f"| {case['reshard_after_forward']} | {case['compile']} | {losses} | "
                  f"{case['losses_equal']} | {case['scales_mismatched']} |")
        print(f"host time of the all-gathers' FP8 inputs, {host['weights']} weights of {host['shape']}: "
              f"torchao's per-weight cast {host['torchao_us_per_weight']:.1f} us a weight, "
              f"the hook's batched casts {host['batched_us_per_weight']:.1f} us a weight")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (FP8 emulated)"
        result = {"ranks": dist.get_world_size(), "device": name, "torch": torch.__version__,
                  "cases": cases, "gather_inputs_host": host, "ok": ok}
        args.out.write_text(json.dumps(result, indent=1))
        print(f"{'ok' if ok else 'FAILED'}; wrote {args.out}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
