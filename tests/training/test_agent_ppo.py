"""PPO on episodes (training/objectives/ppo.py with objective.ppo.environment, played through
training/rollout/agent.py as GRPO's are): the rollout batch trains exactly the sampled ids of every
turn; the policy's logits and the critic's values at observation, prompt and pad positions get
exactly zero gradient; GAE runs over the sampled tokens as if the observations were not there; the
KL, the loss's count and the length statistics count sampled tokens only; the ledger's episode
fields and the step's episode record; the held-out evaluation plays episodes; a failing environment is the runner's typed error; the
settings are checked and hashed only when set."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
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
from training.objectives.ppo import CRITIC, PPOObjective
from training.objectives.ppo_loss import gae, kl_estimate, token_rewards
from training.rollout.environment import EnvironmentFailure, batch_tasks
from training.rollout.episode_store import read_episodes
from training.rollout.rewards import exact_answer
from tests import launch
from tests.agent_runs import assert_trains_the_sampled_ids
from tests.scripted_episodes import CALL, script_sampler

PROMPTS, G = 4, 2
SCRIPT = {(0, "ppo"): CALL, (0, "ppo.turn1"): "36<|im_end|>", (1, "ppo"): "x5<|im_end|>"}
PPO_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-ppo.yaml"
SETTINGS = ("parallel.strategy=none", f"train.global_batch_size={PROMPTS}", f"objective.ppo.group_size={G}",
            "objective.ppo.max_new_tokens=96", "data.seq_len=320", "objective.ppo.ppo_epochs=1",
            "objective.ppo.minibatches=1", "objective.ppo.rewards=[{name: format_regex, pattern: '3.', weight: 1.0}]")


pytestmark = pytest.mark.usefixtures("in_tasks_workdir")


def _config(overrides=()):
    return load(PPO_CONFIG, [*SETTINGS, "objective.ppo.environment.name=calculator",
                             "objective.ppo.environment.max_observation_tokens=128", *overrides])


def _objective(tmp_path, overrides=()):
    """PPO set up on one rank (its critic built), the policy another seed's weights than the
    reference's (so the KL is not zero), and its sampler scripted (``SCRIPT``: sample 0 calls the
    calculator, then answers "36", reward 1; sample 1 answers "x5" at once, reward 0)."""
    config = _config(overrides)
    model = models.build(config.model, generator=seeding.generator(5, "model_init"))
    dist = SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=torch.device("cpu"), backend="gloo",
                           all_gather_object=lambda obj: [obj], is_main=True)
    context = ObjectiveContext(config=config, dist=dist, parallel=SimpleNamespace(device=dist.device),
                               place=lambda t: t, run_dir=tmp_path)
    objective = PPOObjective(config)
    objective.setup(model, context)
    critic = objective.extra_parts(context)[CRITIC].module
    handed = script_sampler(objective, SCRIPT)
    return objective, model, critic, handed, config


def _prompts(config):
    plan = make_plan(config.data, seed=config.train.seed, global_batch_size=PROMPTS, rank=0, world_size=1)
    return next(iterate_serial(plan))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tasks_workdir):
    """One prepared rollout batch of scripted episodes (``_objective``), shared by the tests that only read it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tasks_workdir)
        objective, model, critic, handed, config = _objective(tmp_path_factory.mktemp("agent-ppo-run"))
        with torch.no_grad():
            batch = objective.prepare(_prompts(config))
    return objective, model, critic, batch, handed


def test_the_batch_trains_the_sampled_ids_of_every_turn_and_nothing_else(prepared):
    objective, _, _, batch, handed = prepared
    trajectories = batch.prepared.experience.trajectories
    assert_trains_the_sampled_ids(batch, trajectories, handed, purpose="ppo", group_size=G,
                                  zero_off_labels=("old_logps", "old_values", "advantages"))
    first = trajectories[0]
    observation = objective.agent.observation_ids([{"role": "tool", "content": "36"}])
    assert list(first.episode.turns[0].observation) == observation
    assert first.tokens == handed[(0, 0, "ppo")] + observation + handed[(0, 0, "ppo.turn1")]
    assert [t.reward for t in trajectories] == [1.0, 0.0] * PROMPTS


def test_gae_runs_over_the_sampled_tokens_as_if_the_observations_were_not_there(prepared):
    objective, _, _, batch, _ = prepared
    p = objective.p
    mask = batch.labels != IGNORE_INDEX
    episode = 0  # sample 0 of prompt 0: two turns with an observation between them
    assert batch.prepared.experience.trajectories[episode].episode.turns[0].observation
    positions = mask[episode].nonzero().squeeze(1)
    assert int(positions[-1] - positions[0]) + 1 > len(positions)  # the sampled tokens are not contiguous
    # the same row with its observations (and prompt and padding) cut out: one contiguous response
    values = batch.extras["old_values"][episode, positions][None]
    returns = batch.extras["returns"][episode, positions][None]
    logps = batch.extras["old_logps"][episode, positions][None]
    first = batch.select(list(range(objective.config.train.micro_batch_size)))  # prepare's first micro-batch
    reference = objective._each_micro(first, lambda placed: objective._token_logps(objective.reference.module, placed))
    ref = reference[episode, positions][None]  # computed as prepare does, on the same rows
    kl = kl_estimate(logps, ref, p.kl_estimator)
    score = torch.tensor([batch.prepared.experience.trajectories[episode].reward], dtype=torch.float32)
    compact = torch.ones_like(values, dtype=torch.bool)
    _, expected = gae(token_rewards(kl, score, compact, batch.prepared.kl_coef), values, compact,
                      gamma=p.gamma, lam=p.lam)
    assert torch.equal(returns, expected)
    # the row's KL, which the ledger's kl averages: its sampled tokens' alone (0 at the observations)
    row_kl = torch.zeros(batch.labels.shape[1]).index_put((positions,), kl[0])
    assert batch.prepared.rows[episode][1] == float(row_kl.sum()) != 0.0


