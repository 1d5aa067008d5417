"""The one owner of the numerics choices that decide whether two forwards agree bitwise.

Whether the sampler's log-probs equal the trainer's depends on choices that used to be made in
several places: the attention kernel of a packed batch, the SDPA backends, the matmul policy
(TF32), the compute dtype and the generation copy's dtype, the cached attention's kernel and the
sampling rule's kernels. A ``Numerics`` makes all of them. A run builds it once, from
``determinism.mode``, ``model.attention``, ``model.sdpa_backends`` and ``parallel.precision``
(``training.determinism.numerics``), applies its process-wide switches
(``training.determinism.configure``) and hands it to the model (``use_numerics``); the training
forward, the generation copy the sampler runs and the sampler's rule all read that one object.
A model built outside a run (a test, an export check, a frozen reference) carries
``Numerics.for_model(config)``: its model section's kernels, the defaults for the rest.

Every choice is today's, unchanged (docs/determinism.md, "Where numerics are decided"), but for
``determinism.batch_invariant`` (bitwise mode only, off by default): the batch-invariant kernels of
models/batch_invariant.py for every linear, norm, activation, attention (training, prefill and
cached decode alike) and the log-softmax the sampler and the trainer read, and a sampler that computes
what the trainer computes at every precision: the generation copy keeps the trainer's parameter dtype
and the sampler's forwards run under the training forward's autocast (``generation_dtype``,
``sampler_autocast``), so a sampled token's log-prob equals the trainer's bitwise in fp32 and in bf16.
A LoRA model's copy then keeps its adapters unmerged (``merges_adapters``, ``unmerged_dtype``): the
sampler runs the trainer's ``base(x) + scaling * B(A(x))``, not a merged weight, which rounds otherwise.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch
from torch.nn.attention import SDPBackend

from core.exceptions import ConfigError

Kernel = Literal["sdpa", "flex", "exact"]
"""The attention kernel of a packed batch (models/attention.py); exact: models/batch_invariant.py's."""
CachedKernel = Literal["fp32", "sdpa", "exact"]
"""The cached (generation) attention's kernel: explicit fp32 matmuls, SDPA's fused kernel, or the
batch-invariant one (bitwise the training forward's ``exact``)."""

FLEX_BLOCK = 128
"""flex_attention's default block: ``attention=auto`` takes flex for lengths that are multiples of it."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``parallel.precision`` -> the compute dtype."""

# Measured on H200 with torch 2.11: the flash and cuDNN backward are not bitwise repeatable, the
# memory-efficient and math backends are (docs/contracts.md).
_DETERMINISTIC_SDPA = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)

_CHOICES = {
    "mode": ("determinism.mode", ("bitwise", "fast")),
    "attention": ("model.attention", ("auto", "sdpa", "flex")),
    "sdpa_backends": ("model.sdpa_backends", ("deterministic", "all")),
    "precision": ("parallel.precision", tuple(DTYPES)),
}


