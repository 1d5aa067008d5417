"""DDP's gradient reduction options (distributed/ddp.py) on 2 spawned gloo ranks.

``parallel.reduce_dtype=bf16``: every bucket is divided by the group size, rounded to bf16,
summed, and written back in fp32. The result must be exactly that arithmetic on the two
ranks' local gradients (each rank recomputes both without DDP), whatever the bucket size
(``parallel.ddp_bucket_mb``, tiny here: several buckets). fp32 (the default) gives the mean.
``parallel.ddp_overlap=false`` reduces the same buckets after the backward: fp32 gradients
identical to the overlapped reduction's, bf16 the same documented arithmetic.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import torch
from torch import nn

from core.config import ParallelConfig
from tests import launch


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 + rank))


def _local_grads(world: int) -> list[list[torch.Tensor]]:
    grads = []
    for rank in range(world):
        model = _model()
        model(_batch(rank)).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
        torch.set_num_threads(1)
        from torch.distributed.device_mesh import init_device_mesh

        from core.distributed_context import DistributedContext
        from distributed.ddp import apply_ddp

        local = _local_grads(world)
        result = {}
        base = ParallelConfig(device="cpu", backend="gloo", timeout_s=60, precision="bf16", ddp_bucket_mb=0.004)
        with DistributedContext.from_env(base):
            mesh = init_device_mesh("cpu", (world,))
            overlapped: list[torch.Tensor] = []
            for reduce_dtype, overlap in (("fp32", True), ("bf16", True), ("fp32", False), ("bf16", False)):
                parallel = ParallelConfig(**{**base.__dict__, "reduce_dtype": reduce_dtype, "ddp_overlap": overlap})
                name = reduce_dtype if overlap else f"{reduce_dtype}/after_backward"
                ddp = apply_ddp(_model(), mesh, torch.device("cpu"), parallel)
                for _ in range(3):  # DDP rebuilds its buckets by ddp_bucket_mb after the first iterations
                    ddp.zero_grad(set_to_none=False)
                    ddp(_batch(rank)).square().sum().backward()
                checks = []
                for i, param in enumerate(ddp.module.parameters()):
                    if reduce_dtype == "bf16":
                        want = sum(g[i].to(torch.bfloat16).div_(world) for g in local).to(torch.float32)
                        checks.append(torch.equal(param.grad, want))
                    else:
                        want = sum(g[i] for g in local) / world
                        checks.append(bool(torch.allclose(param.grad, want, rtol=1e-6, atol=1e-7)))
                        if overlap:
                            overlapped.append(param.grad.clone())
                        else:
                            checks.append(torch.equal(param.grad, overlapped[i]))
                    checks.append(param.grad.dtype == torch.float32)
                result[name] = checks
                result[f"{name}/buckets"] = len(ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        Path(out_dir, f"rank{rank}_error.txt").write_text(traceback.format_exc())
        raise


def test_reduction_options_are_the_documented_arithmetic_over_several_buckets(tmp_path):
    for result in launch.spawn_json_ranks(_worker, tmp_path, timeout=120):
        for name in ("fp32", "bf16", "fp32/after_backward", "bf16/after_backward"):
            assert result[name] and all(result[name]), (name, result)
            assert result[f"{name}/buckets"] > 1, name  # the small ddp_bucket_mb took effect
