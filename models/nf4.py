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

Under torch.compile (per-block compile, distributed/compile.py) the NF4 linear runs as one
custom op, ``lockstep::nf4_linear``, that AOTAutograd does not look into. Traced as torchao's
tensor subclass, the dequantization and matmul became ordinary ops of the block's graph: the
min-cut partitioner kept every dequantized weight for the backward's matmul, and on torch
2.11 the block's activation checkpoint did not reach those ops either, so a checkpointed
QLoRA block still saved every NF4 linear's weight and matmul outputs (Qwen3-1.7B on an H200:
13.68 GiB peak against LoRA's 10.62; a nested checkpoint around ``linear_nf4``, tried before,
changed nothing there). The op takes the NF4Tensor's plain inner tensors, dequantizes them
with torchao's formula on plain tensors (``_dequantize_eager``: bit for bit torchao's
``weight.to(x.dtype)``, tested; compiled into one kernel on CUDA, since the dozen eager
launches per linear made QLoRA 4-5x slower there), then ``F.linear`` and the bias as the
eager forward adds it; its backward, ``lockstep::nf4_linear_input_grad``, computes
``grad @ weight.to(grad.dtype)`` as torchao's ``LinearNF4.backward`` does. It saves only the
NF4 bytes (resident anyway): never the input, never a weight. So compiled outputs and input
gradients equal eager's bit for bit (inductor fuses nothing into the op), a checkpointed
block recomputes the op like any other, and no graph breaks (``fullgraph`` works, as do
``no_grad`` and ``inference_mode`` forwards). Autocast does not reach into a custom op, so
the input is cast to autocast's dtype before it, as autocast casts eager's ``F.linear``.
Eager forwards call ``linear_nf4`` directly, which saves the NF4 weight itself. A weight the
op cannot take apart (a DTensor: FSDP2 gathers NF4 weights before the forward, so only a
sharded forward would see one) or a bias that trains keeps ``linear_nf4`` under compile too
(tests/models/test_nf4_memory.py).

torchao is imported on first use only: models that do not quantize never load it.
"""

from __future__ import annotations

import math
import os

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

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
        if torch.compiler.is_compiling() and _compiled_path(self.weight, self.bias):
            return _compiled_linear_nf4(x, self.weight, self.bias)  # see "Under torch.compile" above
        out = _torchao_nf4().linear_nf4(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as the forward sees it, in the dtype it was quantized from."""
        return self.weight.get_original_weight()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nf4"


# --------------------------------------------------------------------------- compiled path
#
# Two custom ops that AOTAutograd cannot look into: the compiled graph holds one node per NF4
# linear (and one per input gradient), which runs torchao's own eager code on an NF4Tensor
# rebuilt from its parts. The parts are plain tensors, so no tensor subclass is desugared
# inside a compiled block and the block's activation-checkpoint tags reach these nodes.


