"""models/generation_copy.py, the generic copy every family's ``generation_copy`` calls, and models/init.py:
what a family passes in (its model class, builder, whether it folds LoRA, what else it carries) and
what the generic code refuses. Sharded models: tests/models/test_sampler.py; LoRA folding:
tests/training/test_generation_model.py."""

from __future__ import annotations

import pytest
import torch

import models
from core.config import LoRAConfig
from core.exceptions import ConfigError
from models import init
from models.generation_copy import generation_copy
from models.lora import apply_lora
from models.qwen.model import QwenForCausalLM, RMSNorm, empty_model
from models.qwen3_moe.generation_copy import generation_copy as moe_generation_copy
from models.qwen3_moe.model import Qwen3MoeForCausalLM
from models.qwen3_moe.moe import BIAS
from tests.models.sampler_model import QWEN3
from tests.models.test_qwen3_moe import _config as moe_config


def test_a_moe_copy_takes_the_whole_canonical_state_with_the_routers_biases():
    """The state the loop hands in (canonical_state: a state dict) holds the routers' persistent biases:
    accepted, and the copy carries the model's own."""
    model = models.build(moe_config(bias_update_rate=0.01), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        getattr(model.layers[2].mlp.gate, BIAS).copy_(torch.linspace(-0.2, 0.3, 6))
    copy = moe_generation_copy(model, model.state_dict(), dtype=torch.bfloat16)
    assert isinstance(copy, Qwen3MoeForCausalLM) and copy is not model
    assert torch.equal(getattr(copy.layers[2].mlp.gate, BIAS), getattr(model.layers[2].mlp.gate, BIAS))
    assert torch.equal(copy.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


def test_each_load_of_a_fresh_copy_hands_the_sampler_the_routers_current_biases():
    """Where every load makes a fresh copy (a sharded model, another dtype), the sampler's model
    takes the copy's values in place: its buffers too, or it routes by the bias of the first load
    (GRPO under FSDP: exit 5 at step 2 under determinism.batch_invariant, 2 of 12 tokens apart)."""
    from training.rollout.generator import Generator

    model = models.build(moe_config(bias_update_rate=0.01), generator=torch.Generator().manual_seed(2))
    generator = Generator(rows=2, max_len=16, seed=0, dtype=torch.float64)  # a fresh copy at each load
    generator.load(model)
    kept = generator._sampler.model
    with torch.no_grad():  # an update moved the bias (Qwen3MoeForCausalLM.after_update)
        getattr(model.layers[2].mlp.gate, BIAS).copy_(torch.linspace(-0.2, 0.3, 6))
    generator.load(model)
    assert generator._sampler.model is kept  # the sampler keeps its model (and its compiled graphs)
    assert torch.equal(getattr(kept.layers[2].mlp.gate, BIAS),
                       getattr(model.layers[2].mlp.gate, BIAS).to(getattr(kept.layers[2].mlp.gate, BIAS).dtype))


def test_a_family_that_does_not_fold_adapters_refuses_a_model_with_them():
    tuned = models.build(QWEN3, generator=torch.Generator().manual_seed(5))
    apply_lora(tuned, LoRAConfig(rank=4, alpha=8.0, targets=("q_proj",)), seed=1)
    with pytest.raises(ConfigError, match="LoRA adapters") as error:
        generation_copy(tuned, tuned.state_dict(), model_class=QwenForCausalLM, build=empty_model, fold_lora=False)
    assert error.value.context["key"] == "model.lora.rank"


def test_another_class_and_a_state_with_unknown_tensors_are_refused():
    model = models.build(QWEN3, generator=torch.Generator().manual_seed(5))
    with pytest.raises(ConfigError, match="needs a Qwen3MoeForCausalLM") as error:
        moe_generation_copy(model, model.state_dict())
    assert error.value.context["key"] == "model.arch"
    state = {**model.state_dict(), "layers.0.extra.weight": torch.zeros(2)}
    with pytest.raises(ConfigError, match="unexpected: \\['layers.0.extra.weight'\\]"):
        generation_copy(model, state, model_class=QwenForCausalLM, build=empty_model, dtype=torch.bfloat16)


def test_init_draws_norms_one_biases_zero_and_refuses_what_it_cannot_fill():
    model = empty_model(QWEN3)
    init.init_weights(model, torch.Generator().manual_seed(1), std=0.02, norms=(RMSNorm,))
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    assert model.lm_head.weight is model.embed_tokens.weight or not model.dims.tie_embeddings
    again = empty_model(QWEN3)
    again.init_weights(torch.Generator().manual_seed(1))  # the method is the generic draw with the family's norms
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    with torch.device("meta"):
        meta = QwenForCausalLM(QWEN3)
    with pytest.raises(ValueError, match="meta device"):
        init.init_weights(meta, torch.Generator(), std=0.02, norms=(RMSNorm,))
