"""LoRA and NF4 find a model's block linears through its parallel plan's stacks (core/model_plan.py),
not under a module name of one family: a model whose blocks sit elsewhere is adapted and quantized
there, and linears outside every stack are left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import models
from core.config import LoRAConfig, ModelConfig
from core.model_plan import ModelParallelPlan, Stack
from models.lora import LoRALinear, apply_lora, target_names
from tests.models.conftest import VOCAB


class _Nested(nn.Module):
    """A Qwen model kept under ``trunk``, with a linear of its own outside the blocks; its plan
    lists the trunk's blocks as its one stack."""

    def __init__(self, trunk: nn.Module) -> None:
        super().__init__()
        self.trunk = trunk
        self.config = trunk.config
        self.probe = nn.Linear(trunk.config.hidden_size, trunk.config.hidden_size, bias=False)

    @property
    def parallel_plan(self) -> ModelParallelPlan:
        inner = self.trunk.parallel_plan
        stacks = tuple(Stack(path=f"trunk.{s.path}", colwise=s.colwise, rowwise=s.rowwise) for s in inner.stacks)
        return ModelParallelPlan(stacks=stacks, embedding=f"trunk.{inner.embedding}", output=f"trunk.{inner.output}")


def _trunk(**shape) -> nn.Module:
    defaults = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)
    config = ModelConfig(arch="qwen3", init_std=0.1, **{**defaults, **shape})
    return models.build(config, generator=torch.Generator().manual_seed(0))


def test_in_blocks_reads_every_stack_path():
    plan = ModelParallelPlan(stacks=(Stack(path="layers"), Stack(path="vision.blocks")), embedding="e", output="o")
    assert plan.in_blocks("layers.0.mlp.up_proj") and plan.in_blocks("vision.blocks.3.attn.qkv")
    assert not plan.in_blocks("lm_head") and not plan.in_blocks("layers") and not plan.in_blocks("vision.proj")
    assert not plan.in_blocks("layersx.0.mlp")  # a path's prefix is a whole attribute name


def test_lora_wraps_the_linears_of_the_plan_stacks_only():
    model = _Nested(_trunk())
    assert target_names(model) == target_names(model.trunk)  # the same block linears, found under trunk.layers
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "down_proj")), seed=0)
    wrapped = sorted(name for name, m in model.named_modules() if isinstance(m, LoRALinear))
    assert wrapped == [f"trunk.layers.{i}.{leaf}" for i in range(2) for leaf in ("mlp.down_proj", "self_attn.q_proj")]
    assert isinstance(model.probe, nn.Linear)  # outside every stack: neither a target nor wrapped


def test_nf4_quantizes_the_linears_of_the_plan_stacks_only():
    pytest.importorskip("torchao")
    from models.nf4 import NF4Linear, quantize_base

    model = _Nested(_trunk(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=4))
    quantized = quantize_base(model)
    assert len(quantized) == 2 * 7 and all(name.startswith("trunk.layers.") for name in quantized)
    assert isinstance(model.trunk.layers[1].mlp.up_proj, NF4Linear)
    assert isinstance(model.probe, nn.Linear) and isinstance(model.trunk.lm_head, nn.Linear)