def _compiled_path(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """True for an NF4Tensor the custom ops can take apart (a sharded DTensor is not one) and
    a frozen bias (the ops give no bias gradient)."""
    return (
        is_nf4(weight) and weight.dim() == 2 and weight.is_contiguous()
        and (bias is None or not bias.requires_grad)
    )


def _compiled_linear_nf4(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear_nf4(x, weight) + bias.to(out.dtype)`` as one opaque op."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type) and x.is_floating_point() and x.dtype != torch.float64:
        # Autocast does not reach into a custom op: cast as it casts linear_nf4's F.linear in
        # eager (the weight follows x's dtype there and here).
        x = x.to(torch.get_autocast_dtype(device_type))
    return torch.ops.lockstep.nf4_linear(x, *_nf4_parts(weight), bias)


def _nf4_parts(weight: torch.Tensor) -> tuple:
    """The NF4Tensor's inner tensors and metadata, in the ops' argument order."""
    return (
        weight.quantized_data, weight.quantized_scalers, weight.quantization_factor, weight.scaler_mean, weight.nf4,
        weight.block_size, weight.scaler_block_size, list(weight.shape), weight.dtype,
    )


def _dequantize_eager(
    quantized_data: torch.Tensor, quantized_scalers: torch.Tensor, quantization_factor: torch.Tensor,
    scaler_mean: torch.Tensor, nf4: torch.Tensor, block_size: int, scaler_block_size: int, shape: list[int],
    weight_dtype: torch.dtype, dtype: torch.dtype,
) -> torch.Tensor:
    """``weight.to(dtype)`` of the contiguous NF4Tensor with these parts, on plain tensors.

    The same operations in the same order as torchao's ``NF4Tensor.get_original_weight``
    (unpack two 4-bit codes per byte, look them up in the NF4 table, multiply by the block's
    scale, which is the int8 scale divided by its block's factor, cast to the weight's dtype,
    plus the mean; interleave), so the values are bit for bit torchao's (tested against it),
    without going through the subclass's Python dispatch for each of those ops."""
    codes_high = nf4[(quantized_data >> 4).to(torch.long)]
    codes_low = nf4[(quantized_data & 0b1111).to(torch.long)]
    scalers = quantized_scalers.view(-1, scaler_block_size) / quantization_factor.unsqueeze(-1)
    scalers = scalers.flatten().to(weight_dtype) + scaler_mean
    repeated = scalers.unsqueeze(-1).expand(scalers.size(0), block_size // 2).flatten()
    weight = torch.stack([codes_high * repeated, codes_low * repeated], dim=-1).reshape(shape)
    return weight.to(dtype)


_compiled_dequantizer_cache: list = []


def compiled_dequantizer() -> Any:
    """``_dequantize_eager`` under torch.compile, built once. ``emulate_precision_casts`` makes
    inductor round at every cast as eager does, so its values are eager's bit for bit (tested
    on CPU; on the GPU ``benchmarks/lora_memory.py`` records the check as
    ``nf4_dequantize_bitwise``). Dynamic shapes: one graph for every projection's shape."""
    if not _compiled_dequantizer_cache:
        _compiled_dequantizer_cache.append(torch.compile(
            _dequantize_eager, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True}
        ))
    return _compiled_dequantizer_cache[0]


def _dequantize(*parts: Any) -> torch.Tensor:
    """``_dequantize_eager``; compiled on CUDA: one fused kernel instead of about a dozen
    launches per linear per pass (with eager dequantization QLoRA at micro-batch 1 ran at a
    fifth of LoRA's speed on an H200)."""
    if parts[0].device.type == "cuda":
        return compiled_dequantizer()(*parts)
    return _dequantize_eager(*parts)


@torch.library.custom_op("lockstep::nf4_linear", mutates_args=())
def _nf4_linear(
    x: torch.Tensor, quantized_data: torch.Tensor, quantized_scalers: torch.Tensor,
    quantization_factor: torch.Tensor, scaler_mean: torch.Tensor, nf4: torch.Tensor, block_size: int,
    scaler_block_size: int, shape: list[int], weight_dtype: torch.dtype, bias: torch.Tensor | None,
) -> torch.Tensor:
    """torchao's ``LinearNF4.forward`` (``F.linear(x, weight.to(x.dtype))``), then NF4Linear's bias."""
    weight = _dequantize(quantized_data, quantized_scalers, quantization_factor, scaler_mean, nf4,
                         block_size, scaler_block_size, shape, weight_dtype, x.dtype)
    out = F.linear(x, weight)
    return out if bias is None else out + bias.to(out.dtype)


@_nf4_linear.register_fake
def _(x, quantized_data, quantized_scalers, quantization_factor, scaler_mean, nf4, block_size,
      scaler_block_size, shape, weight_dtype, bias):
    return x.new_empty(*x.shape[:-1], shape[0])


@torch.library.custom_op("lockstep::nf4_linear_input_grad", mutates_args=())
def _nf4_linear_input_grad(
    grad: torch.Tensor, quantized_data: torch.Tensor, quantized_scalers: torch.Tensor,
    quantization_factor: torch.Tensor, scaler_mean: torch.Tensor, nf4: torch.Tensor, block_size: int,
    scaler_block_size: int, shape: list[int], weight_dtype: torch.dtype,
) -> torch.Tensor:
    """torchao's ``LinearNF4.backward``: ``grad @ weight.to(grad.dtype)``."""
    weight = _dequantize(quantized_data, quantized_scalers, quantization_factor, scaler_mean, nf4,
                         block_size, scaler_block_size, shape, weight_dtype, grad.dtype)
    return grad @ weight


@_nf4_linear_input_grad.register_fake
def _(grad, quantized_data, quantized_scalers, quantization_factor, scaler_mean, nf4, block_size,
      scaler_block_size, shape, weight_dtype):
    return grad.new_empty(*grad.shape[:-1], shape[1])


def _save_nf4_parts(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    """Saved for backward: the NF4 parts (resident anyway), never the input or a weight."""
    _, *tensors, block_size, scaler_block_size, shape, weight_dtype, _ = inputs
    ctx.save_for_backward(*tensors)
    ctx.nf4_layout = (block_size, scaler_block_size, shape, weight_dtype)


def _nf4_linear_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    input_grad = torch.ops.lockstep.nf4_linear_input_grad(grad, *ctx.saved_tensors, *ctx.nf4_layout)
    return (input_grad,) + (None,) * 10  # the weight and the bias are frozen


_nf4_linear.register_autograd(_nf4_linear_backward, setup_context=_save_nf4_parts)


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