def test_observation_prompt_and_pad_positions_get_exactly_zero_gradient(prepared):
    objective, model, critic, batch, _ = prepared
    batch = batch.select([0, 1])  # prompt 0's episodes: sample 0 with an observation, sample 1 without
    kept = {}
    hooks = [model.lm_head.register_forward_hook(lambda module, inputs, out: kept.update(logits=out)),
             critic.register_forward_hook(lambda module, inputs, out: kept.update(values=out))]
    try:
        output = objective.loss(model, batch, {CRITIC: critic})
        for name in ("logits", "values"):
            kept[name].retain_grad()
        output.sum.backward()
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
        critic.zero_grad(set_to_none=True)
    untrained = batch.labels == IGNORE_INDEX
    assert untrained.any() and (~untrained).any()
    assert output.count == int((~untrained).sum())  # the loss is divided by the sampled tokens
    for name in ("logits", "values"):  # logits (B, T, V), values (B, T); position t predicts labels[t]
        grad = kept[name].grad
        assert torch.count_nonzero(grad[untrained]) == 0, name
        assert torch.count_nonzero(grad[~untrained]) > 0, name


def test_the_ledger_has_the_episode_fields_and_rank_0_records_the_episodes(prepared):
    objective, _, _, batch, handed = prepared
    sampled = [t.sampled for t in batch.prepared.experience.trajectories]
    assert sampled == [sum(t.episode.mask) for t in batch.prepared.experience.trajectories]
    totals = {name: 0.0 for name in ("policy_loss", "value_loss", "clip_fraction", "value_clip_fraction",
                                     "approx_kl", "dual_clip_fraction")}
    fields = objective.ledger_fields(batch, totals, sum(sampled))
    assert fields["completion_len_mean"] == sum(sampled) / len(sampled)
    assert fields["turns_mean"] == 1.5 and fields["tool_calls"] == PROMPTS and fields["malformed_calls"] == 0
    assert fields["env_errors"] == 0 and len(fields["episodes_hash"]) == 64
    assert fields["kl"] == float(np.mean([row[1] for row in batch.prepared.rows]))
    recorded = read_episodes(objective._context.run_dir, batch.step, G)
    assert recorded[(0, 0)]["turns"][0]["sampled"] == handed[(0, 0, "ppo")]
    assert recorded[(0, 0)]["turns"][0]["calls"] == ["calculator"]


def test_the_held_out_evaluation_plays_the_episodes_greedily(tmp_path):
    objective, _, _, _, config = _objective(tmp_path)
    handed = script_sampler(objective, {(0, "ppo-eval"): CALL, (0, "ppo-eval.turn1"): "36<|im_end|>"})
    prompts = _prompts(config).for_evaluation()
    with torch.no_grad():
        scored = objective.prepare(prompts)
    assert sorted(handed) == sorted((i, 0, purpose) for i in range(PROMPTS) for purpose in ("ppo-eval", "ppo-eval.turn1"))
    assert scored.extras["eval_reward"].tolist() == [1.0] * PROMPTS  # the last turn's "36" matches '3.'
    answers = [task.answer for task in batch_tasks(prompts, objective.tokenizer)]
    assert scored.extras["eval_exact"].tolist() == [exact_answer("36", answer) for answer in answers]


def test_a_failing_environment_stops_ppo_with_the_runners_typed_error(tmp_path):
    objective, _, _, _, config = _objective(
        tmp_path, ["objective.ppo.environment.name=tests.agent_environment:CrashingCalculator"])
    with pytest.raises(EnvironmentFailure) as caught, torch.no_grad():
        objective.prepare(_prompts(config))
    message = str(caught.value)
    assert "environment 'tests.agent_environment:CrashingCalculator' raised RuntimeError: the calculator crashed" \
        in message
    assert "step 1, prompt row 0, sample 0" in message and "turn 0" in message
    assert "objective.ppo.environment.on_env_error=zero" in caught.value.hint
    assert caught.value.exit_code == 3


def test_environment_settings_are_checked_and_hashed_only_when_set():
    assert load(PPO_CONFIG).objective.ppo.environment is None
    assert config_hash(_config()) != config_hash(load(PPO_CONFIG, list(SETTINGS)))
    for override, key in (("objective.ppo.environment.max_turns=0", "objective.ppo.environment.max_turns"),
                          ("objective.ppo.environment.max_episode_tokens=8",
                           "objective.ppo.environment.max_episode_tokens"),
                          ("objective.ppo.rewards=[{name: model, path: run:rm, weight: 1.0}]", "objective.ppo.rewards")):
        with pytest.raises(ConfigError) as caught:
            _config([override])
        assert caught.value.context["key"] == key
    for name, what in (("search", "unknown environment"), ("no_such_package.tools:Env", "does not import")):
        with pytest.raises(ConfigError, match=what) as caught:
            PPOObjective.check_config(_config([f"objective.ppo.environment.name={name}"]))
        assert caught.value.context["key"] == "objective.ppo.environment.name"
