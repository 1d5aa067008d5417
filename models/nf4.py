"""Frozen 4-bit NF4 linears for QLoRA, on torchao's ``NF4Tensor``.

``quantize_base(model)`` replaces every linear inside the transformer blocks (the frozen
base of a LoRA model: plain projections and each adapter's ``base_layer``) by an
``NF4Linear``. Embeddings, norms and the output head stay as they are, as in QLoRA.

The format is torchao's NF4 with double quantization: blocks of 64 weights share one
absmax scale, and the scales are themselves quantized to int8 in blocks of 256. So a
weight must have a multiple of 64 x 256 = 16384 elements; every Qwen projection from
0.5B up has. Quantization is a pure function of the weight's values and dtype (no
randomness, no data-dependent kernel choice): the same base gives the same NF4 bytes,
which ``nf4_bytes`` exposes for identity hashes and tests.

The forward dequantizes the weight to the input's dtype for each matmul (torchao's
``linear_nf4``), so the NF4 bytes are all that stays resident; the backward needs only
the input gradient (the weight is frozen) and dequantizes again.

Under torch.compile (per-block compile, distributed/compile.py) the dequantization is
traced into the block's graph as ordinary ops, and AOTAutograd's min-cut partitioner kept
its output, a full-width weight, for the backward's matmul: a compiled QLoRA block saved as
many weight bytes as a LoRA block with a bf16 base. So while compiling, the forward runs
``linear_nf4`` inside a non-reentrant ``torch.utils.checkpoint``: the partitioner must
recompute what the region computes, and saves only those of its inputs the backward needs,
the NF4 bytes (resident anyway; the input is not needed, the weight being frozen). Inside a
checkpointed block the region nests in the block's checkpoint. The backward then
dequantizes again, as the eager one does. Eager forwards call ``linear_nf4`` directly,
which saves the NF4 weight itself (tests/models/test_nf4_memory.py).

torchao is imported on first use only: models that do not quantize never load it.
"""

from __future__ import annotations

import os

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.config import ModelConfig
from core.exceptions import ConfigError
from models.qwen.dims import resolve_dims

BLOCK_SIZE = 64
"""Weights per absmax scale."""
SCALER_BLOCK_SIZE = 256
"""Scales per block of the second (int8) quantization of the scales."""


def _torchao_nf4() -> Any:
    """torchao's NF4 module (its path moved in torchao 0.15; both layouts are accepted)."""
    if not torch.cuda.is_available():
        # torchao's only native libraries are CUDA kernels (cutlass sm90a, mxfp8): without CUDA
        # their loads fail, and on CPU test machines a process crashed now and then right after
        # those failed loads (glibc: "malloc(): unaligned tcache chunk"). NF4 needs neither.
        os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        try:
            from torchao.dtypes import nf4tensor as nf4_tensor
        except ImportError as exc:
            raise ConfigError(
                "model.quantize_base=nf4 needs torchao, which is not importable here",
                key="model.quantize_base",
                hint="pip install torchao (declared in pyproject), or set model.quantize_base=none",
            ) from exc
    return nf4_tensor


class NF4Linear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is held in NF4 and dequantized per matmul."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, name: str) -> "NF4Linear":
        """Quantize ``linear``'s weight (in its current dtype); ``name`` is used in errors."""
        weight = linear.weight.detach()
        if weight.numel() % (BLOCK_SIZE * SCALER_BLOCK_SIZE):
            raise ConfigError(
                f"{name} has {tuple(weight.shape)} weights, not a multiple of {BLOCK_SIZE * SCALER_BLOCK_SIZE} "
                "(NF4 blocks of 64 weights, scales in blocks of 256)",
                key="model.quantize_base",
                hint="quantize a larger model or set model.quantize_base=none",
            )
        quantized = _torchao_nf4().to_nf4(weight.contiguous(), BLOCK_SIZE, SCALER_BLOCK_SIZE)
        return cls(quantized, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear_nf4 = _torchao_nf4().linear_nf4
        if torch.compiler.is_compiling():
            # Traced, the dequantization is an ordinary op of the block's graph, and the
            # partitioner would keep its output (the full-width weight) for the backward's
            # matmul; checkpointed, it must recompute it there from the NF4 bytes instead.
            out = checkpoint(linear_nf4, x, self.weight, use_reentrant=False, preserve_rng_state=False)
        else:
            out = linear_nf4(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as the forward sees it, in the dtype it was quantized from."""
        return self.weight.get_original_weight()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nf4"


def check_nf4_layout(config: ModelConfig, *, shards: int = 1) -> None:
    """ConfigError (key ``model.quantize_base``) naming the first block linear that NF4 cannot hold.

    Every weight must fill whole scale blocks (a multiple of 64 x 256 elements), and under
    FSDP2 with ``shards`` data-parallel shards each weight's scale blocks must split evenly
    (torchao shards an NF4 weight by its blocks). Needs only the config, so it can run
    before any process group exists (with ``init_from``: on the config read from config.json).
    """
    dims = resolve_dims(config)
    block = BLOCK_SIZE * SCALER_BLOCK_SIZE
    shapes = {
        "self_attn.q_proj": (dims.q_width, dims.hidden_size),
        "self_attn.k_proj": (dims.kv_width, dims.hidden_size),
        "self_attn.v_proj": (dims.kv_width, dims.hidden_size),
        "self_attn.o_proj": (dims.hidden_size, dims.q_width),
        "mlp.gate_proj": (dims.intermediate_size, dims.hidden_size),
        "mlp.up_proj": (dims.intermediate_size, dims.hidden_size),
        "mlp.down_proj": (dims.hidden_size, dims.intermediate_size),
    }
    for name, (rows, columns) in shapes.items():
        if (rows * columns) % (block * shards):
            where = f" over {shards} FSDP shards" if shards > 1 and (rows * columns) % block == 0 else ""
            raise ConfigError(
                f"layers.*.{name} has {rows} x {columns} weights, which NF4 cannot split into whole blocks of "
                f"{block}{where} (64-weight blocks, scales in blocks of 256)",
                key="model.quantize_base",
                hint="use model.quantize_base=none, or another data-parallel size / strategy (ddp replicates)"
                if where
                else "use model.quantize_base=none for this shape",
            )


def is_nf4(tensor: torch.Tensor) -> bool:
    """True for a torchao NF4Tensor (without importing torchao when nothing is quantized)."""
    return type(tensor).__name__ == "NF4Tensor"


def nf4_bytes(weight: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors that make up an NF4 weight, named, in a fixed order (identity hashes, tests)."""
    return [
        ("quantized_data", weight.quantized_data),
        ("quantized_scalers", weight.quantized_scalers),
        ("quantization_factor", weight.quantization_factor),
        ("scaler_mean", weight.scaler_mean),
    ]


def quantize_base(model: nn.Module) -> list[str]:
    """Replace every linear inside ``model.layers`` by an NF4Linear, in place; returns their names.

    Adapters (``lora_A`` / ``lora_B``) are never quantized. Call after loading the base
    weights and after ``models.lora.apply_lora`` (which wraps the plain linears), before
    moving to the device and before parallelize.
    """
    quantized = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if not name.startswith("layers.") or not isinstance(module, nn.Linear) or leaf in ("lora_A", "lora_B"):
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        setattr(parent, leaf, NF4Linear.from_linear(module, name=name))
        quantized.append(name)
    return quantized
