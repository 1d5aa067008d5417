"""What a compiled QLoRA block saves for its backward, and what it computes (models/nf4.py, issue 18).

Traced through torch.compile as torchao's tensor subclass, the NF4 linear (dequantize, then
matmul) became a few ordinary ops of the block's graph. AOTAutograd's min-cut partitioner then
kept the dequantized weight of every linear for the backward's matmul, and under torch 2.11
the block's activation checkpoint did not reach those ops either: a checkpointed block saved
the dequantized weights and the matmul outputs of every NF4 linear (CPU, this block: 383,936
bytes instead of 15,744; an H200 run of Qwen3-1.7B peaked at 13.68 GiB instead of ~8.7). The
compiled NF4 linear now dequantizes the NF4Tensor's plain parts inside a nested checkpoint.
These tests count the bytes a block saves for backward during its forward
(``saved_tensors_hooks`` sees a compiled graph's ``save_for_backward`` too), with and without
block-level activation checkpointing, check that a compiled NF4 linear saves no weight and
computes eager's outputs and input gradients (to rounding), and that the plain-tensor
dequantization is torchao's bit for bit.

The blocks compile with the ``aot_eager_decomp_partition`` backend: the same AOTAutograd
tracing, decompositions and min-cut partitioner as inductor, without inductor's (slow on
CPU) code generation, so what is saved is what inductor's graphs save. The linear test uses
inductor itself.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import models
from core.config import LoRAConfig, ModelConfig
from distributed.activation_checkpoint import apply_activation_checkpointing
from models.lora import apply_lora, lora_modules
from models.nf4 import NF4Linear, is_nf4, quantize_base
from tests.models.conftest import VOCAB

# The smallest Qwen3 block NF4 can hold: every projection a multiple of 64 x 256 weights.
SHAPE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4, num_kv_heads=4)
TOKENS = 16
NARROWEST_LINEAR = 128
"""The fewest output (or input) features of any of the block's linears."""


def _qlora_block(activation_checkpointing: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(model, its one block) with rank-4 adapters on all seven linears over an NF4 base."""
    model = models.build(ModelConfig(**SHAPE), generator=torch.Generator().manual_seed(0))
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0), seed=0)
    for module in lora_modules(model):  # non-zero updates: B starts at 0
        torch.nn.init.constant_(module.lora_B.weight, 0.01)
    quantize_base(model)
    apply_activation_checkpointing(model, activation_checkpointing)
    return model, model.layers[0]


def _parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """An NF4 weight's inner tensors (its NF4 table too), any other tensor itself."""
    return [getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]] if is_nf4(tensor) else [tensor]


def _resident(model: torch.nn.Module) -> set[int]:
    return {part.untyped_storage().data_ptr() for param in model.parameters() for part in _parts(param)}


