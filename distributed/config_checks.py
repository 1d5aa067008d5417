"""The checks of parallel.* on a loaded config, registered with core.config's loader
(core/config_checks.py, training/registry.py): what the config alone rules out. The GPU, torchao
and the model's plan are checked where the model is built (distributed.float8.require_float8,
distributed.model_structure: parallel.ep > 1 on a model without experts). Torch-free: the
launcher checks a config before torch is imported.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from core.config_errors import check_independent, raise_together
from core.exceptions import ConfigError
from core.objective_kinds import objective_kind, objective_kinds

if TYPE_CHECKING:
    from core.config import Config, ParallelConfig


def validate_parallel(config: Config) -> None:
    """parallel.* on its own and against the model and the objective (before the optimizer's checks):
    every violated constraint (core/config_errors.py)."""
    check_independent(config, (_check_parallel_keys, _check_gathered_embedding_grad, _check_compile_mode,
                               _check_compile_mode_objective))


def _check_parallel_keys(config: Config) -> None:
    """The keys of parallel.* that need no other section, each on its own."""
    p, found = config.parallel, []
    if p.tp < 1 or p.dp_replicate < 1:
        found.append(ConfigError("parallel.tp and parallel.dp_replicate must be >= 1", key="parallel"))
    if p.ep < 1:
        found.append(ConfigError(f"parallel.ep must be >= 1, got {p.ep}", key="parallel.ep",
                                 hint="1 keeps every expert on every rank (no expert parallelism)"))
    if p.fsdp_unit_blocks < 1:
        found.append(ConfigError(
            f"parallel.fsdp_unit_blocks must be >= 1, got {p.fsdp_unit_blocks}",
            key="parallel.fsdp_unit_blocks",
            hint="1 shards every transformer block on its own",
        ))
    if p.reduce_dtype != "fp32" and (p.precision != "bf16" or p.strategy not in ("ddp", "fsdp")):
        found.append(ConfigError(
            f"parallel.reduce_dtype={p.reduce_dtype} needs parallel.precision=bf16 and strategy ddp or fsdp "
            f"(got precision={p.precision}, strategy={p.strategy})",
            key="parallel.reduce_dtype",
            hint="set parallel.reduce_dtype=fp32, or train in bf16 with data parallelism",
        ))
    if not p.fsdp_cast_parameters and (p.precision != "bf16" or p.strategy != "fsdp"):
        found.append(ConfigError(
            f"parallel.fsdp_cast_parameters=false needs parallel.strategy=fsdp and precision=bf16 (got "
            f"strategy={p.strategy}, precision={p.precision}): elsewhere no parameter is cast",
            key="parallel.fsdp_cast_parameters",
            hint="leave parallel.fsdp_cast_parameters at true, or train in bf16 under fsdp",
        ))
    if not math.isfinite(p.ddp_bucket_mb) or p.ddp_bucket_mb <= 0:
        found.append(ConfigError(
            f"parallel.ddp_bucket_mb must be a finite number > 0, got {p.ddp_bucket_mb}",
            key="parallel.ddp_bucket_mb",
            hint="25 is DDP's default",
        ))
    if not 0 <= p.backward_sm_carveout <= 128:
        found.append(ConfigError(
            f"parallel.backward_sm_carveout must be between 0 and 128 SMs, got {p.backward_sm_carveout}",
            key="parallel.backward_sm_carveout",
            hint="0 turns it off; NCCL's kernels hold about 16-32 SMs of a Hopper card",
        ))
    if not p.ddp_overlap and p.strategy != "ddp":
        found.append(ConfigError(
            f"parallel.ddp_overlap=false applies to strategy ddp only (got strategy={p.strategy})",
            key="parallel.ddp_overlap",
            hint="remove parallel.ddp_overlap, or set parallel.strategy=ddp",
        ))
    raise_together(found)


def _check_compile_mode(config: Config) -> None:
    p = config.parallel
    if p.compile_mode != "default" and (not p.compile or p.device == "cpu" or p.strategy in ("fsdp", "xla_spmd")):
        raise ConfigError(
            f"parallel.compile_mode={p.compile_mode} needs parallel.compile=true on CUDA with strategy none or "
            f"ddp (got compile={p.compile}, device={p.device}, strategy={p.strategy})",
            key="parallel.compile_mode",
            hint="CUDA graphs need fixed parameter addresses; FSDP gathers its parameters anew every step",
        )


def _check_compile_mode_objective(config: Config) -> None:
    kind = objective_kind(config.objective.kind)
    if config.parallel.compile_mode != "default" and not kind.capabilities.cuda_graph_safe:
        raise ConfigError(
            f"parallel.compile_mode={config.parallel.compile_mode} does not suit objective.kind={kind.name}: its "
            "forwards run the policy's blocks at shapes that change within a step (e.g. a new length every decoding "
            "step), and each shape would capture new CUDA graphs",
            key="parallel.compile_mode",
            hint=f"use parallel.compile_mode=default with objective.kind={kind.name}",
        )


def validate_float8(config: Config) -> None:
    """parallel.float8* (after the optimizer's checks): every violated constraint."""
    check_independent(config, (lambda view: _validate_float8(view.parallel), _validate_float8_head))


def _check_gathered_embedding_grad(config: Config) -> None:
    """parallel.ddp_embedding_grad=gathered (distributed/ddp.py, GatheredEmbeddingGrad): each of what
    it needs of the model and the objective. Under strategies other than ddp it has no effect, so a
    DDP run's checkpoint resumes under them."""
    if config.parallel.ddp_embedding_grad == "gathered":
        check_independent(config, (_gathered_needs_tied, _gathered_needs_trained, _gathered_needs_bounded_tokens))


_GATHERED = "parallel.ddp_embedding_grad"
_GATHERED_HINT = "remove parallel.ddp_embedding_grad (dense is the default)"


def _gathered_needs_tied(config: Config) -> None:
    if not config.model.tie_embeddings:
        raise ConfigError(f"{_GATHERED}=gathered applies to tied embeddings; model.tie_embeddings is false",
                          key=_GATHERED,
                          hint=_GATHERED_HINT + ": an untied embedding's gradient has no head part to reduce early")


def _gathered_needs_trained(config: Config) -> None:
    if config.model.lora.rank > 0:
        raise ConfigError(f"{_GATHERED}=gathered needs a trained embedding; with model.lora.rank > 0 it is frozen",
                          key=_GATHERED, hint=_GATHERED_HINT)


def _gathered_needs_bounded_tokens(config: Config) -> None:
    if not objective_kind(config.objective.kind).capabilities.bounded_tokens:
        bounded = [k.name for k in objective_kinds() if k.capabilities.bounded_tokens]
        raise ConfigError(
            f"{_GATHERED}=gathered needs at most (rows per rank x data.seq_len) tokens a step per rank, which "
            f"objective.kind={config.objective.kind} does not bound (it supports {', '.join(bounded)})",
            key=_GATHERED,
            hint=_GATHERED_HINT,
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
    found = []
    if p.device == "cpu" or p.strategy == "xla_spmd":
        where = "parallel.device=cpu" if p.device == "cpu" else "parallel.strategy=xla_spmd"
        found.append(ConfigError(
            f"parallel.float8={p.float8} needs CUDA GPUs with FP8 tensor cores (sm89+: L4, L40, H100, H200, B200); "
            f"{where} has none",
            key="parallel.float8",
            hint="set parallel.float8=none, or train on such GPUs with torchao installed (pip install torchao)",
        ))
    if p.precision != "bf16":
        found.append(ConfigError(
            f"parallel.float8={p.float8} runs its matmuls in FP8 around bf16 activations; "
            f"parallel.precision={p.precision} is not bf16",
            key="parallel.precision",
            hint="set parallel.precision=bf16 with parallel.float8",
        ))
    if p.tp > 1:
        found.append(ConfigError(
            f"parallel.float8={p.float8} with parallel.tp={p.tp} is not supported: the tensor-parallel plan "
            "shards plain linears, not FP8 ones",
            key="parallel.float8",
            hint="use parallel.tp=1 (FSDP or DDP) with FP8",
        ))
    raise_together(found)


def _validate_float8_head(config: Config) -> None:
    """parallel.float8_head: the fused head of the next-token objectives in FP8 (on its own or
    beside parallel.float8's block linears), each of what it needs of the layout, the objective, the
    loss and the model. The device is checked where the model is built
    (distributed.float8.require_float8_head)."""
    if config.parallel.float8_head:
        check_independent(config, (_head_layout, _head_objective, _head_loss_chunks, _head_shapes))


_HEAD = "parallel.float8_head"


def _head_layout(config: Config) -> None:
    p = config.parallel
    if p.strategy == "xla_spmd" or p.tp > 1:
        where = "parallel.strategy=xla_spmd" if p.strategy == "xla_spmd" else f"parallel.tp={p.tp}"
        raise ConfigError(
            f"parallel.float8_head=true needs the output weight whole inside the forward; {where} keeps it "
            "sharded or lazy, and the head is not fused there",
            key=_HEAD,
            hint="use parallel.tp=1 with strategy none, ddp or fsdp, or leave parallel.float8_head=false",
        )


def _head_objective(config: Config) -> None:
    if not objective_kind(config.objective.kind).capabilities.fused_head:
        fused = [k.name for k in objective_kinds() if k.capabilities.fused_head]
        raise ConfigError(
            f"parallel.float8_head=true applies to the fused cross-entropy head of objective.kind {' and '.join(fused)}; "
            f"objective.kind={config.objective.kind} computes its head otherwise",
            key=_HEAD,
            hint="leave parallel.float8_head=false for this objective",
        )


def _head_loss_chunks(config: Config) -> None:
    if config.train.loss_chunk_tokens == 0:
        raise ConfigError(
            "parallel.float8_head=true needs the fused head (train.loss_chunk_tokens > 0); "
            "train.loss_chunk_tokens=0 computes the full logits through a bf16 output head",
            key=_HEAD,
            hint="set train.loss_chunk_tokens (default 8192), or leave parallel.float8_head=false",
        )


def _head_shapes(config: Config) -> None:
    sizes = {name: getattr(config.model, name) for name in ("vocab_size", "hidden_size")}
    raise_together([ConfigError(
        f"parallel.float8_head=true needs model.{name} to be a multiple of 16 (FP8 matmul shapes); got {value}",
        key=f"model.{name}",
        hint="leave parallel.float8_head=false for this model",
    ) for name, value in sizes.items() if value % 16])
