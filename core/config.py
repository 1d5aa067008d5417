"""Typed, frozen, validated configuration.

A config is a tree of frozen dataclasses, one per section. It is loaded from YAML (a file
may ``extends:`` another, relative to itself), patched by dotted command-line overrides
with YAML-typed values (``train.lr=3e-4``), validated (unknown keys and wrong types name
the key path and the nearest valid key) and hashed over a canonical serialization, so the
same settings spelled differently hash the same.

Each field's one-line docstring is the string literal right below it; ``describe()``
collects them for the README's config reference and for error messages.

The ``objective`` section and model.lora.targets' names are not defined here: the objective
kinds and the model family register them from above (core/objective_kinds.py,
training/registry.py), and the loader builds the section from what is registered.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import hashlib
import inspect
import json
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from core.batch_shape import check_batch_shape
from core.exceptions import ConfigError
from core.objective_kinds import ObjectiveKind, lora_targets, objective_kind, objective_kinds


# --------------------------------------------------------------------------- the registered section
#
# The ``objective`` section is built from the kinds registered in core/objective_kinds.py.


def objective_config_class() -> type:
    """The ``objective`` section's dataclass: ``kind`` (a Literal of the registered names, the
    first one the default) and each kind's settings section, in the order of registration."""
    return _objective_schema(objective_kinds())


@functools.lru_cache(maxsize=None)
def _objective_schema(kinds: tuple[ObjectiveKind, ...]) -> type:
    """One class per set of registered kinds, so configs read under the same registrations are
    of the same class (and compare equal)."""
    names = tuple(k.name for k in kinds)
    fields: list[tuple[str, Any, Any]] = [("kind", Literal[names], field(default=names[0]))]
    docs = {"kind": _kind_doc(kinds)}
    for k in kinds:
        if k.settings is not None:
            fields.append((k.name, k.settings, field(default_factory=k.settings)))
            docs[k.name] = f"objective.kind={k.name}: its settings."
    schema = dataclasses.make_dataclass("ObjectiveConfig", fields, bases=(ObjectiveConfig,), frozen=True)
    schema.__module__, schema.__qualname__ = __name__, "ObjectiveConfig"
    schema.field_docs = docs  # _field_docs reads these: the class has no source of its own
    return schema


def _kind_doc(kinds: tuple[ObjectiveKind, ...]) -> str:
    named = [f"{k.name} ({k.summary})" for k in kinds]
    listed = named[0] if len(named) == 1 else ", ".join(named[:-1]) + " or " + named[-1]
    return f"Training objective: {listed}; docs/architecture.md."


def _objective_from_dict(raw: dict[str, Any]) -> Any:
    return _build(objective_config_class(), raw, "objective.")


def _default_objective() -> Any:
    return objective_config_class()()


def _default_lora_targets() -> tuple[str, ...]:
    return lora_targets()


def _schema_of(tp: Any) -> Any:
    """The registered class behind a placeholder section type (ObjectiveConfig), else ``tp``."""
    return objective_config_class() if tp is ObjectiveConfig else tp


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    """Semantic part of the run ID: <name>-<YYYYMMDD-HHMMSS>-<hash8>; 1-64 of [A-Za-z0-9._-], starting with a letter or digit."""
    root: str = "runs"
    """Directory that holds run directories (relative to the working directory)."""


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 0
    """Rank of every low-rank adapter; 0 turns LoRA off (full fine-tuning). docs/models.md, LoRA."""
    alpha: float = 16.0
    """Adapter scale numerator: the update is B @ A * alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1); masks are keyed by (seed, step, rank, micro-batch, module)."""
    targets: tuple[str, ...] = field(default_factory=_default_lora_targets)
    """Linear layers that get adapters, by module name (q_proj ... down_proj); every block's match is wrapped."""
    init_from: Optional[str] = None
    """PEFT adapter directory (adapter_model.safetensors + adapter_config.json) to start the adapters from."""
    modules_to_save: tuple[str, ...] = ()
    """Extra modules that train in full beside the adapters (e.g. embed_tokens, norm), by module name."""


@dataclass(frozen=True)
class ModelConfig:
    arch: Literal["qwen2", "qwen3"] = "qwen3"
    """Model family: qwen2 (q/k/v bias) or qwen3 (RMSNorm on q and k)."""
    vocab_size: int = 512
    """Vocabulary size; must cover the tokenizer's ids."""
    hidden_size: int = 128
    """Width of the residual stream."""
    intermediate_size: int = 384
    """Hidden width of the SiLU-gated MLP."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); divides num_heads."""
    head_dim: Optional[int] = None
    """Per-head width; None means hidden_size // num_heads."""
    rope_theta: float = 1000000.0
    """RoPE base frequency."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head."""
    qkv_bias: Optional[bool] = None
    """Bias on q/k/v projections; None means the family default (qwen2 yes, qwen3 no)."""
    qk_norm: Optional[bool] = None
    """RMSNorm on q and k per head; None means the family default (qwen3 yes, qwen2 no)."""
    max_position_embeddings: int = 32768
    """Longest position the model is configured for (recorded in exports)."""
    init_std: float = 0.02
    """Standard deviation of the normal init of linear and embedding weights."""
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    """Attention kernel: sdpa (exact, anywhere), flex (compiled, GPU), auto (flex on CUDA at lengths k * 128)."""
    init_from: Optional[str] = None
    """Local Hugging Face directory to start from; its config.json overrides the shape."""
    sdpa_backends: Literal["deterministic", "all"] = "deterministic"
    """CUDA SDPA kernels: deterministic (memory-efficient, math: repeatable backward) or all (adds flash, cuDNN)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters on a frozen base (rank 0: off)."""
    quantize_base: Literal["none", "nf4"] = "none"
    """Frozen base linears in 4-bit NF4 (QLoRA; torchao), dequantized per matmul; needs model.lora.rank > 0."""


