"""PPO's objective (training/objectives/ppo.py) apart from the loop: its settings' checks, the
critic (critic.py), the keyed minibatches each update trains on, the whitening over every rank's
rows, and the KL coefficient's checkpointed state. The formulas themselves: test_ppo_formulas.py;
the method end to end: test_ppo_e2e.py."""

from __future__ import annotations

import math

import pytest
import torch

import models
from models.forward import ModelInputs
from core import config as config_lib
from core import seeding
from core.exceptions import CheckpointError, ConfigError
from data.batch import IGNORE_INDEX, Batch
from training.objectives.critic import build_critic
from training.objectives.ppo import PPOObjective, PPORollout
from training.objectives.ppo_loss import minibatch_order, whiten

PROMPTS = {"sources": [{"path": "datasets/tasks/rl/train", "record": "prompt"}], "num_streams": 4}


def ppo_config(ppo: dict | None = None, *, model: dict | None = None, train: dict | None = None):
    raw = {"objective": {"kind": "ppo", "ppo": ppo or {}}, "data": PROMPTS,
           "train": {"global_batch_size": 4, "micro_batch_size": 2, **(train or {})},
           **({"model": model} if model else {})}
    config = config_lib.from_dict(raw)
    config_lib.validate(config)
    return config


def test_ppo_settings_are_checked_naming_the_key():
    ppo_config({"ppo_epochs": 2, "minibatches": 4, "dual_clip": 3.0, "kl_target": 0.1})
    bad = [({"minibatches": 3}, "minibatches"), ({"dual_clip": 1.0}, "dual_clip"), ({"gamma": 1.5}, "gamma"),
           ({"kl_coef": 0.0, "kl_target": 0.1}, "kl_coef"), ({"value_clip": 0.0}, "value_clip"),
           ({"kl_estimator": "k4"}, "kl_estimator"), ({"ppo_epochs": 0}, "ppo_epochs")]
    for ppo, key in bad:
        with pytest.raises(ConfigError) as info:
            ppo_config(ppo)
        assert info.value.context["key"] == f"objective.ppo.{key}"
    with pytest.raises(ConfigError) as info:  # PPO rolls out prompt records only
        config = config_lib.from_dict({"objective": {"kind": "ppo"},
                                       "data": {"sources": [{"path": "x.jsonl", "record": "chat"}]}})
        config_lib.validate(config)
    assert info.value.context["key"] == "data.sources"


def test_a_critic_path_that_does_not_exist_is_a_config_error(tmp_path):
    config = ppo_config({"critic": str(tmp_path / "missing")})
    with pytest.raises(ConfigError) as info:
        PPOObjective.check_config(config)
    assert info.value.context["key"] == "objective.ppo.critic"
    with pytest.raises(ConfigError) as info:
        PPOObjective.check_config(ppo_config({"critic": "run:no-such-run"}))
    assert info.value.context["key"] == "objective.ppo.critic"


@pytest.mark.parametrize("tied", [True, False])
def test_the_critic_starts_as_the_policy_with_a_zero_value_head(tied):
    config = ppo_config(model={"tie_embeddings": tied, "num_layers": 1, "hidden_size": 32, "num_heads": 2,
                               "num_kv_heads": 1, "intermediate_size": 64})
    critic = build_critic(config)
    policy = models.build(config.model, generator=seeding.generator(config.train.seed, "model_init"))
    for (name, mine), (_, theirs) in zip(critic.trunk.state_dict().items(), policy.state_dict().items()):
        assert torch.equal(mine, theirs), name
    ids = torch.tensor([[1, 2, 3, 4]])
    values = critic(ModelInputs(ids, torch.arange(4)[None], torch.zeros_like(ids)))
    assert values.shape == (1, 4) and values.dtype == torch.float32 and torch.equal(values, torch.zeros(1, 4))
    # the output projection is never used: trained only where it is the embedding
    assert critic.trunk.lm_head.weight.requires_grad == tied
    values.sum().backward()
    assert critic.value_head.weight.grad is not None


def minibatch_objective(minibatches: int, epochs: int = 2) -> PPOObjective:
    return PPOObjective(ppo_config({"group_size": 2, "minibatches": minibatches, "ppo_epochs": epochs}))


