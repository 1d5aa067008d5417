"""training/ reads module names from the model's parallel plan (core/model_plan.py), never spells them:
the optimizer's head role, a frozen model's output weight, replay's per-layer dump."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import models
from core.config import ModelConfig
from core.model_plan import ModelParallelPlan, Stack
from distributed.activation_checkpoint import apply_activation_checkpointing
from training.objectives.frozen import output_weight
from training.optimizers.build import parameter_roles
from training.record.replay import _layers

QWEN = ModelConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                   num_kv_heads=2, head_dim=8, tie_embeddings=False)


class Renamed(nn.Module):
    """A model whose modules carry none of the Qwen family's names, with its own plan."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(10, 4)
        self.trunk = nn.Module()
        self.trunk.cells = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.last = nn.LayerNorm(4)
        self.unembed = nn.Linear(4, 10, bias=False)
        self.lm_head = nn.Linear(4, 4, bias=False)  # a name the plan does not give the head

    @property
    def parallel_plan(self) -> ModelParallelPlan:
        return ModelParallelPlan(stacks=(Stack("trunk.cells"),), embedding="tokens", output="unembed",
                                 root_modules=("last",))


class Wrapper(nn.Module):
    """Adds a ``module.`` prefix to every name, as DDP does."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_the_head_role_goes_to_the_plans_output_under_any_prefix():
    roles = {name: role for name, (role, _) in parameter_roles(Renamed()).items()}
    assert roles["unembed.weight"] == "head" and roles["lm_head.weight"] == "matrix"
    assert roles["tokens.weight"] == "embedding" and roles["last.weight"] == "vector"
    wrapped = {name: role for name, (role, _) in parameter_roles(Wrapper(models.build(QWEN))).items()}
    assert wrapped["module.lm_head.weight"] == "head"
    assert [name for name, role in wrapped.items() if role == "head"] == ["module.lm_head.weight"]


def test_a_frozen_models_output_weight_is_its_plans_output():
    model = Renamed()
    assert output_weight(model) is not model.unembed.weight  # detached
    assert torch.equal(output_weight(model), model.unembed.weight)


def test_replay_dumps_the_plans_modules_by_their_names():
    model = models.build(QWEN)
    apply_activation_checkpointing(model, "selective")
    # What replay dumped before the plan named them: the embedding, each block, final norm, head.
    spelled = [name for name, _ in model.named_modules()
               if name.rsplit(".", 1)[-1] in ("embed_tokens", "norm", "lm_head") or name.split(".")[-2:-1] == ["layers"]]
    assert sorted(name for name, _ in _layers(model)) == sorted(spelled)
    assert sorted(name for name, _ in _layers(Wrapper(model))) == sorted(f"module.{name}" for name in spelled)
    layers = dict(_layers(Renamed()))
    assert list(layers) == ["tokens", "trunk.cells.0", "trunk.cells.1", "last", "unembed"]
    tied = models.build(dataclasses.replace(QWEN, tie_embeddings=True))
    assert dict(_layers(tied))["lm_head"] is tied.lm_head
