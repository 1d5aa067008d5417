"""What a compiled QLoRA block saves for its backward (models/nf4.py, issue 18).

Traced through torch.compile, torchao's NF4 linear (dequantize, then matmul) is a few
ordinary ops of the block's graph, and AOTAutograd's min-cut partitioner kept the
dequantized weight of every linear for the backward's matmul: a compiled QLoRA block then
saved as many weight bytes as a LoRA block with a bf16 base, and QLoRA lost its memory
advantage. These tests count the bytes a block saves for backward during its forward
(``saved_tensors_hooks`` sees a compiled graph's ``save_for_backward`` too) and check that
none of them is a dequantized weight, with and without block-level activation checkpointing
(with it, the old code saved none either: that case checks that the NF4 linear's own
checkpoint nests in the block's).

The blocks compile with the ``aot_eager_decomp_partition`` backend: the same AOTAutograd
tracing, decompositions and min-cut partitioner as inductor, without inductor's (slow on
CPU) code generation, so what is saved is what inductor's graphs save.
"""

from __future__ import annotations

import pytest
import torch

import models
from core.config import LoRAConfig, ModelConfig
from distributed.activation_checkpoint import apply_activation_checkpointing
from models.lora import apply_lora, lora_modules
from models.nf4 import is_nf4, nf4_bytes, quantize_base
from tests.models.conftest import VOCAB

# The smallest Qwen3 block NF4 can hold: every projection a multiple of 64 x 256 weights.
SHAPE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4, num_kv_heads=4)
TOKENS = 16


def _qlora_block(activation_checkpointing: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(model, its one block) with rank-4 adapters on all seven linears over an NF4 base."""
    model = models.build(ModelConfig(**SHAPE), generator=torch.Generator().manual_seed(0))
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0), seed=0)
    quantize_base(model)
    apply_activation_checkpointing(model, activation_checkpointing)
    return model, model.layers[0]


def _saved_for_backward(model: torch.nn.Module, block: torch.nn.Module) -> tuple[list[tuple], torch.Tensor]:
    """(shape, dtype, bytes) of every tensor the block's forward saves that is not parameter
    storage (an NF4 weight counts through its packed tensors), and the input's gradient."""
    resident = set()
    for param in model.parameters():
        for tensor in [t for _, t in nf4_bytes(param)] if is_nf4(param) else [param]:
            resident.add(tensor.untyped_storage().data_ptr())
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        for part in [t for _, t in nf4_bytes(tensor)] if is_nf4(tensor) else [tensor]:
            if part.untyped_storage().data_ptr() not in resident:
                saved.append((tuple(part.shape), part.dtype, part.numel() * part.element_size()))
        return tensor

    hidden = torch.randn(1, TOKENS, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1),
                         requires_grad=True)
    rope = model.rotary_table(torch.arange(TOKENS).unsqueeze(0))
    mask = model.attention_mask(None, TOKENS, hidden.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(hidden, rope, mask)
    out.float().square().sum().backward()
    return saved, hidden.grad


@pytest.mark.parametrize("activation_checkpointing", ["none", "full"])
def test_a_compiled_nf4_block_saves_no_dequantized_weight(activation_checkpointing):
    eager_model, eager_block = _qlora_block(activation_checkpointing)
    model, block = _qlora_block(activation_checkpointing)
    for module in lora_modules(eager_model) + lora_modules(model):  # non-zero updates: B starts at 0
        torch.nn.init.constant_(module.lora_B.weight, 0.01)
    _, want_grad = _saved_for_backward(eager_model, eager_block)

    block.compile(backend="aot_eager_decomp_partition")
    torch._dynamo.reset()
    try:
        saved, grad = _saved_for_backward(model, block)
    finally:
        torch._dynamo.reset()

    weights = [m.base_layer.dequantized_weight() for m in lora_modules(model)]
    shapes = {tuple(w.shape) for w in weights} | {tuple(w.shape)[::-1] for w in weights}
    assert not [s for s in saved if s[0] in shapes and s[1].is_floating_point], saved
    # However they were reshaped, seven bf16 weights (327,680 bytes) would not fit: the
    # activations of 16 tokens are a small fraction of that.
    weight_bytes = sum(w.numel() * torch.bfloat16.itemsize for w in weights)
    assert 0 < sum(s[2] for s in saved) < weight_bytes / 2
    torch.testing.assert_close(grad, want_grad, rtol=2e-2, atol=1e-3)  # bf16 autocast, other fusion