@dataclass(frozen=True)
class SourceConfig:
    path: str = ""
    """File, directory or glob of shards."""
    format: Literal["auto", "parquet", "jsonl", "jsonl.zst", "text"] = "auto"
    """Shard format; auto picks by file suffix."""
    weight: float = 1.0
    """Relative sampling weight in a mixture of several sources."""
    text_column: str = "text"
    """Column (parquet) or key (jsonl) that holds the document text."""
    name: Optional[str] = None
    """Name used in provenance and metrics; defaults to the path."""
    text_unit: Literal["file", "line"] = "file"
    """Text format: each file is one document, or each non-blank line is one."""
    record: Literal["text", "chat", "prompt_completion", "prompt", "preference"] = "text"
    """Record kind: text (text_column), chat ({"messages": [...]}), prompt_completion ({"prompt", "completion"}), prompt ({"prompt", "answer"}: GRPO prompts) or preference ({"prompt", "chosen", "rejected"}: DPO pairs)."""


@dataclass(frozen=True)
class AugmentConfig:
    kind: Literal["none", "span_drop", "case_flip"] = "none"
    """Per-document augmentation: none, span_drop (drop a random token span) or case_flip."""
    probability: float = 0.0
    """Probability that a document is augmented."""
    max_fraction: float = 0.1
    """Largest fraction of a document's tokens an augmentation may touch."""


@dataclass(frozen=True)
class DataConfig:
    sources: tuple[SourceConfig, ...] = ()
    """Training inputs; several sources form a deterministic weighted mixture."""
    eval_source: Optional[SourceConfig] = None
    """Held-out source for evaluation (optional)."""
    tokenizer: str = "byte"
    """'byte' (built in) or a local directory / tokenizer.json path (Hugging Face tokenizers)."""
    seq_len: int = 256
    """Length of every packed sequence."""
    num_streams: int = 8
    """Logical streams; every world size that divides it sees the same global batches."""
    workers: int = 2
    """Workers per rank for the expensive stage (a Hugging Face tokenizer); cheap stages run inline."""
    process_pool: bool = True
    """Run the stages that hold the GIL in data.workers worker processes (false: in the threads)."""
    prefetch_batches: int = 4
    """Batches buffered ahead of the trainer."""
    max_in_flight: int = 256
    """Semaphore bound on documents in flight inside the pipeline."""
    on_bad_record: Literal["error", "skip"] = "error"
    """A record that cannot be read or decoded: stop with a DataError, or skip and count it."""
    shuffle_shards: bool = True
    """Permute shard order per epoch from (seed, epoch)."""
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    """Per-document seeded augmentation (off by default)."""
    loss_on: Literal["assistant", "completion", "all"] = "assistant"
    """Chat/prompt-completion records: which tokens carry loss (assistant turns, the completion, or all)."""
    packing: Literal["auto", "split", "whole"] = "auto"
    """split: documents continue across sequences; whole: a sequence holds whole documents, padded (auto: whole for chat records)."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """whole packing: a document longer than seq_len is truncated to it or dropped (both counted)."""
    chat_template: Optional[str] = None
    """A chat template preset (qwen2.5, qwen3, chatml: data/templates/) or a Jinja2 template file, overriding the tokenizer's (default: qwen's is qwen2.5, a directory's its tokenizer_config.json's, else ChatML)."""
    template_clock: Optional[str] = None
    """The fixed instant a chat template's strftime_now reads (ISO 8601, e.g. '2026-01-01T00:00:00'; quote it in YAML); unset: templates that call it are refused."""


