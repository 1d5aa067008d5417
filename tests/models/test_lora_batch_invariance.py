"""LoRA under ``determinism.batch_invariant``: the sampler's log-probs are the trainer's, bit for bit.

The trainer computes a wrapped linear as ``base(x) + scaling * B(A(x))``, every matmul the invariant
``linear`` (models/batch_invariant.py). Outside ``batch_invariant`` the generation copy folds the
adapters into its base weights, ``(W + scaling * B @ A) x``, another computation; under it the copy
keeps them unmerged (``Numerics.merges_adapters``), each part in the trainer's dtype
(``Numerics.unmerged_dtype``), so the chain holds: the Sampler's log-probs == the trainer's fused head,
in fp32 and in bf16 (the trainer's autocast, the frozen base stored in bf16 as a bf16 run stores it;
Qwen2 for the projections' biases). The control: the merged copy computes other bits. A GRPO step on the
e2e config's tiny model with adapters: logprob_parity 0 in fp32 and bf16. A dropout on the adapters is
refused at load (the trainer's forward would drop what the sampler's does not).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import models
from core import seeding
from core.config import LoRAConfig, load
from core.exceptions import ConfigError
from data.batch import IGNORE_INDEX
from data.pipeline.plan import make_plan
from data.pipeline.serial import iterate_serial
from models.lora import LoRALinear, add_adapters, apply_lora, lora_modules, merge_lora, store_base_as
from models.numerics import Numerics
from training.determinism import numerics
from training.objectives import grpo
from training.objectives.logprob_parity import PARITY
from training.precision import Precision
from training.rollout.generation_model import generation_model
from tests.models.test_batch_invariance import (BF16, CPU, EXACT, PROMPT_LENGTHS, QWEN2, QWEN3, SAMPLED, _ids, _model,
                                                _run, _sample, _trainer_logps)
from tests.training.test_logprob_parity import CONFIGS, GRPO, _context

LORA = LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))


def _lora_model(config, numerics: Numerics) -> torch.nn.Module:
    """A tiny model with adapters whose update is not zero (B drawn, as after some training)."""
    model = _model(config, numerics)
    apply_lora(model, LORA, seed=0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in lora_modules(model):
            module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=generator) * 0.2)
    if numerics.frozen_base_dtype is not None:
        store_base_as(model, numerics.frozen_base_dtype)
    return model.eval()


def _prompts(ids: torch.Tensor) -> list[list[int]]:
    return [ids[i, :n].tolist() for i, n in enumerate(PROMPT_LENGTHS)]


CASES = [pytest.param(QWEN3, EXACT, id="qwen3-fp32"), pytest.param(QWEN2, EXACT, id="qwen2-fp32"),
         pytest.param(QWEN3, BF16, id="qwen3-bf16"), pytest.param(QWEN2, BF16, id="qwen2-bf16")]


@pytest.mark.parametrize("model_config, numerics", CASES)
def test_the_sampler_s_unmerged_adapters_give_the_trainer_s_log_probs(model_config, numerics):
    model, ids = _lora_model(model_config, numerics), _ids()
    copy = generation_model(model)
    wrapped = lora_modules(copy)
    assert copy is not model and len(wrapped) == len(lora_modules(model)) == 8  # 4 targets x 2 layers
    for kept, trained in zip(wrapped, lora_modules(model)):  # each part in the trainer's dtype
        assert kept.lora_A.weight.dtype == trained.lora_A.weight.dtype == torch.float32
        assert kept.base_layer.weight.dtype == trained.base_layer.weight.dtype
    prompts = _prompts(ids)
    samples = _sample(copy, prompts, SAMPLED, max_batch=4)
    assert sum(len(s.tokens) for s in samples) > 40
    for trainer, sample in zip(_trainer_logps(model, prompts, samples, numerics), samples):
        assert torch.equal(trainer, torch.tensor(sample.logprobs, dtype=torch.float32))


def test_control_the_merged_weights_compute_other_bits():
    """The copy outside ``batch_invariant`` (merged) is no longer the trainer's forward under the kernels."""
    model, ids = _lora_model(QWEN3, EXACT), _ids()
    merged = merge_lora(model)
    assert not lora_modules(merged)
    with torch.no_grad():
        trainer, folded = _run(model, ids), _run(merged, ids)
    torch.testing.assert_close(folded, trainer, rtol=0, atol=1e-4)
    assert not torch.equal(folded, trainer)
    assert Numerics().merges_adapters and not EXACT.merges_adapters
    assert not lora_modules(generation_model(_lora_model(QWEN3, Numerics())))  # the default mode still merges


def test_where_fsdp_casts_the_parameters_the_copy_s_adapters_are_bf16_too():
    """Under FSDP2's bf16 policy the trainer's adapters compute in bf16 (cast with every parameter, no
    autocast): the copy holds them in bf16 as it holds the rest."""
    cast = dataclasses.replace(BF16, wrapper_casts=True)
    copy = generation_model(_lora_model(QWEN3, cast))
    for module in lora_modules(copy):
        assert isinstance(module, LoRALinear)
        assert module.lora_A.weight.dtype == module.base_layer.weight.dtype == torch.bfloat16
    assert copy.embed_tokens.weight.dtype == torch.bfloat16


LORA_GRPO = [*GRPO, "model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q_proj,v_proj,down_proj]"]


def _lora_grpo(config):
    """``test_logprob_parity``'s GRPO set-up with the run's adapters added as training/builders.py adds
    them, B drawn before the rollouts (so the update is not zero)."""
    model = models.build(config.model, generator=seeding.generator(config.train.seed, "model_init"))
    run_numerics = numerics(config)
    model.use_numerics(run_numerics)
    add_adapters(model, config.model, seed=config.train.seed, base_dtype=run_numerics.frozen_base_dtype)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in lora_modules(model):
            module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=generator) * 0.1)
    objective = grpo.GRPOObjective(config)
    objective.setup(model, _context(config))
    plan = make_plan(config.data, seed=config.train.seed, global_batch_size=config.train.global_batch_size,
                     rank=0, world_size=1)
    with torch.no_grad():
        batch = objective.prepare(next(iterate_serial(plan)))
    return model, objective, batch


@pytest.mark.usefixtures("in_tasks_workdir")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lora_grpo_parity_is_exactly_zero(precision):
    """A GRPO step's rollouts from the e2e config's tiny model with adapters: the first update's parity is
    0 (the step's autocast, as training/step.py enters it)."""
    config = load(CONFIGS / "e2e-grpo.yaml", [*LORA_GRPO, f"parallel.precision={precision}"])
    model, objective, batch = _lora_grpo(config)
    assert (batch.labels != IGNORE_INDEX).any()
    with Precision(model.numerics, device=CPU, wrapper_casts=False).autocast():
        assert objective.loss(model, batch).maxima[PARITY].item() == 0.0


def test_adapter_dropout_is_refused_under_batch_invariant():
    with pytest.raises(ConfigError, match="model.lora.dropout") as info:
        load(CONFIGS / "e2e-grpo.yaml", [*LORA_GRPO, "model.lora.dropout=0.1"])
    assert info.value.context["key"] == "model.lora.dropout"
    load(CONFIGS / "e2e-grpo.yaml", [*LORA_GRPO, "model.lora.dropout=0.1", "determinism.batch_invariant=false"])