def _saved_for_backward(model: torch.nn.Module, block: torch.nn.Module) -> tuple[list[tuple], torch.Tensor]:
    """(shape, dtype, bytes) of every tensor the block's forward saves that is not parameter
    storage, except the block's input itself, and the input's gradient."""
    hidden = torch.randn(1, TOKENS, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1),
                         requires_grad=True)
    skip = _resident(model) | {hidden.untyped_storage().data_ptr()}
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        for part in _parts(tensor):
            if part.untyped_storage().data_ptr() not in skip:
                saved.append((tuple(part.shape), part.dtype, part.numel() * part.element_size()))
        return tensor

    rope = model.rotary_table(torch.arange(TOKENS).unsqueeze(0))
    mask = model.attention_mask(None, TOKENS, hidden.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(hidden, rope, mask)
    out.float().square().sum().backward()
    return saved, hidden.grad


def _compiled(block: torch.nn.Module, run):
    block.compile(backend="aot_eager_decomp_partition")
    torch._dynamo.reset()
    counters.clear()
    try:
        return run(), sum(counters["graph_break"].values())
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("activation_checkpointing", ["none", "full"])
def test_a_compiled_nf4_block_saves_no_more_than_eager(activation_checkpointing):
    eager_model, eager_block = _qlora_block(activation_checkpointing)
    eager_saved, want_grad = _saved_for_backward(eager_model, eager_block)
    model, block = _qlora_block(activation_checkpointing)
    (saved, grad), graph_breaks = _compiled(block, lambda: _saved_for_backward(model, block))

    assert graph_breaks == 0
    floats = [s for s in saved if s[1].is_floating_point]
    weights = [m.base_layer.dequantized_weight() for m in lora_modules(model)]
    shapes = {tuple(w.shape) for w in weights} | {tuple(w.shape)[::-1] for w in weights}
    assert not [s for s in floats if s[0] in shapes], saved  # no dequantized weight
    if activation_checkpointing == "none":
        # Eager saves each linear's input (the autocast copy, which the adapters share) and no
        # weight; the compiled block may save less (fused casts), never more.
        assert 0 < sum(s[2] for s in saved) <= sum(s[2] for s in eager_saved), (saved, eager_saved)
    else:
        # Recomputed in backward: beside the block's input and the checkpoint's RNG state, only
        # the rotary tables are saved, nothing as large as one linear's input or output.
        one_matmul = TOKENS * NARROWEST_LINEAR * torch.bfloat16.itemsize
        assert 0 < sum(s[2] for s in floats) < one_matmul, saved
    torch.testing.assert_close(grad, want_grad, rtol=2e-2, atol=1e-3)  # bf16 autocast, other fusion


@pytest.mark.parametrize(("weight_dtype", "autocast"), [(torch.bfloat16, False), (torch.float32, True)])
def test_a_compiled_nf4_linear_saves_no_weight_and_computes_eagers_values(weight_dtype, autocast):
    linear = torch.nn.Linear(256, 128, dtype=weight_dtype)  # with a bias, as Qwen2's q/k/v
    with torch.no_grad():
        linear.weight.normal_(generator=torch.Generator().manual_seed(0))
        linear.bias.normal_(generator=torch.Generator().manual_seed(1))
    nf4 = NF4Linear.from_linear(linear, name="linear")
    x = torch.randn(2, 9, 256, generator=torch.Generator().manual_seed(2), dtype=weight_dtype)
    grad_out = torch.randn(2, 9, 128, generator=torch.Generator().manual_seed(3))
    resident = _resident(nf4)

    def run(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, list]:
        leaf, saved = x.clone().requires_grad_(), []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.extend(p.shape for p in _parts(tensor) if p.untyped_storage().data_ptr() not in resident)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = module(leaf)
        out.backward(grad_out.to(out.dtype))
        return out.detach(), leaf.grad, saved

    def run_compiled():
        compiled = torch.compile(nf4, fullgraph=True)  # inductor; fullgraph: no graph break
        results = run(compiled)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with torch.no_grad():
                no_grad = compiled(x)
            with torch.inference_mode():  # the sampler's and a frozen reference's compiled forwards
                inference = compiled(x)
        return results, no_grad, inference

    want_out, want_grad, _ = run(nf4)
    torch._dynamo.reset()
    try:
        (out, grad, saved), no_grad, inference = run_compiled()
    finally:
        torch._dynamo.reset()
    assert out.dtype == (torch.bfloat16 if autocast else weight_dtype) and grad.dtype == weight_dtype
    # Inductor fuses the dequantization, so the values agree to the matmul dtype's rounding: a
    # bf16 ulp of the largest outputs (sums of 256 products), or fp32 noise.
    for got, want in ((out, want_out), (grad, want_grad)):
        low = torch.bfloat16 in (got.dtype, weight_dtype)
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=2e-2 if low else 1e-5, atol=(1e-2 if low else 1e-6) * scale)
    assert torch.equal(no_grad, out) and torch.equal(inference, out)
    # Nothing beyond the resident NF4 bytes: with the weight frozen the backward needs no input,
    # and it recomputes the dequantized weight instead of keeping it.
    assert saved == []


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_the_plain_tensor_dequantization_is_torchaos_bit_for_bit(weight_dtype):
    """The compiled path dequantizes the NF4Tensor's parts on plain tensors
    (models.nf4.dequantize_parts), not through torchao's subclass: in eager its values must
    be torchao's own."""
    from models.nf4 import _nf4_parts, dequantize_parts

    linear = torch.nn.Linear(256, 128, bias=False, dtype=weight_dtype)
    with torch.no_grad():
        linear.weight.normal_(generator=torch.Generator().manual_seed(4))
    weight = NF4Linear.from_linear(linear, name="linear").weight
    for dtype in (torch.float32, torch.bfloat16):
        want = weight.to(dtype)  # torchao's NF4Tensor.get_original_weight, then the cast
        assert torch.equal(dequantize_parts(*_nf4_parts(weight), dtype), want)
