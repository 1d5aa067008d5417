"""training/rollout/generation_model.py: the trained model, unwrapped where it was wrapped, as a plain
local copy for the Sampler (sharded models on two ranks: tests/models/test_sampler.py)."""

from __future__ import annotations

import pytest
import torch

import models
from core.exceptions import ConfigError
from models.generation.sampler import Sampler
from tests.models.sampler_model import QWEN3
from tests.models.test_sampler import _prompts
from training.rollout.generation_model import generation_model


@pytest.fixture(scope="module")
def model():
    return models.build(QWEN3, generator=torch.Generator().manual_seed(5)).eval()


def test_generation_model_of_a_plain_model_is_the_model_and_a_conversion_is_a_copy(model):
    assert generation_model(model) is model
    compiled = torch.compile(model)  # the wrapper is not run, only unwrapped
    assert generation_model(compiled) is model
    half = generation_model(model, dtype=torch.bfloat16)
    assert half is not model and half.embed_tokens.weight.dtype == torch.bfloat16
    assert half.lm_head.weight is half.embed_tokens.weight  # tied again
    assert torch.equal(half.layers[1].mlp.up_proj.weight, model.layers[1].mlp.up_proj.weight.to(torch.bfloat16))
    with pytest.raises(ConfigError, match="plain, unsharded generation model"):
        Sampler(compiled, max_batch=2, max_len=8)


def test_generation_model_folds_lora_adapters_into_the_weights(model):
    from models.lora import apply_lora, merge_lora
    from core.config import LoRAConfig

    tuned = models.build(QWEN3, generator=torch.Generator().manual_seed(5))
    apply_lora(tuned, LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj")), seed=1)
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))  # B starts at 0: move it
    local = generation_model(tuned)
    assert local is not tuned and not any("lora" in n for n, _ in local.named_parameters())
    reference = merge_lora(tuned)
    inputs = torch.tensor([_prompts((10,))[0]])
    with torch.no_grad():
        assert torch.equal(local(inputs), reference(inputs))
        assert not torch.equal(local(inputs), model(inputs))  # the adapters changed the model


WRAPPER_NAMES = ("DistributedDataParallel", "_orig_mod", "_checkpoint_wrapped_module", "get_model_state_dict",
                 "fully_shard", "FSDPModule")


def test_models_know_nothing_of_the_wrappers_above_them():
    """Unwrapping DDP, compile and checkpoint wrappers is done by the layers that apply them."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spelled = [f"{path.relative_to(root)}: {name}" for path in sorted((root / "models").rglob("*.py"))
               for name in WRAPPER_NAMES if name in path.read_text()]
    assert not spelled, "models/ unwraps what distributed/ wrapped:\n" + "\n".join(spelled)
