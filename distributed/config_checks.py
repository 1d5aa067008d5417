"""The checks of parallel.* on a loaded config, registered with core.config's loader
(core/config_checks.py, training/registry.py): what the config alone rules out. The GPU, torchao
and the model's plan are checked where the model is built (distributed.float8.require_float8,
distributed.model_structure: parallel.ep > 1 on a model without experts). Torch-free: the
launcher checks a config before torch is imported.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from core.exceptions import ConfigError
from core.objective_kinds import objective_kind, objective_kinds

if TYPE_CHECKING:
    from core.config import Config, ParallelConfig


def validate_parallel(config: Config) -> None:
    """parallel.* on its own and against the model and the objective (before the optimizer's checks)."""
    p = config.parallel
    kind = objective_kind(config.objective.kind)
    if p.tp < 1 or p.dp_replicate < 1:
        raise ConfigError("parallel.tp and parallel.dp_replicate must be >= 1", key="parallel")
    if p.ep < 1:
        raise ConfigError(f"parallel.ep must be >= 1, got {p.ep}", key="parallel.ep",
                          hint="1 keeps every expert on every rank (no expert parallelism)")
    if p.fsdp_unit_blocks < 1:
        raise ConfigError(
            f"parallel.fsdp_unit_blocks must be >= 1, got {p.fsdp_unit_blocks}",
            key="parallel.fsdp_unit_blocks",
            hint="1 shards every transformer block on its own",
        )
    if p.reduce_dtype != "fp32" and (p.precision != "bf16" or p.strategy not in ("ddp", "fsdp")):
        raise ConfigError(
            f"parallel.reduce_dtype={p.reduce_dtype} needs parallel.precision=bf16 and strategy ddp or fsdp "
            f"(got precision={p.precision}, strategy={p.strategy})",
            key="parallel.reduce_dtype",
            hint="set parallel.reduce_dtype=fp32, or train in bf16 with data parallelism",
        )
    if not math.isfinite(p.ddp_bucket_mb) or p.ddp_bucket_mb <= 0:
        raise ConfigError(
            f"parallel.ddp_bucket_mb must be a finite number > 0, got {p.ddp_bucket_mb}",
            key="parallel.ddp_bucket_mb",
            hint="25 is DDP's default",
        )
    if not 0 <= p.backward_sm_carveout <= 128:
        raise ConfigError(
            f"parallel.backward_sm_carveout must be between 0 and 128 SMs, got {p.backward_sm_carveout}",
            key="parallel.backward_sm_carveout",
            hint="0 turns it off; NCCL's kernels hold about 16-32 SMs of a Hopper card",
        )
    if not p.ddp_overlap and p.strategy != "ddp":
        raise ConfigError(
            f"parallel.ddp_overlap=false applies to strategy ddp only (got strategy={p.strategy})",
            key="parallel.ddp_overlap",
            hint="remove parallel.ddp_overlap, or set parallel.strategy=ddp",
        )
    if p.ddp_embedding_grad == "gathered":
        _validate_gathered_embedding_grad(config)
    if p.compile_mode != "default" and (not p.compile or p.device == "cpu" or p.strategy in ("fsdp", "xla_spmd")):
        raise ConfigError(
            f"parallel.compile_mode={p.compile_mode} needs parallel.compile=true on CUDA with strategy none or "
            f"ddp (got compile={p.compile}, device={p.device}, strategy={p.strategy})",
            key="parallel.compile_mode",
            hint="CUDA graphs need fixed parameter addresses; FSDP gathers its parameters anew every step",
        )
    if p.compile_mode != "default" and not kind.capabilities.cuda_graph_safe:
        raise ConfigError(
            f"parallel.compile_mode={p.compile_mode} does not suit objective.kind={kind.name}: its forwards run the "
            "policy's blocks at shapes that change within a step (e.g. a new length every decoding step), and "
            "each shape would capture new CUDA graphs",
            key="parallel.compile_mode",
            hint=f"use parallel.compile_mode=default with objective.kind={kind.name}",
        )


def validate_float8(config: Config) -> None:
    """parallel.float8* (after the optimizer's checks)."""
    _validate_float8(config.parallel)
    _validate_float8_head(config)


def _validate_gathered_embedding_grad(config: Config) -> None:
    """parallel.ddp_embedding_grad=gathered (distributed/ddp.py, GatheredEmbeddingGrad). Under
    strategies other than ddp it has no effect, so a DDP run's checkpoint resumes under them."""
    key = "parallel.ddp_embedding_grad"
    hint = "remove parallel.ddp_embedding_grad (dense is the default)"
    if not config.model.tie_embeddings:
        raise ConfigError(f"{key}=gathered applies to tied embeddings; model.tie_embeddings is false", key=key,
                          hint=hint + ": an untied embedding's gradient has no head part to reduce early")
    if config.model.lora.rank > 0:
        raise ConfigError(f"{key}=gathered needs a trained embedding; with model.lora.rank > 0 it is frozen",
                          key=key, hint=hint)
    if not objective_kind(config.objective.kind).capabilities.bounded_tokens:
        bounded = [k.name for k in objective_kinds() if k.capabilities.bounded_tokens]
        raise ConfigError(
            f"{key}=gathered needs at most (rows per rank x data.seq_len) tokens a step per rank, which "
            f"objective.kind={config.objective.kind} does not bound (it supports {', '.join(bounded)})",
            key=key,
            hint=hint,
        )


def _validate_float8(p: ParallelConfig) -> None:
    """What the config alone rules out; the GPU and torchao are checked where the model is
    built (distributed.float8.require_float8)."""
    if p.float8 == "none":
        if p.float8_backward_fast_accum:
            raise ConfigError(
                "parallel.float8_backward_fast_accum=true has no FP8 matmuls to apply to: parallel.float8=none",
                key="parallel.float8_backward_fast_accum",
                hint="set parallel.float8=tensorwise (or rowwise), or leave parallel.float8_backward_fast_accum=false",
            )
        return
    if p.device == "cpu" or p.strategy == "xla_spmd":
        where = "parallel.device=cpu" if p.device == "cpu" else "parallel.strategy=xla_spmd"
        raise ConfigError(
            f"parallel.float8={p.float8} needs CUDA GPUs with FP8 tensor cores (sm89+: L4, L40, H100, H200, B200); "
            f"{where} has none",
            key="parallel.float8",
            hint="set parallel.float8=none, or train on such GPUs with torchao installed (pip install torchao)",
        )
    if p.precision != "bf16":
        raise ConfigError(
            f"parallel.float8={p.float8} runs its matmuls in FP8 around bf16 activations; "
            f"parallel.precision={p.precision} is not bf16",
            key="parallel.precision",
            hint="set parallel.precision=bf16 with parallel.float8",
        )
    if p.tp > 1:
        raise ConfigError(
            f"parallel.float8={p.float8} with parallel.tp={p.tp} is not supported: the tensor-parallel plan "
            "shards plain linears, not FP8 ones",
            key="parallel.float8",
            hint="use parallel.tp=1 (FSDP or DDP) with FP8",
        )


def _validate_float8_head(config: Config) -> None:
    """parallel.float8_head: the fused head of the next-token objectives in FP8 (on its own or
    beside parallel.float8's block linears). The device is checked where the model is built
    (distributed.float8.require_float8_head)."""
    if not config.parallel.float8_head:
        return
    key = "parallel.float8_head"
    p = config.parallel
    if p.strategy == "xla_spmd" or p.tp > 1:
        where = "parallel.strategy=xla_spmd" if p.strategy == "xla_spmd" else f"parallel.tp={p.tp}"
        raise ConfigError(
            f"parallel.float8_head=true needs the output weight whole inside the forward; {where} keeps it "
            "sharded or lazy, and the head is not fused there",
            key=key,
            hint="use parallel.tp=1 with strategy none, ddp or fsdp, or leave parallel.float8_head=false",
        )
    if not objective_kind(config.objective.kind).capabilities.fused_head:
        fused = [k.name for k in objective_kinds() if k.capabilities.fused_head]
        raise ConfigError(
            f"parallel.float8_head=true applies to the fused cross-entropy head of objective.kind {' and '.join(fused)}; "
            f"objective.kind={config.objective.kind} computes its head otherwise",
            key=key,
            hint="leave parallel.float8_head=false for this objective",
        )
    if config.train.loss_chunk_tokens == 0:
        raise ConfigError(
            "parallel.float8_head=true needs the fused head (train.loss_chunk_tokens > 0); "
            "train.loss_chunk_tokens=0 computes the full logits through a bf16 output head",
            key=key,
            hint="set train.loss_chunk_tokens (default 8192), or leave parallel.float8_head=false",
        )
    for name in ("vocab_size", "hidden_size"):
        value = getattr(config.model, name)
        if value % 16:
            raise ConfigError(
                f"parallel.float8_head=true needs model.{name} to be a multiple of 16 (FP8 matmul shapes); got {value}",
                key=f"model.{name}",
                hint="leave parallel.float8_head=false for this model",
            )