@dataclass(frozen=True)
class EvalGenerateConfig:
    source: Optional[SourceConfig] = None
    """Held-out prompt records ({"prompt", "answer"}, record: prompt) decoded and scored at every evaluation; None: off."""
    prompts: int = 128
    """How many of the source's prompts each evaluation decodes (the first ones in the pipeline's order)."""
    max_new_tokens: int = 32
    """Generated tokens per completion at most (fewer where data.seq_len ends first)."""
    samples: int = 0
    """Completions sampled per prompt for sampled pass@1 (metrics generate/sampled_accuracy); 0: greedy only."""
    temperature: float = 1.0
    """Temperature of the sampled completions (> 0; read only when samples > 0)."""


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    """Root seed; every random stream derives from (seed, purpose, step, rank)."""
    max_steps: int = 100
    """Number of optimizer steps."""
    global_batch_size: int = 16
    """Sequences per optimizer step across all ranks."""
    micro_batch_size: int = 4
    """Sequences per forward pass per rank; accumulation steps are derived."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    schedule: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """LR schedule after warmup: cosine, linear, warmup-stable-decay or constant."""
    schedule_steps: Optional[int] = None
    """Length of the LR schedule; None means max_steps."""
    decay_fraction: float = 0.2
    """wsd: fraction of the schedule spent in the final decay."""
    optimizer: Literal["adamw", "muon", "lion", "schedule_free_adamw"] = "adamw"
    """adamw; muon (Muon on hidden matrices, AdamW on the rest); lion; schedule_free_adamw (needs schedule=constant). See docs/optimizers.md."""
    weight_decay: float = 0.1
    """Decoupled weight decay of every optimizer (not applied to norms, biases and embeddings)."""
    beta1: float = 0.9
    """AdamW beta1 (also the AdamW groups of muon, and schedule_free_adamw's interpolation beta)."""
    beta2: float = 0.95
    """AdamW beta2 (also muon's AdamW groups and schedule_free_adamw)."""
    eps: float = 1e-8
    """AdamW epsilon (also muon's AdamW groups and schedule_free_adamw)."""
    muon_momentum: float = 0.95
    """muon: momentum of the hidden matrices' updates."""
    muon_nesterov: bool = True
    """muon: Nesterov momentum."""
    muon_ns_steps: int = 5
    """muon: Newton-Schulz iterations that orthogonalize each update."""
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """muon: LR scale per matrix: match_rms_adamw (0.2*sqrt(max dim); shares AdamW's lr) or original (sqrt(max(1, rows/cols)))."""
    lion_beta1: float = 0.9
    """lion: interpolation beta of the sign update."""
    lion_beta2: float = 0.99
    """lion: momentum beta."""
    sf_weight_lr_power: float = 2.0
    """schedule_free_adamw: the average weights step t by lr_t**power."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    loss_chunk_tokens: int = 8192
    """Tokens per chunk of the fused output projection + loss (no full logits); 0: full logits. Not under TP or xla_spmd."""
    eval_interval: int = 0
    """Evaluate on data.eval_source every N steps; 0 disables."""
    eval_batches: int = 4
    """Global batches per evaluation."""
    eval_generate: EvalGenerateConfig = field(default_factory=EvalGenerateConfig)
    """Held-out generation evaluation at every evaluation step: greedy (and sampled) exact-answer accuracy on prompt records (docs/post_training.md)."""


@dataclass(frozen=True)
class ObjectiveConfig:
    """The ``objective`` section. Its fields come from the registered objective kinds
    (core/objective_kinds.py): ``kind``, then one settings section per kind that has settings,
    in the order of registration. A config holds an ``objective_config_class()``, a subclass;
    it pickles as its plain values and is rebuilt under the receiving process's registrations."""

    def __reduce__(self):
        return _objective_from_dict, (to_dict(self),)


@dataclass(frozen=True)
class ParallelConfig:
    strategy: Literal["none", "ddp", "fsdp", "xla_spmd"] = "ddp"
    """How the model is replicated or sharded across ranks."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision: fp32, bf16 autocast/mixed precision, fp16 with a gradient scaler."""
    compile: bool = False
    """torch.compile each transformer block."""
    compile_mode: Literal["default", "reduce-overhead"] = "default"
    """With compile: reduce-overhead replays each compiled block as a CUDA graph (one launch instead of one per kernel: for steps the host cannot issue fast enough); CUDA, strategies none and ddp."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none, full (every block) or selective (every other)."""
    dp_replicate: int = 1
    """Data-parallel replicate degree (HSDP); 1 means shard across all data-parallel ranks."""
    tp: int = 1
    """Tensor-parallel degree."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (ZeRO-3) instead of keeping them (ZeRO-2)."""
    fsdp_unit_blocks: int = 1
    """FSDP: consecutive transformer blocks per FSDP unit. Each unit is one all-gather, one reduce-scatter and one set of hooks per pass: more blocks per unit cut FSDP's host time (it bounds small models) and hold more gathered parameters at once."""
    cpu_offload: bool = False
    """FSDP: keep parameters and optimizer state in host memory."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process group backend; auto is nccl on CUDA, gloo on CPU."""
    timeout_s: float = 600.0
    """Collective timeout in seconds."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to train on; auto picks cuda when available. Local rank i takes cuda:i; more ranks per node than visible GPUs is an error (exit 2)."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Data-parallel gradient reduction (ddp, fsdp): fp32, or bf16 (half the bytes on the wire; each rank's gradient is divided by the data-parallel size and rounded to bf16 before the sum, then stored back in the gradient's dtype). Needs precision=bf16."""
    ddp_bucket_mb: float = 25.0
    """DDP: gradient bucket size in MiB. Each bucket is one all-reduce, started as soon as its gradients are ready: larger buckets mean fewer, larger collectives and less overlap with the backward."""
    ddp_overlap: bool = True
    """DDP: start each bucket's all-reduce while the backward still runs (true), or reduce all buckets back to back after it (false: the collectives do not share the GPU with the backward's kernels; see docs/parallelism.md)."""
    ddp_embedding_grad: Literal["dense", "gathered"] = "dense"
    """DDP with tied embeddings: the embedding lookup's gradient joins the output head's before the all-reduce (dense: the tied weight's bucket is ready only at the end of the backward, and its all-reduce is not overlapped), or each rank's looked-up rows are all-gathered after the backward and added to the reduced head gradient (gathered: the weight's bucket is reduced first, beside the whole backward). Applies under strategy=ddp on several ranks (no effect elsewhere, so a resume may change strategy); needs model.tie_embeddings=true, a trained embedding and objective.kind causal_lm, sft or distill; see docs/parallelism.md."""
    backward_sm_carveout: int = 0
    """CUDA data parallelism (ddp, fsdp) on several ranks: the backward's cuBLAS matmuls leave this many SMs to the gradient reduction's NCCL kernels running beside them (0: every SM; no effect on one rank). Changes the numbers, deterministically; see docs/parallelism.md."""
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    """FP8 linears via torchao (CUDA sm89+ only; master weights stay fp32): none, tensorwise or rowwise scaling. See docs/parallelism.md."""
    float8_backward_fast_accum: bool = False
    """FP8: the backward's two matmuls (input and weight gradients) accumulate in the tensor cores' faster, less precise mode too, as the forward's always does (torchao's default keeps them precise). 2-4% more tokens/s for Qwen3-1.7B on an H200; see docs/parallelism.md. Needs parallel.float8."""
    float8_head: bool = False
    """The output head in FP8, which parallel.float8 keeps in bf16 (the two keys are independent): its three matmuls (fused with the loss) in FP8 tensorwise, the logits' gradient in e5m2 at a fixed scale, the backward's accumulation always precise (parallel.float8_backward_fast_accum does not apply to it). 2.7% more tokens/s for Qwen3-1.7B on an H200, and its gradients round more (about 3% against fp32, 0.2% in bf16); see docs/parallelism.md. Needs CUDA sm89+ (or the CPU, where torch emulates FP8 matmuls: for tests), objective.kind causal_lm or sft, train.loss_chunk_tokens > 0, parallel.tp=1, and model.vocab_size and model.hidden_size multiples of 16."""


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 50
    """Optimizer steps between checkpoints; 0 disables periodic checkpoints."""
    keep: int = 3
    """Checkpoints retained (oldest deleted first); 0 keeps all."""
    async_save: bool = False
    """Write checkpoints in a background thread; the loop waits only for the staging copy."""
    staging: Literal["auto", "device", "host"] = "auto"
    """Async save copy: device (GPU snapshot, to host off the loop), host (on the loop), auto (device if it fits)."""
    at_end: bool = True
    """Write a checkpoint after the last step."""


@dataclass(frozen=True)
class RuntimeConfig:
    watchdog_timeout_s: float = 300.0
    """Seconds without progress before a rank dumps diagnostics and aborts; 0 disables."""
    watchdog_pause_limit_s: float = 3600.0
    """Longest a paused watchdog (checkpoint writes, compilation) waits before aborting; 0 means no limit."""
    watchdog_exit_grace_s: float = 10.0
    """Seconds a timed-out rank waits after its dump before exiting, so ranks blocked on it can dump too."""
    on_nonfinite: Literal["abort", "skip"] = "abort"
    """Non-finite loss or gradient: abort (exit 7) or skip the update and count it."""
    faults: tuple[str, ...] = ()
    """Injected faults for tests and chaos runs, e.g. 'hang@5:1', 'nan@3', 'sigterm@6'."""
    fault_slow_data_s: float = 2.0
    """Seconds a slow_data fault delays the batch of its step."""
    profile_start_step: int = 0
    """First step of the torch.profiler window; 0 disables profiling."""
    profile_steps: int = 3
    """Steps recorded in the profiler window."""
    strict_env: bool = False
    """Refuse (instead of warn) a resume or replay whose software/hardware environment differs."""
    record_memory_history: bool = False
    """Record CUDA allocation history with stacks, saved in the memory snapshot on out-of-memory."""
    gc_interval: int = 50
    """Python garbage collection at the same steps on every rank, automatic collection off: the youngest generation after every step, the young ones every gc_interval steps, all every 10th time; 0 leaves Python's automatic collection on. See runtime/collection.py."""
    sync_step_end: bool = False
    """Wait for the GPU at every step end, so each step's time holds its own device work (debugging); off, the host prepares the next step while the update runs."""
    deferred_settle: bool = True
    """Read each step's loss, gradient norm and non-finite flags, and write its ledger line and metrics, during the next step, after that step's backward is issued, so the host never waits for the GPU between steps; checkpoint, parameter-hash, evaluation and last steps settle at once. false: every step settles before the next begins. The ledger is the same either way."""


@dataclass(frozen=True)
class DeterminismConfig:
    mode: Literal["bitwise", "fast"] = "bitwise"
    """bitwise: deterministic kernels, identical ledgers; fast: allow non-deterministic kernels."""
    fill_uninitialized_memory: bool = False
    """bitwise only: fill every new tensor with NaN, torch's guard against kernels reading memory nobody wrote (costs host time: ~1% of a 0.5B step, 8% under the profiler)."""


@dataclass(frozen=True)
class MetricsConfig:
    log_interval: int = 1
    """Steps between aggregated metric records and console lines."""
    tensorboard: bool = True
    """Write TensorBoard event files under the run dir."""
    wandb: bool = False
    """Also log to Weights & Biases (only if installed)."""
    wandb_project: str = "lockstep"
    """Weights & Biases project name."""


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    """Run identity."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data pipeline."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimization."""
    objective: ObjectiveConfig = field(default_factory=_default_objective)
    """What the loop optimizes: pretraining or a post-training method."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallelism and precision."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence and retention."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Watchdog, failure policy, faults, profiling."""
    determinism: DeterminismConfig = field(default_factory=DeterminismConfig)
    """Determinism mode."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Metric logging."""

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @property
    def hash(self) -> str:
        return config_hash(self)


# Keys a resumed run may change. A prefix ending in "." admits every key below it.
RESUMABLE_KEYS = (
    "run.root",  # where the run dir lives now (a run moved to another root resumes from there)
    "train.max_steps",
    "train.eval_interval",
    "train.eval_batches",
    "train.eval_generate.",  # an evaluation only: the ledger does not depend on it
    "checkpoint.",
    "runtime.",
    "metrics.",
    "data.workers",
    "data.prefetch_batches",
    "data.max_in_flight",
    "data.process_pool",
    "parallel.strategy",
    "parallel.ddp_embedding_grad",
    "parallel.compile",
    "parallel.compile_mode",
    "parallel.activation_checkpointing",
    "parallel.reshard_after_forward",
    "parallel.fsdp_unit_blocks",
    "parallel.cpu_offload",
    "parallel.backend",
    "parallel.timeout_s",
    "parallel.dp_replicate",
    "parallel.tp",
)


def is_resumable(key: str) -> bool:
    """A key of RESUMABLE_KEYS, or one a registered objective kind lists (ObjectiveKind.resumable)."""
    registered = tuple(f"objective.{kind.name}.{k}" for kind in objective_kinds() for k in kind.resumable)
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_KEYS + registered)


