"""The config sections below the run's own: model (with LoRA), data (sources, augmentation),
parallelism, determinism and metrics.

core/config.py builds a Config of these and re-exports them (``from core.config import ModelConfig``
keeps working); their checks live with the layer that reads them (models/config_checks.py,
distributed/config_checks.py), registered from above (core/config_checks.py). Each field's one-line
docstring is the string literal right below it (core.config.describe, docs/config.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NewType, Optional

from core.model_families import default_lora_targets
from core.record_kinds import RecordKindName

ModelArch = NewType("ModelArch", str)
"""model.arch's type: the name of a registered model family (core/model_families.py); the loader
refuses any other name and lists the registered ones."""


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 0
    """Rank of every low-rank adapter; 0 turns LoRA off (full fine-tuning). docs/models.md, LoRA."""
    alpha: float = 16.0
    """Adapter scale numerator: the update is B @ A * alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1); masks are keyed by (seed, step, rank, micro-batch, module)."""
    targets: tuple[str, ...] = field(default_factory=default_lora_targets)
    """Linear layers that get adapters, by module name (q_proj ... down_proj); every block's match is wrapped."""
    init_from: Optional[str] = None
    """PEFT adapter directory (adapter_model.safetensors + adapter_config.json) to start the adapters from."""
    modules_to_save: tuple[str, ...] = ()
    """Extra modules that train in full beside the adapters (e.g. embed_tokens, norm), by module name."""


@dataclass(frozen=True)
class ModelConfig:
    arch: ModelArch = "qwen3"
    """Model family, a registered row (core/model_families.py; docs/models.md lists them): qwen2 (q/k/v bias), qwen3 (RMSNorm on q and k), qwen3_moe, qwen2_5_vl, qwen3_vl."""
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
    record: RecordKindName = "text"
    """Record kind: text (text_column), chat ({"messages": [...]}), prompt_completion ({"prompt", "completion"}), prompt ({"prompt", "answer"}: GRPO prompts), preference ({"prompt", "chosen", "rejected"}: DPO pairs), image_chat ({"messages", "images"}: images in user turns) or image_prompt ({"prompt", "answer", "images"}: GRPO prompts with images)."""


@dataclass(frozen=True)
class AugmentConfig:
    kind: Literal["none", "span_drop", "case_flip"] = "none"
    """Per-document augmentation: none, span_drop (drop a random token span) or case_flip."""
    probability: float = 0.0
    """Probability that a document is augmented."""
    max_fraction: float = 0.1
    """Largest fraction of a document's tokens an augmentation may touch."""


@dataclass(frozen=True)
class ImagesConfig:
    min_pixels: int = 56 * 56
    """Smallest resized area (height x width) of an image; smaller images are scaled up to it."""
    max_pixels: int = 28 * 28 * 1280
    """Largest resized area (height x width) of an image; larger images are scaled down to it."""
    max_image_pixels: int = 64 * 1024 * 1024
    """Largest decoded image (width x height, before resizing); a larger one is a bad record."""
    patch_size: int = 14
    """Side of a vision patch in pixels: the vision tower's."""
    temporal_patch_size: int = 2
    """Frames per patch (a still image is repeated): the vision tower's."""
    merge_size: int = 2
    """Patches merged into one image token per side: the vision tower's spatial merge."""
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    """Per-channel (RGB) mean subtracted after rescaling to [0, 1] (OpenAI CLIP's; Qwen3-VL's processor: 0.5)."""
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    """Per-channel (RGB) standard deviation divided by after the mean (OpenAI CLIP's; Qwen3-VL's processor: 0.5)."""


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
    template_thinking: Optional[bool] = None
    """The chat template's enable_thinking variable (false: Qwen3's template renders an empty think block into the generation prompt, so the model answers directly); unset: the template's default. Refused with a template that never reads enable_thinking."""
    images: ImagesConfig = field(default_factory=ImagesConfig)
    """How the images of image records (image_chat) are resized and cut into patches (data/vision; defaults: Qwen2.5-VL's processor)."""


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
    ep: int = 1
    """Expert-parallel degree: data-parallel ranks that split each block's experts (strategy fsdp; world size divisible by dp_replicate x tp x ep; a model without experts refuses ep > 1)."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (ZeRO-3) instead of keeping them (ZeRO-2)."""
    fsdp_unit_blocks: int = 1
    """FSDP: consecutive transformer blocks per FSDP unit. Each unit is one all-gather, one reduce-scatter and one set of hooks per pass: more blocks per unit cut FSDP's host time (it bounds small models) and hold more gathered parameters at once."""
    cpu_offload: bool = False
    """FSDP: keep parameters and optimizer state in host memory."""
    fsdp_cast_parameters: bool = True
    """FSDP with precision bf16 on several ranks: all-gather the parameters cast to bf16 and compute with them (true), or all-gather the fp32 parameters and compute under bf16 autocast, as one process computes (false): then every batch a trained model computes (PPO's old log-probs and values, the sampler's copy under determinism.batch_invariant) is the same on any number of GPUs, and a checkpoint resumed on another GPU count keeps its batches; the price is fp32 gathers (twice the bytes) and fp32 activations between the matmuls. Needs strategy fsdp and precision bf16; see docs/parallelism.md."""
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
class DeterminismConfig:
    mode: Literal["bitwise", "fast"] = "bitwise"
    """bitwise: deterministic kernels, identical ledgers; fast: allow non-deterministic kernels."""
    fill_uninitialized_memory: bool = False
    """bitwise only: fill every new tensor with NaN, torch's guard against kernels reading memory nobody wrote (costs host time: ~1% of a 0.5B step, 8% under the profiler)."""
    batch_invariant: bool = False
    """bitwise only: batch-invariant kernels (models/batch_invariant.py) in the training forward and the sampler, so every sampled token's log-prob equals the trainer's bitwise (logprob_parity 0.0); slower."""


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
