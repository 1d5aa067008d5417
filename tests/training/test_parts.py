"""training/parts.py: the policy and an objective's extra parts, each with its own optimizer,
learning-rate schedule and clipping; and the objective seam that declares them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from core.config import TrainConfig
from training.objectives.base import PartSpec, declared_parts
from training.objectives.causal_lm import CausalLMObjective
from training.optimizers.lion import Lion
from training.parts import POLICY, build_parts, grad_norm_field, param_hash_field

CPU = torch.device("cpu")
POLICY_TRAIN = TrainConfig(lr=1e-3, warmup_steps=4, max_steps=10, schedule="cosine", grad_clip=1.0)


def _parts(extra):
    return build_parts(nn.Linear(4, 4), POLICY_TRAIN, extra, device=CPU, wrap=lambda module: module)


def test_each_part_has_its_own_optimizer_schedule_and_clipping():
    value_train = dataclasses.replace(POLICY_TRAIN, optimizer="lion", lr=5e-2, schedule="constant", warmup_steps=0,
                                      grad_clip=0.25)
    value = nn.Linear(4, 1)
    parts = _parts({"value": PartSpec(module=value, train=value_train)})
    assert list(parts) == [POLICY, "value"]
    assert parts["value"].module is value and isinstance(parts["value"].optimizer, Lion)
    assert not isinstance(parts[POLICY].optimizer, Lion)
    owned = {id(p) for group in parts["value"].optimizer.param_groups for p in group["params"]}
    assert owned == {id(p) for p in value.parameters()}
    assert (parts[POLICY].grad_clip, parts["value"].grad_clip) == (1.0, 0.25)
    # Step 1: the policy warms up, the value part runs at its constant rate.
    assert parts[POLICY].set_lr(1) == pytest.approx(1e-3 / 4)
    assert parts["value"].set_lr(1) == 5e-2
    assert {g["lr"] for g in parts["value"].optimizer.param_groups} == {5e-2}
    assert (grad_norm_field("value"), param_hash_field("value")) == ("grad_norm_value", "param_hash_value")


@pytest.mark.parametrize("name", [POLICY, "Value", "2nd", "value-head", ""])
def test_a_part_name_must_be_a_lower_case_identifier_other_than_policy(name):
    with pytest.raises(ValueError, match="part names are lower-case identifiers"):
        _parts({name: PartSpec(module=nn.Linear(4, 1), train=POLICY_TRAIN)})


def test_an_objective_without_extra_parts_trains_the_policy_alone():
    class Critic(CausalLMObjective):
        def extra_parts(self, context):
            return {"critic": PartSpec(module=nn.Linear(4, 1), train=POLICY_TRAIN)}

        def loss(self, model, micro, parts):
            raise AssertionError("not called here")

    plain = CausalLMObjective.__new__(CausalLMObjective)
    assert declared_parts(plain, context=None) == {}
    assert list(declared_parts(Critic.__new__(Critic), context=None)) == ["critic"]
    assert list(_parts({})) == [POLICY]