@dataclass(frozen=True)
class Numerics:
    """Every numerics decision of a run's forwards and of its sampler (module docstring)."""

    mode: Literal["bitwise", "fast"] = "bitwise"
    """determinism.mode: bitwise (repeatable kernels, TF32 off) or fast."""
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    """model.attention: the packed batch's attention kernel (``attention_kernel`` resolves auto)."""
    sdpa_backends: Literal["deterministic", "all"] = "deterministic"
    """model.sdpa_backends: on CUDA, SDPA's memory-efficient and math backends only, or every backend."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """parallel.precision: the compute dtype, and the generation copy's on CUDA outside ``batch_invariant``."""
    batch_invariant: bool = False
    """determinism.batch_invariant: the batch-invariant kernels (models/batch_invariant.py) in every
    forward and in the sampler's log-probs; bitwise mode only."""
    wrapper_casts: bool = False
    """The training forward's parameters are cast by FSDP2's mixed-precision policy (bf16 parameters, no
    autocast: ``training.precision.Precision``'s ``wrapper_casts``); training/builders.py sets it where
    the data-parallel wrapper holds the parameters sharded."""

    def __post_init__(self) -> None:
        for name, (key, allowed) in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {value!r}", key=key)
        if self.batch_invariant and self.mode != "bitwise":
            raise ConfigError("determinism.batch_invariant needs determinism.mode: bitwise, got "
                              f"{self.mode!r}", key="determinism.batch_invariant",
                              hint="set determinism.mode: bitwise, or leave determinism.batch_invariant off")

    @classmethod
    def for_model(cls, config) -> "Numerics":
        """A model's numerics outside a run: its ModelConfig's kernels, bitwise, fp32."""
        return cls(attention=config.attention, sdpa_backends=config.sdpa_backends)

    # ------------------------------------------------------------------ the forward's kernels

    def attention_kernel(self, device: torch.device, seq_len: Optional[int] = None) -> Kernel:
        """The kernel of a packed batch of ``seq_len`` tokens on ``device``: ``auto`` is flex on CUDA
        where the length is whole flex blocks (an H200 with torch 2.11 has no compiled flex kernel for
        a 112-token sequence: inductor's ``NoValidChoicesError``), sdpa otherwise. Under
        ``batch_invariant``: exact (models/batch_invariant.py), whatever ``model.attention`` says."""
        if self.batch_invariant:
            return "exact"
        if self.attention == "auto":
            whole_blocks = seq_len is None or seq_len % FLEX_BLOCK == 0
            return "flex" if device.type == "cuda" and whole_blocks else "sdpa"
        return self.attention

    def sdpa_backends_on(self, device: torch.device) -> Optional[list[SDPBackend]]:
        """The SDPA backends a call on ``device`` is restricted to; None: torch's choice among those enabled."""
        if device.type == "cuda" and self.sdpa_backends == "deterministic":
            return list(_DETERMINISTIC_SDPA)
        return None

    def cached_attention(self, dtype: torch.dtype) -> CachedKernel:
        """The cached attention's kernel for a cache of ``dtype``: a float32 cache (the CPU configs) by
        explicit fp32 matmuls, which the tests compare with the training forward; a bf16/fp16 cache by
        SDPA's fused kernel, which accumulates in fp32 without widening the cache (widening every
        layer's whole cache at every decode step cost more than the matmuls, docs/bench/log.md).
        Under ``batch_invariant``: exact, the training forward's kernel."""
        if self.batch_invariant:
            return "exact"
        return "fp32" if dtype == torch.float32 else "sdpa"

    def kernels(self) -> contextlib.AbstractContextManager:
        """The context a forward runs its blocks and head under: ``batch_invariant.Linears`` (every
        ``F.linear`` and ``F.silu`` batch-invariant, the norms too) under ``batch_invariant``; else
        nothing changes."""
        if not self.batch_invariant:
            return contextlib.nullcontext()
        from models.batch_invariant import Linears

        return Linears()

    # ------------------------------------------------------------------ dtypes

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the forward computes in (autocast or FSDP's mixed precision; fp32: none)."""
        return DTYPES[self.precision]

    @property
    def frozen_base_dtype(self) -> Optional[torch.dtype]:
        """The dtype a LoRA model's frozen base linears are stored in (``models.lora.store_base_as``):
        bf16 for a bf16 run, whose autocast or FSDP policy rounds them to bf16 for every matmul anyway;
        else None (kept as loaded)."""
        return torch.bfloat16 if self.precision == "bf16" else None

    def generation_dtype(self, device: torch.device) -> Optional[torch.dtype]:
        """The generation copy's weights on ``device``: bf16 for a bf16 run on CUDA, else None (the
        parameters' own dtype). Under ``batch_invariant`` None at every precision: the copy keeps the
        trainer's parameters (fp32 master weights) and its forwards run under the training forward's
        autocast (``sampler_autocast``), so that they compute what the trainer computes: a bf16 copy's
        residual stream, norms' inputs, rotary products and KV cache would be bf16 where the trainer's
        are fp32. Where FSDP2's policy casts the trainer's parameters (``parameters_cast``), the copy holds them as
        that policy does: bf16, with no autocast."""
        if self.batch_invariant:
            return self.compute_dtype if self.parameters_cast else None
        return torch.bfloat16 if self.precision == "bf16" and device.type == "cuda" else None

    @property
    def merges_adapters(self) -> bool:
        """Whether the generation copy folds a LoRA model's adapters into its base weights
        (``models.lora.merge_lora``): not under ``batch_invariant``, where the copy keeps them and the
        sampler runs the trainer's unmerged ``base(x) + scaling * B(A(x))`` (the merged
        ``(W + scaling * B @ A) x`` is another computation, whose bits differ in general)."""
        return not self.batch_invariant

    def unmerged_dtype(self, device: torch.device, trained: torch.dtype) -> torch.dtype:
        """The dtype of an unmerged LoRA part (a base linear or an adapter) in the generation copy, given
        the trained part's: its own (a bf16 run's frozen base stored in bf16, ``frozen_base_dtype``;
        fp32 adapters), or the compute dtype where FSDP2's policy casts every parameter
        (``generation_dtype``)."""
        return self.generation_dtype(device) or trained

    @property
    def parameters_cast(self) -> bool:
        """The training forward computes with parameters cast to bf16 by its wrapper (FSDP2's
        mixed-precision policy, which casts bf16 only), not under autocast."""
        return self.wrapper_casts and self.precision == "bf16"

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The training forward's autocast on ``device`` (``training.precision.Precision`` enters it):
        the compute dtype's for bf16 and fp16; none for fp32 or where the wrapper casts the parameters."""
        if self.precision == "fp32" or self.parameters_cast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def sampler_autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The context the sampler's model forwards (prefill, decode, a prompt's media) run under: the
        training forward's ``autocast`` under ``batch_invariant``, over the copy that keeps the trainer's
        parameter dtype (``generation_dtype``; none where FSDP2 casts the parameters, as in training); none
        otherwise (the bf16 copy computes in its own dtype)."""
        if not self.batch_invariant:
            return contextlib.nullcontext()
        return self.autocast(device)

    # ------------------------------------------------------------------ the sampling rule

    @staticmethod
    def sampling_kernels(device: torch.device) -> tuple[Callable, Callable]:
        """(top-p's cut, the draw) on ``device``: the Triton kernels on CUDA with Triton installed, the
        torch references otherwise; both give the same tokens bitwise (models/generation/nucleus.py)."""
        from models.generation import nucleus

        if nucleus.triton_available(device):
            return nucleus.nucleus_cut_cuda, nucleus.draw_kept_cuda
        return nucleus.nucleus_cut, nucleus.draw_kept

    def token_logprobs(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """(logits (..., V), tokens (...)) -> fp32 log softmax(logits)[token]: the sampler's log-probs,
        and the trainer's under ``batch_invariant`` (``batch_invariant.token_logprobs``, the same function
        on both sides); else log_softmax and a gather."""
        if self.batch_invariant:
            from models.batch_invariant import token_logprobs

            return token_logprobs
        return stock_token_logprobs

    # ------------------------------------------------------------------ process-wide switches

    @property
    def allow_tf32(self) -> bool:
        """TF32 matmuls and convolutions: only in fast mode."""
        return self.mode == "fast"

    def apply(self, device: torch.device) -> None:
        """Set torch's process-wide matmul policy and SDPA backends for this mode: TF32 off and, on
        CUDA, the flash and cuDNN attention backends off in bitwise mode (their backward is not
        repeatable); the memory-efficient and math backends always on. Called once per process
        (``training.determinism.configure``)."""
        bitwise = self.mode == "bitwise"
        torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
        torch.backends.cudnn.allow_tf32 = self.allow_tf32
        if device.type == "cuda":
            torch.backends.cuda.enable_flash_sdp(not bitwise)
            torch.backends.cuda.enable_cudnn_sdp(not bitwise)
            torch.backends.cuda.enable_mem_efficient_sdp(True)
            torch.backends.cuda.enable_math_sdp(True)


def stock_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits in fp32)[token] by torch's kernel (the sampler's rule outside ``batch_invariant``)."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
