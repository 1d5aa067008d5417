"""LoRA on a Qwen3-MoE model (models/lora.py, the family's LoRA targets): adapters on the attention
train alone (router, experts and the rest of the base get no gradient), their PEFT export loads in
peft on transformers' Qwen3MoeForCausalLM with our logits and so does the merged export, and a target
naming a stacked expert weight is refused (docs/models.md, Qwen3-MoE, says why)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from core.config import LoRAConfig
from core.exceptions import ConfigError
from models.builder import build
from models.forward import ModelInputs, model_forward
from models.hf_weights import load_pretrained, save_pretrained
from models.lora import (ADAPTER_CONFIG, apply_lora, load_peft_adapter, lora_modules, merge_lora,
                         save_peft_adapter)
from tests.models.test_qwen3_moe import _config, _hf_model, _ids

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA = LoRAConfig(rank=4, alpha=8.0, targets=ATTENTION)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model_forward(model, ModelInputs(ids)).logits


@torch.no_grad()
def _randomize_b(model: torch.nn.Module, seed: int = 5) -> None:
    """Non-zero B matrices, so the adapters change the logits (B starts at zero)."""
    generator = torch.Generator().manual_seed(seed)
    for module in lora_modules(model):
        module.lora_B.weight.copy_(0.1 * torch.randn(module.lora_B.weight.shape, generator=generator))


def test_attention_adapters_train_alone_on_a_mixture_of_experts():
    model = build(_config(), generator=torch.Generator().manual_seed(0))
    base = {name: param.detach().clone() for name, param in model.named_parameters()}
    trainable = apply_lora(model, LORA, seed=0)
    assert {m.name.rsplit(".", 1)[-1] for m in lora_modules(model)} == set(ATTENTION)
    assert len(lora_modules(model)) == 4 * 3 and all(".self_attn." in name for name in trainable)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    losses, tokens = [], _ids(seq_len=12)
    for _ in range(3):  # one batch, learnt: the loss falls
        output = model_forward(model, ModelInputs(tokens[:, :-1]))
        loss = F.cross_entropy(output.logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        aux = output.aux_losses["load_balance"]
        (loss + aux.weight * aux.sum / tokens[:, :-1].numel()).backward()
        for name, param in model.named_parameters():  # the router's balancing loss reaches no frozen weight
            assert (param.grad is not None) == param.requires_grad, name
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    moved = {name for name, param in model.named_parameters() if ".lora_" in name and param.requires_grad}
    assert moved and all(".self_attn." in name for name in moved)
    for name, param in model.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(param, base[name.replace(".base_layer.", ".")]), name


def test_peft_on_transformers_qwen3_moe_computes_our_logits(tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import Qwen3MoeForCausalLM

    _hf_model(True, tmp_path / "base")
    ours = load_pretrained(tmp_path / "base", base=_config(norm_topk_prob=True)).eval()
    apply_lora(ours, LORA, seed=0)
    _randomize_b(ours)
    save_peft_adapter(ours, tmp_path / "adapter", str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == list(ATTENTION)

    base = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = _ids(seed=3)
    with torch.no_grad():
        expected = reference(ids).logits
        got = _logits(ours, ids)
        plain = _logits(load_pretrained(tmp_path / "base", base=_config(norm_topk_prob=True)).eval(), ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (got - plain).abs().max() > 1e-3  # the adapters change the logits: the comparison sees them

    again = load_pretrained(tmp_path / "base", base=_config(norm_topk_prob=True)).eval()
    apply_lora(again, LORA, seed=1)
    load_peft_adapter(again, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(_logits(again, ids), got)

    save_pretrained(merge_lora(ours), tmp_path / "merged")  # the other export: a plain Qwen3MoeForCausalLM
    merged = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)


def test_a_stacked_expert_weight_is_refused_naming_why_and_the_valid_targets():
    model = build(_config(), generator=torch.Generator().manual_seed(0))  # layer 1 dense: its down_proj is a linear, not adapted alone
    with pytest.raises(ConfigError, match="'down_proj', which .* is a stacked expert weight") as err:
        apply_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "down_proj")), seed=0)
    assert err.value.context["key"] == "model.lora.targets" and "q_proj" in str(err.value)
    all_sparse = build(_config(mlp_only_layers=()), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match="'gate_proj', which .* is a stacked expert weight"):
        apply_lora(all_sparse, LoRAConfig(rank=4, alpha=8.0, targets=("gate_proj",)), seed=0)
