"""GRPO on episodes (training/objectives/grpo.py with objective.grpo.environment): the rollout
batch trains exactly the sampled ids of every turn; the logits at observation, prompt and pad
positions get exactly zero gradient; the loss normalizer, the KL terms and the length statistics
count sampled tokens only; the ledger's episode fields and the step's episode record; the
environment settings are checked and hashed only when set."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import models
from core import seeding
from core.config import config_hash, load
from core.exceptions import ConfigError
from data.batch import IGNORE_INDEX
from data.pipeline.plan import make_plan
from data.pipeline.serial import iterate_serial
from training.objectives.base import ObjectiveContext
from training.objectives.grpo import PARITY, GRPOObjective
from training.objectives.grpo_loss import SurrogateSettings, loss_count, per_token_loss
from training.rollout.episode_store import episodes_path, read_episodes
from tests import launch
from tests.agent_runs import assert_trains_the_sampled_ids
from tests.scripted_episodes import CALL, script_sampler

PROMPTS, G = 4, 2


pytestmark = pytest.mark.usefixtures("in_tasks_workdir")


def _config(overrides=()):
    return load(launch.ROOT / "tests" / "configs" / "e2e-grpo.yaml", [
        "objective.grpo.kl_coef=0", "parallel.strategy=none", f"train.global_batch_size={PROMPTS}",
        f"objective.grpo.group_size={G}", "objective.grpo.max_new_tokens=96", "data.seq_len=320",
        "objective.grpo.rewards=[{name: format_regex, pattern: '3.', weight: 1.0}]",
        "objective.grpo.environment.name=calculator", "objective.grpo.environment.max_observation_tokens=128",
        *overrides])


def _prepared(tmp_path, overrides=()):
    """A prepared rollout batch whose episodes are scripted: sample 0 calls the calculator, then
    answers "36" (reward 1); sample 1 answers "x5" at once (reward 0)."""
    config = _config(overrides)
    model = models.build(config.model, generator=seeding.generator(5, "model_init")).double()
    dist = SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=torch.device("cpu"), backend="gloo",
                           all_gather_object=lambda obj: [obj], is_main=True)
    objective = GRPOObjective(config)
    objective.setup(model, ObjectiveContext(config=config, dist=dist, parallel=SimpleNamespace(device=dist.device),
                                            place=lambda t: t, run_dir=tmp_path))
    handed = script_sampler(objective, {(0, "grpo"): CALL, (0, "grpo.turn1"): "36<|im_end|>",
                                        (1, "grpo"): "x5<|im_end|>"})
    plan = make_plan(config.data, seed=config.train.seed, global_batch_size=PROMPTS, rank=0, world_size=1)
    with torch.no_grad():
        batch = objective.prepare(next(iterate_serial(plan)))
    return objective, model, batch, handed


def test_the_rollouts_count_their_episodes_on_rank_0s_progress(tmp_path, monkeypatch):
    """``step 1 rollouts: 3/8 episodes, ...``: each episode counted once, when it ends (sample 1 of
    every prompt at its first turn, sample 0 at its second)."""
    from experiments.console import Progress
    from training.objectives import grpo
    from training.rollout.group import rollout_progress

    made, counts = [], []

    def progress(step, prompts, group_size, *, episodes, enabled):
        made.append(rollout_progress(step, prompts, group_size, episodes=episodes, enabled=enabled))
        made[-1].advance = counts.append  # the episodes ended at each refill point, in order
        return made[-1]

    monkeypatch.setattr(grpo, "rollout_progress", progress)
    _prepared(tmp_path)
    (shown,) = made
    assert isinstance(shown, Progress) and shown.enabled
    assert (shown.label, shown.total, shown.unit) == ("step 1 rollouts", PROMPTS * G, "episodes")
    assert counts == [PROMPTS, PROMPTS]


def test_the_batch_trains_the_sampled_ids_of_every_turn_and_nothing_else(tmp_path):
    objective, _, batch, handed = _prepared(tmp_path)
    experience = batch.prepared
    assert_trains_the_sampled_ids(batch, experience.trajectories, handed, purpose="grpo", group_size=G,
                                  zero_off_labels=("old_logps",))
    first = experience.trajectories[0]
    assert first.episode is not None and len(first.episode.turns) == 2
    observation = objective.agent.observation_ids([{"role": "tool", "content": "36"}])
    assert list(first.episode.turns[0].observation) == observation
    assert first.tokens == handed[(0, 0, "grpo")] + observation + handed[(0, 0, "grpo.turn1")]
    assert [t.reward for t in experience.trajectories] == [1.0, 0.0] * PROMPTS


def test_observation_prompt_and_pad_logits_get_exactly_zero_gradient(tmp_path):
    objective, model, batch, _ = _prepared(tmp_path)
    kept = {}
    handle = model.lm_head.register_forward_hook(lambda module, inputs, out: kept.update(logits=out))
    try:
        output = objective.loss(model, batch)
        logits = kept["logits"]
        logits.retain_grad()
        output.sum.backward()
    finally:
        handle.remove()
    grad = logits.grad  # (B, T, V); position t predicts labels[t]
    untrained = batch.labels == IGNORE_INDEX
    assert untrained.any() and (~untrained).any()
    assert torch.count_nonzero(grad[untrained]) == 0
    assert torch.count_nonzero(grad[~untrained]) > 0


def test_loss_kl_and_length_statistics_count_sampled_tokens_only(tmp_path):
    objective, _, batch, handed = _prepared(tmp_path)
    sampled = [sum(t.episode.mask) for t in batch.prepared.trajectories]
    mask = batch.labels != IGNORE_INDEX
    assert mask.sum(dim=1).tolist() == sampled
    assert loss_count(mask, "token", max_new_tokens=objective.slots) == sum(sampled)
    assert objective.slots == objective.g.environment.max_episode_tokens
    old = batch.extras["old_logps"]
    logps = old + 0.1 * mask
    ref = torch.full_like(old, -3.0)  # a reference far from the policy everywhere, masked or not
    loss, terms = per_token_loss(logps, old, ref, batch.extras["advantages"], mask,
                                 SurrogateSettings(0.2, 0.2, 0.1, "token", "token"))
    assert torch.count_nonzero(loss[~mask]) == 0 and torch.count_nonzero(terms["kl"][~mask]) == 0
    assert torch.count_nonzero(terms["kl"][mask]) == int(mask.sum())
    fields = objective.ledger_fields(batch, {PARITY: 0.0}, 0)
    assert fields["completion_len_mean"] == sum(sampled) / len(sampled)
    assert fields["turns_mean"] == 1.5 and fields["tool_calls"] == PROMPTS and fields["malformed_calls"] == 0
    assert fields["env_errors"] == 0 and len(fields["episodes_hash"]) == 64
    recorded = read_episodes(tmp_path, batch.step, G)
    assert episodes_path(tmp_path, batch.step).is_file()
    assert recorded[(0, 0)]["turns"][0]["sampled"] == handed[(0, 0, "grpo")]
    assert recorded[(0, 0)]["turns"][0]["calls"] == ["calculator"]


def test_environment_settings_are_checked_and_hashed_only_when_set():
    plain = load(launch.ROOT / "tests" / "configs" / "e2e-grpo.yaml")
    assert plain.objective.grpo.environment is None
    with_env = _config()
    assert config_hash(with_env) != config_hash(load(launch.ROOT / "tests" / "configs" / "e2e-grpo.yaml", [
        "objective.grpo.kl_coef=0", "parallel.strategy=none", f"train.global_batch_size={PROMPTS}",
        f"objective.grpo.group_size={G}", "objective.grpo.max_new_tokens=96", "data.seq_len=320",
        "objective.grpo.rewards=[{name: format_regex, pattern: '3.', weight: 1.0}]"]))
    for override, key in (("objective.grpo.environment.max_turns=0", "objective.grpo.environment.max_turns"),
                          ("objective.grpo.environment.tool_timeout_s=0", "objective.grpo.environment.tool_timeout_s"),
                          ("objective.grpo.environment.max_episode_tokens=8",
                           "objective.grpo.environment.max_episode_tokens"),
                          ("objective.grpo.dynamic_sampling_rounds=1", "objective.grpo.dynamic_sampling_rounds")):
        with pytest.raises(ConfigError) as caught:
            _config([override])
        assert caught.value.context["key"] == key
    with pytest.raises(ConfigError, match="unknown environment"):
        GRPOObjective.check_config(_config(["objective.grpo.environment.name=search"]))


def test_episode_fields_count_rows_held_by_tensor_parallel_peers_once(tmp_path):
    objective, _, batch, _ = _prepared(tmp_path)
    summary = batch.prepared.summary()
    once = objective.ledger_fields(batch, {PARITY: 0.0}, 0)
    objective._context.dist.all_gather_object = lambda obj: [obj, summary]  # a peer with the same rows
    assert objective.ledger_fields(batch, {PARITY: 0.0}, 0) == once
