"""models/qwen/model.py: the module contract, deterministic init, bitwise-repeatable CPU steps."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import models
from core.config import ModelConfig
from core.exceptions import ConfigError
from models.qwen.model import QwenBlock, QwenForCausalLM, RMSNorm

CONFIG = ModelConfig(
    arch="qwen3", vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, attention="sdpa",
)
QWEN2 = dataclasses.replace(CONFIG, arch="qwen2", head_dim=None, tie_embeddings=False)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_equal_states(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_module_tree_and_state_dict_keys():
    model = models.build(QWEN2)
    assert isinstance(model.embed_tokens, torch.nn.Embedding) and isinstance(model.lm_head, torch.nn.Linear)
    assert isinstance(model.norm, RMSNorm) and all(isinstance(b, QwenBlock) for b in model.layers)
    attn = model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None and attn.q_norm is None
    keys = set(model.state_dict())
    assert {"embed_tokens.weight", "norm.weight", "lm_head.weight", "layers.1.mlp.down_proj.weight",
            "layers.0.self_attn.q_proj.bias", "layers.0.post_attention_layernorm.weight"} <= keys
    assert not any("rotary" in k or "inv_freq" in k for k in keys)  # RoPE holds no state

    qwen3 = models.build(CONFIG)
    assert qwen3.lm_head.weight is qwen3.embed_tokens.weight
    assert qwen3.layers[0].self_attn.q_norm.weight.shape == (16,)
    assert qwen3.layers[0].self_attn.q_proj.bias is None


def test_init_is_deterministic_given_the_generator():
    a = _state(models.build(CONFIG, generator=torch.Generator().manual_seed(42)))
    b = _state(models.build(CONFIG, generator=torch.Generator().manual_seed(42)))
    c = _state(models.build(CONFIG, generator=torch.Generator().manual_seed(43)))
    _assert_equal_states(a, b)
    assert not torch.equal(a["layers.0.mlp.up_proj.weight"], c["layers.0.mlp.up_proj.weight"])


def test_init_ignores_the_global_rng():
    with torch.random.fork_rng():
        torch.manual_seed(1)
        a = _state(models.build(CONFIG, generator=torch.Generator().manual_seed(5)))
        torch.manual_seed(2)
        b = _state(models.build(CONFIG, generator=torch.Generator().manual_seed(5)))
    _assert_equal_states(a, b)


def test_meta_device_then_to_empty_then_init_matches_build():
    with torch.device("meta"):
        model = QwenForCausalLM(CONFIG)
    model.to_empty(device="cpu")  # breaks the embedding/head tie; init_weights restores it
    model.init_weights(torch.Generator().manual_seed(9))
    assert model.lm_head.weight is model.embed_tokens.weight
    _assert_equal_states(_state(model), _state(models.build(CONFIG, generator=torch.Generator().manual_seed(9))))


def test_init_values():
    model = models.build(QWEN2, generator=torch.Generator().manual_seed(0))
    attn = model.layers[0].self_attn
    assert torch.equal(model.norm.weight, torch.ones(48))
    assert torch.equal(attn.q_proj.bias, torch.zeros(48))
    assert abs(model.embed_tokens.weight.std().item() - QWEN2.init_std) < 0.002
    assert abs(model.layers[1].mlp.down_proj.weight.std().item() - QWEN2.init_std) < 0.002
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)  # untied: drawn separately


def test_init_weights_refuses_meta_parameters_and_non_cpu_generators():
    with torch.device("meta"):
        model = QwenForCausalLM(CONFIG)
    with pytest.raises(ValueError, match="to_empty"):
        model.init_weights(torch.Generator().manual_seed(0))
    cuda_generator = SimpleNamespace(device=torch.device("cuda", 0))  # stand-in: no GPU here
    with pytest.raises(ValueError, match="CPU"):
        models.build(CONFIG).init_weights(cuda_generator)


def test_invalid_shape_is_a_config_error():
    with pytest.raises(ConfigError) as caught:
        models.build(dataclasses.replace(CONFIG, head_dim=15))
    assert caught.value.context["key"] == "model.head_dim" and caught.value.exit_code == 2


def _step(model, ids, position_ids, document_ids):
    logits = model(ids, position_ids=position_ids, document_ids=document_ids)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "document-masked"])
def test_cpu_forward_backward_is_bitwise_repeatable(packed):
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(3))
    document_ids = torch.tensor([[0] * 10 + [1] * 22, [0] * 32]) if packed else None
    position_ids = torch.tensor([list(range(10)) + list(range(22)), list(range(32))]) if packed else None
    runs = []
    for _ in range(2):  # a fresh model each time, as a resumed or replayed run would have
        model = models.build(CONFIG, generator=torch.Generator().manual_seed(4))
        runs.append(_step(model, ids, position_ids, document_ids))
    assert torch.equal(runs[0][0], runs[1][0])
    for name in runs[0][1]:
        assert torch.equal(runs[0][1][name], runs[1][1][name]), name


def test_blocks_are_callable_one_by_one():
    # FSDP, activation checkpointing and compile wrap model.layers[i]; the model's forward
    # must be exactly embed -> blocks(hidden, rope, mask) -> norm -> head.
    model = models.build(CONFIG, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    document_ids = torch.tensor([[0] * 5 + [1] * 7] * 2)
    position_ids = torch.tensor([list(range(5)) + list(range(7))] * 2)
    with torch.no_grad():
        expected = model(ids, position_ids=position_ids, document_ids=document_ids)
        hidden = model.embed_tokens(ids)
        mask = model.attention_mask(document_ids, ids.shape[1], ids.device)
        rope = model.rotary_table(position_ids)
        for block in model.layers:
            hidden = block(hidden, rope, mask)
        got = model.lm_head(model.norm(hidden))
    assert torch.equal(expected, got)


def test_activation_checkpointed_blocks_give_equal_gradients():
    from torch.utils.checkpoint import checkpoint

    model = models.build(CONFIG, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    _, plain = _step(model, ids, None, None)
    model.zero_grad()
    for block in model.layers:
        block.forward = (lambda b: lambda *args: checkpoint(b.__class__.forward, b, *args, use_reentrant=False))(block)
    _, checkpointed = _step(model, ids, None, None)
    for name in plain:
        assert torch.equal(plain[name], checkpointed[name]), name


def test_bf16_autocast_returns_logits_in_compute_dtype():
    model = models.build(CONFIG)
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    assert logits.dtype == torch.bfloat16
    bf16_model = models.build(CONFIG).to(torch.bfloat16)
    assert bf16_model(ids).dtype == torch.bfloat16
