"""Build the parts a Trainer is made of, each from its config section.

Order matters in one place: the determinism switches are set before the model is built, so
initialization and the first kernels already run under them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Any, Callable

import torch
from torch import nn

import models
from core import seeding
from core.config import Config, ParallelConfig
from core.distributed_context import DistributedContext
from core.logging import EventLog, get_logger
from core.objective_kinds import record_fields
from core.run_context import RunContext
from data.pipeline import build as build_pipeline
from distributed import parallelize, unwrap
from distributed.ddp import gather_embedding_grad
from distributed.fsdp import is_fully_sharded
from distributed.overlap import check_carveout
from distributed.topology import build_mesh
from experiments.tracking import MetricsTracker
from models.flops import flops_per_token
from models.lora import add_adapters
from models.lora import base_identity as start_identity
from models.numerics import Numerics
from training import determinism
from training.record import ledger as ledger_lib
from training.guards import Guards
from training.plan import ParallelPlan


def _gathered_embedding_grad(config: Config, model: nn.Module, topology):
    """``parallel.ddp_embedding_grad=gathered`` where it applies: DDP over several ranks with a
    whole, trained, tied embedding (distributed/ddp.py). Logs which way the rows travel."""
    if config.parallel.ddp_embedding_grad != "gathered" or config.parallel.strategy != "ddp" or topology.dp_size == 1:
        return None
    rows_per_rank = config.train.global_batch_size // topology.dp_size
    gathered = gather_embedding_grad(model, topology.dp_mesh.get_group(), max_tokens=rows_per_rank * config.data.seq_len)
    if gathered is None:
        get_logger().warning("parallel.ddp_embedding_grad=gathered has no effect: the embedding weight is not a whole, "
                             "trained weight shared with the output head here (tensor parallel, frozen or untied)")
        return None
    how = ("is all-gathered as rows" if gathered.gathers
           else "is summed and all-reduced dense, as gathering it would send more")
    get_logger().info("parallel.ddp_embedding_grad=gathered: the embedding lookup's gradient %s (%.1f MB a step; the "
                      "dense all-reduce: %.1f MB)", how, gathered.gathered_bytes / 1e6, gathered.dense_bytes / 1e6)
    return gathered


def eager_under_batch_invariance(parallel: ParallelConfig, numerics: Numerics) -> ParallelConfig:
    """``parallel`` with ``compile`` off under ``determinism.batch_invariant``: dynamo traces a block
    without the batch-invariant function mode (models/batch_invariant.py ``Linears``), so a compiled
    block ran the stock kernels and the first sampled step stopped with exit 5 (a CPU run of
    tests/configs/e2e-grpo.yaml: 2 of 12 tokens differed; Qwen3-0.6B's recipe on an H200: 128 of 128).
    The sampler runs eagerly there for the same reason."""
    if not (parallel.compile and numerics.batch_invariant):
        return parallel
    get_logger().info("parallel.compile: the blocks run eagerly under determinism.batch_invariant "
                      "(the compiler would replace its kernels)")
    return dataclasses.replace(parallel, compile=False)


def build_model(config: Config, dist: DistributedContext) -> tuple[nn.Module, ParallelPlan]:
    numerics = determinism.numerics(config)  # the run's one: the training forward's and the sampler's
    determinism.configure(numerics, dist.device, fill_uninitialized_memory=config.determinism.fill_uninitialized_memory)
    model = models.build(config.model, generator=seeding.generator(config.train.seed, "model_init"))
    model.use_numerics(numerics)
    base_identity = None
    if config.model.lora.rank > 0:  # adapters on the plain model, before parallelize (models/lora.py)
        base_identity = add_adapters(model, config.model, seed=config.train.seed, base_dtype=numerics.frozen_base_dtype)
    elif any(not p.requires_grad for p in model.parameters()):
        # Parts built frozen (a vision tower under model.<family>.tower: frozen) are not checkpointed: a
        # resume rebuilds them from the run's start, so the start is recorded and checked as a LoRA base is.
        base_identity = {"path": config.model.init_from or "init:seed", "sha256": start_identity(model)}
    topology = build_mesh(config.parallel, dist)
    if config.parallel.strategy == "xla_spmd":
        from training import xla  # needs torch_xla, which only the XLA interpreter has

        model, plan = xla.setup(model, config, topology)
    else:
        model = parallelize(model, eager_under_batch_invariance(config.parallel, numerics), dist, topology,
                            cast_parameters=config.parallel.fsdp_cast_parameters)
        reduces_beside_backward = topology.dp_size > 1 and config.parallel.strategy in ("ddp", "fsdp")
        carveout = config.parallel.backward_sm_carveout if reduces_beside_backward else 0
        check_carveout(carveout, dist.device)
        gathered = _gathered_embedding_grad(config, model, topology)
        plan = ParallelPlan(
            topology=topology,
            strategy=config.parallel.strategy,
            device=dist.device,
            fsdp_applied=is_fully_sharded(model),
            base_identity=base_identity,
            backward_sm_carveout=carveout,
            after_backward=gathered.add_to_grad if gathered is not None else None,
        )
        if plan.fsdp_applied and config.parallel.fsdp_cast_parameters:
            # FSDP2's policy casts the parameters, not autocast: the sampler's copy follows
            unwrap(model).use_numerics(dataclasses.replace(numerics, wrapper_casts=True))
    get_logger().info(
        "model: %s, %.2fM parameters (%.2fM trained), strategy %s, dp %d x tp %d",
        config.model.arch,
        sum(p.numel() for p in model.parameters()) / 1e6,
        sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6,
        config.parallel.strategy,
        topology.dp_size,
        topology.tp_size,
    )
    return model, plan


def build_data(config: Config, plan: ParallelPlan) -> tuple[Any, Callable[[], Any] | None]:
    """The training pipeline for this data-parallel rank, and a factory for evaluation."""

    def pipeline(split: str):
        return build_pipeline(
            config.data,
            seed=config.train.seed,
            global_batch_size=config.train.global_batch_size,
            rank=plan.dp_rank,
            world_size=plan.dp_size,
            split=split,
            record_fields=record_fields(config),
        )

    eval_factory = (lambda: pipeline("eval")) if config.data.eval_source is not None else None
    return pipeline("train"), eval_factory


def build_tracker(config: Config, run: RunContext, dist: DistributedContext, model: nn.Module, *, replaying: bool):
    # The model's own config: with model.init_from the shape comes from the HF directory.
    fpt = flops_per_token(unwrap(model).config, config.data.seq_len, include_embedding_head=False)
    return MetricsTracker(
        config.metrics,
        dist=dist.host,  # the metric table is host numbers: never wait for the GPU to reduce it
        run_dir=run.run_dir if not replaying else None,
        total_steps=config.train.max_steps,
        flops_per_token=fpt,
        peak_flops=_peak_flops(dist.device),
    )


def build_guards(config: Config, run: RunContext, dist: DistributedContext, events: EventLog, *, data,
                 replaying: bool = False) -> Guards:
    def last_ledger_line():
        lines = ledger_lib.read(run.paths.ledger)
        return lines[-1] if lines else None

    return Guards(
        config,
        dist=dist,
        diagnostics_dir=run.diagnostics_dir,  # a replay's own directory, never the replayed run's
        trace_dir=run.output_dir / "artifacts" / "traces",
        providers={
            "data_pipeline": data.stats,
            "last_ledger_line": last_ledger_line,
            "recent_events": lambda: list(events.recent),
        },
        on_abort=lambda info: events.emit("watchdog_abort", **info),
        replaying=replaying,
    )


def close_all(parts: list, run: RunContext | None, dist: DistributedContext | None) -> None:
    """Close pipelines (joins their threads), sinks and guards; release the lock; end the group.

    The group ends only after the last module holding it (a DDP reducer keeps its own
    reference) is collected: left to interpreter shutdown, a gloo worker thread that drops
    a tensor then cannot take the GIL, and the process aborts ("terminate called without an
    active exception") after a run that succeeded.
    """
    for part in parts:
        with contextlib.suppress(Exception):
            part.close()
    parts.clear()
    if run is not None:
        run.release()
    if dist is not None:
        gc.collect()  # modules in reference cycles, and a failed step's traceback frames
        dist.close()


def _peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the accelerator, for MFU; None where unknown (CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in (("H200", 989e12), ("H100", 989e12), ("A100", 312e12)):
        if key in name:
            return peak
    return None
