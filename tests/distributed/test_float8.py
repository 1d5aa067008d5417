"""distributed/float8.py: which linears go FP8, and the clear error where FP8 cannot run.

The FP8 matmuls themselves need a CUDA GPU of compute capability 8.9+ (benchmarks cover
them there); here the conversion runs with torchao's CPU emulation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import models
from core.config import ModelConfig, ParallelConfig
from core.exceptions import ConfigError
from distributed.float8 import apply_float8, float8_module_filter, require_float8

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=16, tie_embeddings=False)


def test_require_float8_names_the_key_and_what_to_do():
    require_float8(ParallelConfig(), torch.device("cpu"))  # float8=none: nothing to check
    with pytest.raises(ConfigError) as err:
        require_float8(ParallelConfig(float8="tensorwise", precision="bf16"), torch.device("cpu"))
    assert err.value.context["key"] == "parallel.float8" and "CUDA" in str(err.value)
    assert "parallel.float8=none" in err.value.hint


def test_eligible_linears_convert_and_keep_their_parameters():
    pytest.importorskip("torchao.float8")
    model = models.build(TINY)
    before = dict(model.named_parameters())
    converted = apply_float8(model, ParallelConfig(float8="tensorwise", precision="bf16"), fsdp=False, emulate=True)
    # q/k/v/o are 32x32 or 16x32; the MLP's 40 is not a multiple of 16; the head never converts.
    assert sorted(converted) == [f"layers.0.self_attn.{n}_proj" for n in "koqv"]
    kinds = {name: type(module).__name__ for name, module in model.named_modules()}
    assert all(kinds[name] == "Float8Linear" for name in converted)
    assert kinds["lm_head"] == "Linear" and kinds["layers.0.mlp.up_proj"] == "Linear"
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()  # checkpoints load with FP8 on or off
    assert all(after[k].dtype == torch.float32 for k in after)  # master weights stay fp32
    ids = torch.randint(0, 64, (2, 16))
    loss = model(ids, position_ids=torch.arange(16).expand(2, 16), document_ids=torch.zeros(2, 16, dtype=torch.long)).float().mean()
    loss.backward()
    assert model.layers[0].self_attn.q_proj.weight.grad is not None


def test_filter_rule():
    linear = torch.nn.Linear(32, 48)
    assert float8_module_filter(linear, "layers.0.mlp.up_proj")
    assert not float8_module_filter(linear, "lm_head")
    assert not float8_module_filter(torch.nn.Linear(32, 40), "layers.0.mlp.up_proj")
    assert not float8_module_filter(torch.nn.LayerNorm(32), "norm")
