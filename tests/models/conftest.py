"""Tiny random Qwen2 and Qwen3 checkpoints written by transformers itself.

They are the reference the model is checked against: if our forward, key names or config
translation drift from transformers', the parity tests in test_hf_weights.py fail.

And the tiny model the sampler tests generate with (test_sampler.py, test_scheduler.py,
test_sampler_episodes.py: ``sampler_model``; on one intra-op thread, as every test process runs,
tests/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.sampler_model import build_sampler_model

VOCAB = 96


def _perturb(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Move norm weights off 1 and biases off 0, so a swapped or dropped one changes the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.2 * torch.randn(param.shape, generator=generator))


def _write_hf(model_cls, config, directory: Path, seed: int):
    # transformers initializes from the global RNG; fork it so the seed does not leak.
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config).eval()
    _perturb(model, torch.Generator().manual_seed(seed))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="session")
def qwen2_hf(tmp_path_factory):
    """(transformers model, directory): Qwen2 with q/k/v bias, untied head, GQA 4:2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=128,
    )
    directory = tmp_path_factory.mktemp("qwen2_hf")
    return _write_hf(Qwen2ForCausalLM, config, directory, seed=2), directory


@pytest.fixture(scope="session")
def qwen3_hf(tmp_path_factory):
    """(transformers model, directory): Qwen3 with q/k norm, head_dim 24 != 48/4, tied head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        max_position_embeddings=128,
    )
    directory = tmp_path_factory.mktemp("qwen3_hf")
    return _write_hf(Qwen3ForCausalLM, config, directory, seed=3), directory


@pytest.fixture
def token_ids():
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def sampler_model():
    return build_sampler_model().eval()