# --------------------------------------------------------------------------- loading


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *, world_size: int | None = None) -> Config:
    """Load, override, validate and freeze a config. Raises ConfigError (exit 2). ``world_size``
    adds the constraints between the batch, the streams and that many ranks (core/batch_shape.py)."""
    raw: dict[str, Any] = _read_yaml_tree(Path(path), seen=()) if path is not None else {}
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
    _tokenizer_from_init(raw)
    config = from_dict(raw)
    validate(config, world_size)
    return config


def _tokenizer_from_init(raw: dict[str, Any]) -> None:
    """A model fine-tuned ``model.init_from`` a Hugging Face directory uses that directory's
    tokenizer (and so its chat template) unless ``data.tokenizer`` is set: the resolved config
    then names the directory, so the run records what it used."""
    model, data = raw.get("model"), raw.get("data")
    init_from = model.get("init_from") if isinstance(model, dict) else None
    if not isinstance(init_from, str) or (isinstance(data, dict) and "tokenizer" in data):
        return
    if (Path(init_from) / "tokenizer.json").is_file():
        raw.setdefault("data", {})["tokenizer"] = init_from


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a Config from a plain nested dict (e.g. a run dir's config.yaml)."""
    return _build(Config, raw, "")


def parse_override(item: str) -> tuple[str, Any]:
    """``a.b=value`` -> ("a.b", YAML-typed value)."""
    if "=" not in item:
        raise ConfigError(
            f"override {item!r} is not of the form key.path=value",
            hint="write overrides like train.lr=3e-4",
        )
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key", hint="write key.path=value")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override value for {key} is not valid YAML: {exc}", key=key) from exc
    return key, value


