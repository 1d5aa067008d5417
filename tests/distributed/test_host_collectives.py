"""Host collectives: numbers the host needs at once are reduced over gloo on CPU tensors, so
the loop never waits for the GPU's queue to learn them (docs/runtime.md). On NCCL runs they
go over the context's separate gloo group; here, on 2 real processes, over both kinds."""

from __future__ import annotations

import torch

from tests.distributed.dist_harness import run_on_ranks


def _reduce_on_host(separate_group: bool):
    import torch.distributed as dist

    from core.config import MetricsConfig, ParallelConfig
    from core.distributed_context import DistributedContext
    from experiments.tracking import MetricsTracker

    with DistributedContext.from_env(ParallelConfig(device="cpu", backend="gloo")) as ctx:
        if separate_group:  # what an NCCL context holds: a gloo group beside the default one
            ctx._object_group = dist.new_group(backend="gloo")
        value = float(ctx.rank + 1)
        out = {op: float(ctx.host_all_reduce(torch.tensor([value], dtype=torch.float64), op)[0])
               for op in ("sum", "max", "min", "avg")}
        host = ctx.host
        out["host"] = (host.rank, host.world_size, str(host.device))
        tracker = MetricsTracker(MetricsConfig(log_interval=2, tensorboard=False), dist=host, run_dir=None,
                                 total_steps=2, flops_per_token=None, peak_flops=None, sinks=[])
        tracker.log(1, {"loss": value, "step_time": 0.1 * (ctx.rank + 1), "tokens": 10.0})
        record = tracker.log(2, {"loss": value + 2, "step_time": 0.1, "tokens": 10.0})
        out["loss"] = (record.metrics["loss"].mean, record.metrics["loss"].min, record.metrics["loss"].max)
        out["slowest"] = record.slowest_rank
        return out


def test_host_all_reduce_and_the_metric_table_over_gloo():
    for separate_group in (False, True):
        results = run_on_ranks(_reduce_on_host, 2, separate_group)
        for rank, out in enumerate(results):
            assert (out["sum"], out["max"], out["min"], out["avg"]) == (3.0, 2.0, 1.0, 1.5)
            assert out["host"] == (rank, 2, "cpu")
            # rank 0 logged 1 and 3 (mean 2), rank 1 logged 2 and 4 (mean 3)
            assert out["loss"] == (2.5, 2.0, 3.0) and out["slowest"] == 1
