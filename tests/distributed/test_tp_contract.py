"""What tensor parallelism needs from the model, checked without processes.

TP hands each rank a slice of q/k/v (whole heads) and of o_proj's input. The attention must
then run on ``heads / tp`` heads, so it has to derive its head counts from the projection
outputs at run time. The test builds "rank 0 of TP=2" by hand and runs a forward.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from core.exceptions import ConfigError
from distributed.tp import check_divisible
from tests.distributed.scenarios import build_model, make_batch


def _keep_rows(linear: nn.Linear, rows: int) -> nn.Linear:
    out = nn.Linear(linear.in_features, rows, bias=linear.bias is not None)
    with torch.no_grad():
        out.weight.copy_(linear.weight[:rows])
        if linear.bias is not None:
            out.bias.copy_(linear.bias[:rows])
    return out


def _keep_columns(linear: nn.Linear, columns: int) -> nn.Linear:
    out = nn.Linear(columns, linear.out_features, bias=linear.bias is not None)
    with torch.no_grad():
        out.weight.copy_(linear.weight[:, :columns])
        if linear.bias is not None:
            out.bias.copy_(linear.bias)
    return out


def _first_tp_shard(model: nn.Module, tp: int) -> nn.Module:
    for block in model.layers:
        attn = block.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            proj = getattr(attn, name)
            setattr(attn, name, _keep_rows(proj, proj.out_features // tp))
        attn.o_proj = _keep_columns(attn.o_proj, attn.o_proj.in_features // tp)
    return model


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_attention_runs_on_a_tp_shard_of_its_heads(arch):
    model = _first_tp_shard(build_model(arch), tp=2)
    batch = make_batch(0)
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"])
    assert logits.shape == (*batch["input_ids"].shape, model.lm_head.out_features)


def test_tp_degree_must_divide_the_kv_heads():
    model = build_model()  # 4 query heads, 2 key/value heads
    check_divisible(model, 2)
    with pytest.raises(ConfigError) as info:
        check_divisible(model, 4)
    assert "layers.0.self_attn.k_proj has 2 heads" in info.value.message
    assert "parallel.tp=4" in info.value.message