def rows_batch(rows: list[int], layout: tuple[tuple[int, ...], ...], step: int = 3) -> Batch:
    n = len(rows)
    ids = torch.arange(n * 4).reshape(n, 4)
    return Batch(step=step, input_ids=ids, labels=ids.clone(), position_ids=torch.arange(4).expand(n, 4).clone(),
                 document_ids=torch.zeros(n, 4, dtype=torch.int64), sequence_index=list(rows),
                 provenance=[[] for _ in rows], state={},
                 extras={"advantages": torch.tensor(rows, dtype=torch.float32)[:, None].expand(n, 4).clone()},
                 prepared=PPORollout(experience=None, kl_coef=0.0, rows=(), layout=layout))


def test_each_update_trains_its_keyed_minibatch_on_any_spread_of_rows():
    objective = minibatch_objective(minibatches=2)
    one = rows_batch(list(range(8)), layout=(tuple(range(8)),))
    rank_rows = ([0, 1, 2, 3], [4, 5, 6, 7])
    layout = tuple(tuple(r) for r in rank_rows)
    ranks = [rows_batch(r, layout=layout) for r in rank_rows]
    for update in range(objective.updates_per_batch):
        epoch, minibatch = divmod(update, 2)
        expected = sorted(minibatch_order(objective.config.train.seed, 3, epoch, 8)[minibatch * 4:(minibatch + 1) * 4])
        whole = objective.update_batch(one, update)
        assert whole.sequence_index == expected  # one rank: the minibatch's rows, in batch order
        shares = [objective.update_batch(b, update) for b in ranks]
        # every rank runs as many rows (padding without labels), together the minibatch's rows once
        assert len({len(s.sequence_index) for s in shares}) == 1
        trained = sorted(row for s in shares for row, labels in zip(s.sequence_index, s.labels)
                         if (labels != IGNORE_INDEX).any())
        assert trained == expected
        assert sum(objective.num_targets(s) for s in shares) == objective.num_targets(whole) == 16
        for share in shares:  # a row's extras travel with it
            kept = (share.labels != IGNORE_INDEX).any(dim=1)
            assert share.extras["advantages"][kept, 0].tolist() == [float(r) for r, k in
                                                                   zip(share.sequence_index, kept) if k]
    # the epochs see the rows in different orders, each row once per epoch
    first = [objective.update_batch(one, u).sequence_index for u in (0, 1)]
    second = [objective.update_batch(one, u).sequence_index for u in (2, 3)]
    assert sorted(first[0] + first[1]) == sorted(second[0] + second[1]) == list(range(8))
    assert first != second


def test_whitening_over_every_ranks_rows_is_the_whole_batchs():
    objective = minibatch_objective(minibatches=1, epochs=1)
    advantages = torch.tensor([[0.0, 1.0, 2.0, 0.0], [0.0, 5.0, -1.0, 3.0], [0.0, 0.5, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0]], dtype=torch.bool)
    expected = whiten(advantages, mask, eps=1e-8)
    gathered = [{2: [0.5], 0: [1.0, 2.0]}, {1: [5.0, -1.0, 3.0]}]  # two ranks' rows, any order
    assert torch.equal(objective._whiten(gathered, advantages, mask), expected)
    # by hand: values 1, 2, 5, -1, 3, 0.5: mean 1.75, unbiased variance 21.875 / 5
    assert expected[0, 1].item() == pytest.approx((1.0 - 1.75) / math.sqrt(21.875 / 5 + 1e-8), rel=1e-6)


def test_the_kl_coefficient_is_the_checkpointed_state():
    objective = PPOObjective(ppo_config({"kl_coef": 0.1, "kl_target": 1.0, "kl_horizon": 10}))
    objective.kl.update(2.0, samples=5)  # error clipped to 0.2: coef * (1 + 0.2 * 5 / 10)
    state = objective.state_dict()
    assert state["kl"]["coef"] == pytest.approx(0.1 * 1.1, abs=1e-15)
    resumed = PPOObjective(ppo_config({"kl_coef": 0.1, "kl_target": 1.0, "kl_horizon": 10}))
    resumed.load_state_dict(state)
    assert resumed.kl.coef == objective.kl.coef
    with pytest.raises(CheckpointError):
        resumed.load_state_dict({**state, "objective": "grpo"})
    with pytest.raises(CheckpointError):
        resumed.load_state_dict({**state, "version": state["version"] + 1})