def _read_yaml_tree(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(
            f"config file {str(path)!r} does not exist",
            file=str(path),
            hint="pass an existing YAML file to --config, e.g. configs/tiny.yaml",
        )
    resolved = path.resolve()
    if resolved in seen:
        chain = " -> ".join(str(p) for p in (*seen, resolved))
        raise ConfigError(f"extends: cycle {chain}", file=str(path), hint="remove the cycle")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}", file=str(path)) from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping at top level", file=str(path))
    parent_name = raw.pop("extends", None)
    if parent_name is None:
        return raw
    parent = _read_yaml_tree((path.parent / str(parent_name)), seen=(*seen, resolved))
    return _deep_merge(parent, raw)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(
                f"cannot set {key}: {'.'.join(parts[: i + 1])} is not a section", key=key
            )
        node = child
    node[parts[-1]] = value


# --------------------------------------------------------------------------- typed build


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _nearest(name: str, options: list[str]) -> str | None:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return match[0] if match else None


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{prefix.rstrip('.') or 'config'} must be a mapping, got {type(raw).__name__}",
            key=prefix.rstrip(".") or None,
            hint=f"expected the keys {', '.join(_field_names(cls))}",
        )
    hints = typing.get_type_hints(cls)
    names = _field_names(cls)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if key not in names:
            near = _nearest(str(key), names)
            raise ConfigError(
                f"unknown key {path!r}",
                key=path,
                hint=(f"did you mean {prefix}{near!s}?" if near else f"valid keys: {', '.join(names)}"),
            )
        kwargs[key] = _coerce(hints[key], value, path)
    return cls(**kwargs)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union:
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _value_hint(path: str, value: Any) -> str | None:
    """The hint for a value users put under the wrong key: an objective.kind value that a registered
    kind names as something of its own (ObjectiveKind.kind_hints)."""
    if path != "objective.kind":
        return None
    hints = {wrong: hint for kind in objective_kinds() for wrong, hint in kind.kind_hints}
    return hints.get(str(value).lower())


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path)
    if origin is Literal:
        options = typing.get_args(tp)
        if value not in options:
            near = _nearest(str(value), [str(o) for o in options])
            raise ConfigError(
                f"{path} must be one of {_type_name(tp)}, got {value!r}",
                key=path,
                hint=_value_hint(path, value)
                or (f"did you mean {near!r}?" if near else "pick one of the listed values"),
            )
        return value
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        if isinstance(value, (str, dict)) or not isinstance(value, (list, tuple)):
            value = [value]
        return tuple(_coerce(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return _build(_schema_of(tp), value, f"{path}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:  # YAML 1.1 reads "3e-4" as a string; accept it as the float it spells
                parsed = float(value)
            except ValueError:
                parsed = None
            if parsed is not None and math.isfinite(parsed):
                return parsed
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(
        f"{path} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})",
        key=path,
        hint=f"set {path} to a value of type {_type_name(tp)}",
    )


# --------------------------------------------------------------------------- validation


def validate(config: Config, world_size: int | None = None) -> None:
    """Cross-field checks, then the objective kind's own (``ObjectiveKind.validate``).
    ``world_size`` adds the batch-divisibility checks (every violated one in one error:
    core/batch_shape.py). The model's shape rules live with the
    model (``models.qwen.dims``); train.py asks them early too."""
    d, t, p = config.data, config.train, config.parallel
    kind = objective_kind(config.objective.kind)
    validate_run_name(config.run.name)
    _validate_numbers(config)
    _positive("train.max_steps", t.max_steps)
    _positive("train.global_batch_size", t.global_batch_size)
    _positive("train.micro_batch_size", t.micro_batch_size)
    _positive("data.seq_len", d.seq_len)
    _positive("data.num_streams", d.num_streams)
    _positive("data.max_in_flight", d.max_in_flight)
    if d.workers < 0:
        raise ConfigError("data.workers must be >= 0", key="data.workers")
    if t.loss_chunk_tokens < 0:
        raise ConfigError("train.loss_chunk_tokens must be >= 0 (0: full logits)", key="train.loss_chunk_tokens")
    check_batch_shape(config, world_size)
    for i, source in enumerate(d.sources):
        if not source.path:
            raise ConfigError(f"data.sources[{i}].path is empty", key=f"data.sources[{i}].path")
        if not math.isfinite(source.weight) or source.weight <= 0:
            raise ConfigError(
                f"data.sources[{i}].weight must be a finite number > 0, got {source.weight}",
                key=f"data.sources[{i}].weight",
            )
    if config.checkpoint.interval < 0 or config.checkpoint.keep < 0:
        raise ConfigError("checkpoint.interval and checkpoint.keep must be >= 0", key="checkpoint")
    if p.tp < 1 or p.dp_replicate < 1:
        raise ConfigError("parallel.tp and parallel.dp_replicate must be >= 1", key="parallel")
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
    _validate_optimizer(t)
    _validate_float8(p)
    _validate_float8_head(config)
    _validate_lora(config)
    if kind.validate is not None:
        kind.validate(config)
    _validate_eval_generate(config)


def _validate_eval_generate(config: Config) -> None:
    """train.eval_generate.* (docs/post_training.md, held-out generation): a prompt source and sane sizes."""
    e, key = config.train.eval_generate, "train.eval_generate"
    if e.source is None:
        return
    if e.source.record != "prompt":
        raise ConfigError(f"{key}.source must hold prompt records, got record: {e.source.record}",
                          key=f"{key}.source.record",
                          hint='records {"prompt": ..., "answer": ...}; e.g. datasets/tasks/rl/eval with record: prompt')
    checks = (
        ("prompts", e.prompts >= 1, ">= 1"),
        ("max_new_tokens", e.max_new_tokens >= 1, ">= 1"),
        ("samples", e.samples >= 0, ">= 0 (0: greedy only)"),
        ("temperature", math.isfinite(e.temperature) and e.temperature > 0, "> 0"),
    )
    for name, ok, expected in checks:
        if not ok:
            raise ConfigError(f"{key}.{name} must be {expected}, got {getattr(e, name)!r}", key=f"{key}.{name}")


def _validate_lora(config: Config) -> None:
    """model.lora and model.quantize_base on their own and against parallel.* (docs/models.md, LoRA)."""
    lora, quantize = config.model.lora, config.model.quantize_base
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank must be >= 0 (0: off), got {lora.rank}", key="model.lora.rank")
    if lora.rank == 0:
        needs_adapters = {
            "model.lora.init_from": lora.init_from is not None,
            "model.lora.modules_to_save": bool(lora.modules_to_save),
            "model.quantize_base": quantize != "none",
        }
        for key, is_set in needs_adapters.items():
            if is_set:
                raise ConfigError(
                    f"{key} is set but model.lora.rank is 0 (LoRA off)",
                    key="model.lora.rank",
                    hint=f"set model.lora.rank > 0 (e.g. 16) to train adapters, or unset {key}",
                )
        return
    if lora.alpha <= 0:
        raise ConfigError(f"model.lora.alpha must be > 0, got {lora.alpha}", key="model.lora.alpha")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}", key="model.lora.dropout")
    valid = lora_targets()
    if not lora.targets:
        raise ConfigError("model.lora.targets is empty", key="model.lora.targets", hint=f"valid: {', '.join(valid)}")
    for name in lora.targets:
        if name not in valid:
            near = _nearest(name, list(valid))
            raise ConfigError(
                f"model.lora.targets names {name!r}, which is no linear layer of the model's blocks",
                key="model.lora.targets",
                hint=(f"did you mean {near!r}? " if near else "") + f"valid: {', '.join(valid)}",
            )
    if len(set(lora.targets)) != len(lora.targets):
        raise ConfigError(f"model.lora.targets lists a name twice: {list(lora.targets)}", key="model.lora.targets")
    p = config.parallel
    if p.strategy == "xla_spmd":
        raise ConfigError(
            "model.lora is not supported with parallel.strategy=xla_spmd",
            key="parallel.strategy",
            hint="use none, ddp or fsdp for adapter training",
        )
    if p.float8 != "none":
        raise ConfigError(
            f"model.lora with parallel.float8={p.float8} is not supported: FP8 would convert the frozen base "
            "and the rank-sized adapter matmuls, a combination that is untested",
            key="parallel.float8",
            hint="set parallel.float8=none for adapter training",
        )
    if quantize == "nf4" and p.tp > 1:
        raise ConfigError(
            "model.quantize_base=nf4 cannot be tensor-parallel (parallel.tp > 1): NF4 weights are not DTensor-shardable",
            key="model.quantize_base",
            hint="set parallel.tp=1 (FSDP or DDP shard/replicate NF4 bases), or quantize_base=none",
        )


def validate_world(config: Config, world_size: int) -> None:
    """Checks that need the world size (run before any process group is created): every
    violated constraint between the batch, the streams and the ranks in one ConfigError."""
    check_batch_shape(config, world_size)


def _validate_optimizer(t: TrainConfig) -> None:
    if t.optimizer == "schedule_free_adamw" and t.schedule != "constant":
        raise ConfigError(
            f"train.optimizer=schedule_free_adamw averages its iterates instead of decaying the LR; "
            f"train.schedule={t.schedule} would decay it as well",
            key="train.schedule",
            hint="set train.schedule=constant (train.warmup_steps still applies)",
        )
    if not 1 <= t.muon_ns_steps < 100:
        raise ConfigError(f"train.muon_ns_steps must lie in [1, 100), got {t.muon_ns_steps}", key="train.muon_ns_steps")
    for key, value in (("muon_momentum", t.muon_momentum), ("lion_beta1", t.lion_beta1), ("lion_beta2", t.lion_beta2)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"train.{key} must lie in [0, 1), got {value}", key=f"train.{key}")
    if t.optimizer == "schedule_free_adamw" and not 0.0 < t.beta1 < 1.0:
        raise ConfigError(f"train.beta1 must lie in (0, 1) for schedule_free_adamw, got {t.beta1}", key="train.beta1")


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
            "train.loss_chunk_tokens=0 computes the full logits through a bf16 lm_head",
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


RUN_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def validate_run_name(name: str) -> None:
    """run.name becomes a directory name under run.root and the start of ``--resume ID``:
    1-64 characters of ``[A-Za-z0-9._-]`` starting with a letter or digit (no separators,
    no ``..`` component, nothing that reads as an option)."""
    if not isinstance(name, str) or RUN_NAME_PATTERN.fullmatch(name) is None:
        raise ConfigError(
            f"run.name={name!r} is not a valid run name",
            key="run.name",
            hint="use 1-64 characters of letters, digits, '.', '_' and '-', starting with a letter or digit",
        )


def _validate_numbers(config: Config) -> None:
    """Values whose wrong sign or non-finite value would only fail (or silently misbehave) later."""
    t = config.train
    if not math.isfinite(t.lr) or t.lr < 0:
        raise ConfigError(f"train.lr must be a finite number >= 0, got {t.lr}", key="train.lr")
    if t.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps must be >= 0, got {t.warmup_steps}", key="train.warmup_steps")
    if not math.isfinite(t.min_lr_ratio) or not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio must lie in [0, 1], got {t.min_lr_ratio}", key="train.min_lr_ratio")
    _positive("model.vocab_size", config.model.vocab_size)
    if config.runtime.gc_interval < 0:
        raise ConfigError(
            f"runtime.gc_interval must be >= 0, got {config.runtime.gc_interval}",
            key="runtime.gc_interval",
            hint="0 leaves Python's automatic garbage collection on",
        )


def _positive(key: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value}", key=key)


# --------------------------------------------------------------------------- serialization


def to_dict(config: Any) -> Any:
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    return config


def canonical_json(config: Config) -> str:
    """Sorted keys, no whitespace, floats in repr form: equal settings give equal text."""
    return json.dumps(to_dict(config), sort_keys=True, separators=(",", ":"))


# Keys added after runs and configs existed: while one holds its default it is left out of the
# hashed text, so every earlier config keeps its hash (and its runs their IDs); set, it is hashed.
# ``section.list[].key`` names a key of every entry of a list (compared with the default entry's).
# An objective kind lists its own such keys (ObjectiveKind.hashed_only_when_set), and a kind
# registered after the registry existed has its whole section treated so (hash_default_section).
HASHED_ONLY_WHEN_SET = ("train.eval_generate", "data.template_clock")


def _hashed_only_when_set() -> list[str]:
    """Core's keys and the registered kinds', deepest first: a key inside a section is compared
    (and dropped) before the section is."""
    keys = list(HASHED_ONLY_WHEN_SET)
    for kind in objective_kinds():
        if kind.settings is not None:
            keys += [f"objective.{kind.name}.{k}" for k in kind.hashed_only_when_set]
            if not kind.hash_default_section:
                keys.append(f"objective.{kind.name}")
    return sorted(keys, key=lambda k: -k.count("."))


def config_hash(config: Config) -> str:
    tree, defaults = to_dict(config), to_dict(Config())
    for key in _hashed_only_when_set():
        *parents, leaf = key.split(".")
        nodes, default = [tree], defaults
        for part in parents:
            if part.endswith("[]"):  # every entry of a list, against the default list's first entry
                nodes, default = [entry for node in nodes for entry in node[part[:-2]]], default[part[:-2]][0]
            else:
                nodes, default = [node[part] for node in nodes], default[part]
        for node in nodes:
            if leaf in node and node[leaf] == default[leaf]:
                del node[leaf]
        # The default drops it too: a section compared later (a kind's, hashed only when set)
        # still equals its default when this key was the only one at its default.
        default.pop(leaf, None)
    return hashlib.sha256(json.dumps(tree, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=True)


def save(config: Config, path: str | Path) -> None:
    Path(path).write_text(to_yaml(config))


def diff(a: Config, b: Config) -> list[tuple[str, Any, Any]]:
    """Every leaf key whose value differs: (dotted key, a's value, b's value)."""
    out: list[tuple[str, Any, Any]] = []
    _diff(to_dict(a), to_dict(b), "", out)
    return out


def diff_resolved(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``diff`` of two resolved configs as plain nested dicts (a config.yaml, meta.json's record)."""
    out: list[tuple[str, Any, Any]] = []
    _diff(a, b, "", out)
    return out


def _diff(a: Any, b: Any, prefix: str, out: list) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            _diff(a.get(key), b.get(key), f"{prefix}{key}.", out)
    elif a != b:
        out.append((prefix.rstrip("."), a, b))


# --------------------------------------------------------------------------- docs


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every leaf field, from the field docstrings. A list of
    sections (``data.sources``) and an optional section (``data.eval_source``) get a row of
    their own and then one per field of an item: ``data.sources[i].path``, ``data.eval_source.path``."""
    docs = _field_docs(cls)
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        tp = _schema_of(hints[f.name])
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((f"{prefix}{f.name}", _type_name(tp), repr(to_dict(default)), docs.get(f.name, "")))
        item = _section_inside(tp)
        if item is not None:
            index = "[i]" if typing.get_origin(tp) is tuple else ""
            rows.extend(describe(item, f"{prefix}{f.name}{index}."))
    return rows


def _section_inside(tp: Any) -> type | None:
    """The dataclass of a ``tuple[Section, ...]`` or ``Optional[Section]`` field, else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis]
    if typing.get_origin(tp) in (tuple, Union) and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _field_docs(cls: type) -> dict[str, str]:
    if "field_docs" in vars(cls):  # a section built from registrations (objective_config_class)
        return dict(cls.field_docs)
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
            if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = nxt.value.value
    return docs
