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

Under torch.compile (per-block compile, distributed/compile.py) the NF4 linear reads the
NF4Tensor's plain inner tensors and dequantizes them with torchao's formula on plain tensors
(``dequantize_parts``: bit for bit torchao's ``weight.to(dtype)`` in eager, tested), inside a
nested non-reentrant checkpoint, then ``F.linear``. Inductor fuses the dequantization into
one kernel, and the checkpoint makes AOTAutograd recompute the weight for the backward
instead of saving it. History, each measured on Qwen3-1.7B on an H200 with block
checkpointing: traced as torchao's tensor subclass, the ops desugared from it lost the
block's recompute tags on torch 2.11, so every checkpointed block kept its NF4 linears'
weights and matmul outputs (13.68 GiB peak against LoRA's 10.62); an opaque custom op
running torchao's eager code fixed the memory (8.67 GiB) but its dozen launches per linear
per pass made a step 4.6x slower than LoRA's, and compiling the dequantization inside the op
still 2.4x. On plain tensors the tags reach every op (tests/models/test_nf4_memory.py counts
the bytes a compiled block saves, with and without block checkpointing). Compiled values are
not eager's bit for bit (inductor fuses the dequantization; a compiled run is bitwise with
itself, across kill/resume and replay, as every compiled run is). Eager forwards call
``linear_nf4`` directly, which saves the NF4 weight itself. A weight that is not a whole
NF4Tensor (a DTensor: FSDP2 gathers NF4 weights before the forward, so only a sharded
forward would see one) keeps ``linear_nf4`` under compile too.

torchao is imported on first use only: models that do not quantize never load it.
"""

from __future__ import annotations

import os

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from core.config import ModelConfig
from core.exceptions import ConfigError
from core.model_families import model_family
from core.registration import import_attr

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
        if torch.compiler.is_compiling() and _compiled_path(self.weight):
            return _compiled_linear_nf4(x, self.weight, self.bias)  # see "Under torch.compile" above
        out = _torchao_nf4().linear_nf4(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as the forward sees it, in the dtype it was quantized from."""
        return self.weight.get_original_weight()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nf4"


# --------------------------------------------------------------------------- compiled path


def _compiled_path(weight: torch.Tensor) -> bool:
    """True for an NF4Tensor whose parts the compiled forward can read (not a sharded DTensor)."""
    return is_nf4(weight) and weight.dim() == 2 and weight.is_contiguous()


def _compiled_linear_nf4(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear_nf4(x, weight) + bias.to(out.dtype)`` on the weight's plain parts, the weight
    dequantized to the dtype the matmul runs in (autocast's, else x's) and recomputed for the
    backward, never saved."""
    device_type = x.device.type
    dtype = x.dtype
    if torch.is_autocast_enabled(device_type) and x.is_floating_point() and x.dtype != torch.float64:
        dtype = torch.get_autocast_dtype(device_type)
    dequantized = checkpoint(dequantize_parts, *_nf4_parts(weight), dtype, use_reentrant=False)
    out = F.linear(x, dequantized)
    return out if bias is None else out + bias.to(out.dtype)


def _nf4_parts(weight: torch.Tensor) -> tuple:
    """The NF4Tensor's inner tensors and layout, in ``dequantize_parts``' argument order."""
    return (
        weight.quantized_data, weight.quantized_scalers, weight.quantization_factor, weight.scaler_mean, weight.nf4,
        weight.block_size, weight.scaler_block_size, list(weight.shape), weight.dtype,
    )


def dequantize_parts(
    quantized_data: torch.Tensor, quantized_scalers: torch.Tensor, quantization_factor: torch.Tensor,
    scaler_mean: torch.Tensor, nf4: torch.Tensor, block_size: int, scaler_block_size: int, shape: list[int],
    weight_dtype: torch.dtype, dtype: torch.dtype,
) -> torch.Tensor:
    """``weight.to(dtype)`` of the contiguous NF4Tensor with these parts, on plain tensors.

    The operations of torchao's ``NF4Tensor.get_original_weight`` in its order: unpack two
    4-bit codes per byte, look them up in the NF4 table, multiply by the block's scale (the
    int8 scale divided by its block's factor, cast to the weight's dtype, plus the mean),
    interleave; then the cast."""
    codes_high = nf4[(quantized_data >> 4).to(torch.long)]
    codes_low = nf4[(quantized_data & 0b1111).to(torch.long)]
    scalers = quantized_scalers.view(-1, scaler_block_size) / quantization_factor.unsqueeze(-1)
    scalers = scalers.flatten().to(weight_dtype) + scaler_mean
    repeated = scalers.unsqueeze(-1).expand(scalers.size(0), block_size // 2).flatten()
    weight = torch.stack([codes_high * repeated, codes_low * repeated], dim=-1).reshape(shape)
    return weight.to(dtype)


def check_nf4_layout(config: ModelConfig, *, shards: int = 1) -> None:
    """ConfigError (key ``model.quantize_base``) naming the first block linear that NF4 cannot hold.

    Every weight must fill whole scale blocks (a multiple of 64 x 256 elements), and under
    FSDP2 with ``shards`` data-parallel shards each weight's scale blocks must split evenly
    (torchao shards an NF4 weight by its blocks). Needs only the config, so it can run
    before any process group exists (with ``init_from``: on the config read from config.json).
    """
    block = BLOCK_SIZE * SCALER_BLOCK_SIZE
    shapes = import_attr(model_family(config.arch).block_linears)(config)
    for name, (rows, columns) in shapes.items():
        if (rows * columns) % (block * shards):
            where = f" over {shards} FSDP shards" if shards > 1 and (rows * columns) % block == 0 else ""
            raise ConfigError(
                f"the block linear {name} has {rows} x {columns} weights, which NF4 cannot split into whole blocks of "
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
    """Replace every linear inside the blocks of the model's plan stacks (``model.parallel_plan``) by
    an NF4Linear, in place; returns their names.

    Adapters (``lora_A`` / ``lora_B``) are never quantized. Call after loading the base
    weights and after ``models.lora.apply_lora`` (which wraps the plain linears), before
    moving to the device and before parallelize.
    """
    plan = model.parallel_plan
    quantized = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if not plan.in_blocks(name) or not isinstance(module, nn.Linear) or leaf in ("lora_A", "lora_B"):
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        setattr(parent, leaf, NF4Linear.from_linear(module, name=name))
        quantized.append(name)
    return quantized
