"""LoRA on Qwen3-MoE's experts (``model.qwen3_moe.lora_experts``; models/qwen3_moe/expert_lora.py, through
models/lora.py): per-expert adapters on the stacked gate, up and down weights train while the base stays
frozen, merging them gives the adapted forward and the plain model's names, adapters off give the base,
the sampler's copy computes the adapted model, PEFT's forms are refused, and the key's checks and hash."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from core.config import LoRAConfig, config_hash, load
from core.exceptions import ConfigError
from models.builder import build
from models.forward import ModelInputs, model_forward
from models.lora import (adapted_experts, adapters_disabled, apply_lora, load_peft_adapter, merge_lora,
                         save_peft_adapter)
from models.qwen3_moe.generation_copy import generation_copy
from tests.models.test_qwen3_moe import _config, _ids

ROOT = Path(__file__).resolve().parents[2]
LORA = LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _adapted(seed: int = 0) -> torch.nn.Module:
    model = build(_config(lora_experts=True), generator=torch.Generator().manual_seed(seed))
    apply_lora(model, LORA, seed=0)
    return model


@torch.no_grad()
def _randomize_b(model: torch.nn.Module) -> None:
    """Non-zero B matrices (they start at zero), so the adapters change the logits."""
    generator = torch.Generator().manual_seed(5)
    for name, param in model.named_parameters():
        if ".lora_B" in name:
            param.copy_(0.1 * torch.randn(param.shape, generator=generator))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model_forward(model, ModelInputs(ids)).logits


def test_expert_adapters_train_and_the_base_stays_frozen():
    model = _adapted()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if ".experts.lora_" in name}
    assert shapes == {f"layers.{layer}.mlp.experts.lora_{part}.{proj}": shape
                      for layer in (0, 2)  # layer 1 is dense: no experts
                      for proj, a, b in (("gate_proj", (6, 4, 32), (6, 24, 4)), ("up_proj", (6, 4, 32), (6, 24, 4)),
                                         ("down_proj", (6, 4, 24), (6, 32, 4)))
                      for part, shape in (("A", a), ("B", b))}
    assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())
    base = {name: p.detach().clone() for name, p in model.named_parameters() if ".lora_" not in name}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens, losses = _ids(seq_len=12), []
    for step in range(3):
        out = model_forward(model, ModelInputs(tokens[:, :-1]))
        loss = F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
        aux = out.aux_losses["load_balance"]
        (loss + aux.weight * aux.sum / tokens[:, :-1].numel()).backward()
        for name, param in model.named_parameters():
            assert (param.grad is not None) == param.requires_grad, name
        if step == 0:  # B starts at zero: A gets no gradient yet, B does
            experts = model.layers[0].mlp.experts
            assert not experts.lora_A["down_proj"].grad.any() and experts.lora_B["down_proj"].grad.any()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for layer in (0, 2):
        experts = model.layers[layer].mlp.experts
        assert all(experts.lora_B[p].abs().sum() > 0 for p in PROJECTIONS)
    for name, param in model.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(param, base[name]), name


def test_merging_gives_the_adapted_forward_and_adapters_off_the_base():
    model = _adapted()
    _randomize_b(model)
    plain = build(_config(), generator=torch.Generator().manual_seed(0)).eval()
    ids = _ids(seed=3)
    with torch.no_grad():
        adapted = _logits(model.eval(), ids)
        base = _logits(plain, ids)
        assert (adapted - base).abs().max() > 1e-3  # the experts' adapters change the logits
        merged = merge_lora(model)
        assert merged.state_dict().keys() == plain.state_dict().keys() and not adapted_experts(merged)
        torch.testing.assert_close(_logits(merged, ids), adapted, rtol=0, atol=1e-6)
        with adapters_disabled(model):
            assert torch.equal(_logits(model, ids), base)
        copy = generation_copy(model, model.state_dict(), device="cpu", dtype=torch.float32)
        assert not adapted_experts(copy)  # the sampler's copy: merged, as the attention's adapters
        torch.testing.assert_close(_logits(copy, ids), adapted, rtol=0, atol=1e-6)


def test_an_expert_adapter_does_not_depend_on_the_other_adapters():
    model = _adapted()
    others = build(_config(lora_experts=True), generator=torch.Generator().manual_seed(0))
    apply_lora(others, LoRAConfig(rank=4, alpha=8.0, targets=("o_proj",)), seed=0)
    for layer in (0, 2):
        a, b = model.layers[layer].mlp.experts.lora_A, others.layers[layer].mlp.experts.lora_A
        assert all(torch.equal(a[p], b[p]) for p in PROJECTIONS)
    assert not torch.equal(model.layers[0].mlp.experts.lora_A["gate_proj"],
                           model.layers[2].mlp.experts.lora_A["gate_proj"])


def test_peft_forms_are_refused_naming_the_key(tmp_path):
    model = _adapted()
    with pytest.raises(ConfigError, match="PEFT has no form") as err:
        save_peft_adapter(model, tmp_path / "adapter", None)
    assert err.value.context["key"] == "model.qwen3_moe.lora_experts"
    with pytest.raises(ConfigError, match="model.lora.init_from"):
        load_peft_adapter(model, tmp_path / "adapter")


def test_the_key_is_hashed_only_when_set_and_checked():
    tiny_moe = ROOT / "configs" / "tiny-moe.yaml"
    lora = ["model.lora.rank=4", "model.lora.targets=[q_proj,v_proj]"]
    plain = load(tiny_moe, lora)
    assert config_hash(plain) == config_hash(load(tiny_moe, [*lora, "model.qwen3_moe.lora_experts=false"]))
    assert config_hash(plain) != config_hash(load(tiny_moe, [*lora, "model.qwen3_moe.lora_experts=true"]))
    with pytest.raises(ConfigError, match="model.lora.rank=0 turns LoRA off") as err:
        load(tiny_moe, ["model.qwen3_moe.lora_experts=true"])
    assert err.value.context["key"] == "model.qwen3_moe.lora_experts"
    with pytest.raises(ConfigError, match="take no dropout") as err:
        load(tiny_moe, [*lora, "model.lora.dropout=0.1", "model.qwen3_moe.lora_experts=true"])
    assert err.value.context["key"] == "model.lora.dropout"
    with pytest.raises(ConfigError, match="not split over expert-parallel ranks") as err:
        load(tiny_moe, [*lora, "parallel.ep=2", "model.qwen3_moe.lora_experts=true"])
    assert err.value.context["key"] == "parallel.ep"
