"""PPO with a trained reward model: as its reward and as its critic's starting point.

A 4-step reward-model run (tests/configs/e2e-rm.yaml) and its Hugging Face export are

- the critic's source (``objective.ppo.critic``): the critic's trunk is the reward model's and its
  value head the score head (bias 0), so before any update its value at a sequence's last token is
  the reward model's score of the sequence, from the run and from the export alike;
- a reward of the guarantee table's ``ppo-model-reward`` row (tests/methods.py,
  tests/reward_models.py: tests/configs/e2e-ppo.yaml, the export ``{name: model, path}`` beside
  exact_answer, 6 steps), whose checks on 2 CPU ranks are SIGKILL at random moments (in the
  rollouts, the scoring, between two of a step's four updates) + resume by run ID giving the ledger
  of an uninterrupted run, line for line, replay, the 1-rank resume keeping the ledger, the
  batches, the rollouts and the rewards, and micro-batch sizes 1 and 4 agreeing (a reward model's
  scores depend on neither: training/objectives/model_reward.py). This file reads the row's run:
  the score enters the completions' rewards and its identity (path and sha256) is recorded in the
  checkpoint; changed on disk, it refuses the resume (exit 4, naming both hashes); of another
  vocabulary, it is refused before any run dir (exit 2, naming both sizes).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from core import config as config_lib
from models.forward import ModelInputs
from tests import launch, reward_models
from tests.methods import PPO_MODEL_REWARD as METHOD
from training.objectives.critic import build_critic
from training.objectives.model_reward import ScoreShape, build_model_reward
from training.objectives.reward_model_io import read_score_weight

pytestmark = pytest.mark.slow

PPO_CONFIG = METHOD.config_path
LENGTHS = (40, 23, 31)
STEPS = METHOD.steps


@pytest.fixture(scope="module")
def reward_model(reference_runs):
    """The reward-model run the row's ``prepare`` trained, and its export."""
    export = Path(reward_models.reward_model_path(reference_runs, METHOD, kind="ppo"))
    return reward_models.exported_run(export), export


@pytest.fixture(scope="module")
def reference(reference_runs):
    return reference_runs.run(METHOD)


@pytest.mark.parametrize("source", ["run", "export"])
def test_a_critic_from_a_reward_model_values_a_sequence_at_its_score(reward_model, source):
    run_dir, export = reward_model
    path = f"run:{run_dir}" if source == "run" else str(export)
    config = config_lib.load(str(PPO_CONFIG), [f"objective.ppo.critic={path}"])
    critic = build_critic(config)
    head = read_score_weight(export, config.model.hidden_size)
    assert torch.equal(critic.value_head.weight.detach(), head) and torch.equal(critic.value_head.bias.detach(),
                                                                              torch.zeros(1))
    reward = build_model_reward(config, path, dist=reward_models.dist(), key="objective.ppo.rewards[0].path")
    for name, theirs in reward.trunk.module.state_dict().items():  # the trunk is the reward model's
        assert torch.equal(critic.trunk.state_dict()[name], theirs), name
    sequences = [list(range(3, 3 + n)) for n in LENGTHS]
    scores = reward.scores(sequences, shape=ScoreShape(rows=4, width=128), device=torch.device("cpu"), pad_id=257)
    with torch.no_grad():
        values = [critic(ModelInputs(torch.tensor([s]), torch.arange(len(s))[None],
                                     torch.zeros(1, len(s), dtype=torch.long)))[0, -1].item() for s in sequences]
    assert values == pytest.approx(scores, abs=1e-6)


def test_the_reward_model_scores_every_completion_and_is_recorded(reference, reward_model):
    _, export = reward_model
    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    # exact_answer gives 0 or 1 per completion: a mean that is no multiple of 1/8 holds model scores
    assert any(abs(r["reward_mean"] * 8 - round(r["reward_mean"] * 8)) > 1e-6 for r in lines)
    config = config_lib.load(str(PPO_CONFIG))
    expected = build_model_reward(config, str(export), dist=reward_models.dist(),
                                  key="objective.ppo.rewards[1].path").identity
    assert reward_models.checkpoint_frozen(reference, 2)["reward"] == expected == {"path": str(export),
                                                                                    "sha256": expected["sha256"]}


def test_a_reward_model_changed_on_disk_refuses_the_resume_naming_both_hashes(e2e_workdir, reward_model, tmp_path):
    _, export = reward_model
    changed = shutil.copytree(export, tmp_path / "rm-changed")
    args = ["--config", str(PPO_CONFIG), "run.name=ppo-rm-changed", "train.max_steps=2", "checkpoint.interval=2",
            reward_models.rewards_override("ppo", str(changed))]
    reward_models.changed_on_disk_refuses_the_resume(e2e_workdir, args, changed, config=PPO_CONFIG,
                                                     key="objective.ppo.rewards[1].path")


def test_a_reward_model_of_another_vocabulary_is_refused_before_any_run_dir(e2e_workdir, reward_model):
    run_dir, _ = reward_model
    rewards = f"[{{name: model, path: 'run:{run_dir}'}}]"
    args = ["--config", str(PPO_CONFIG), "run.name=ppo-rm-vocab", f"objective.ppo.rewards={rewards}",
            "model.vocab_size=1024"]
    result = launch.train(e2e_workdir, args, nproc=1)
    assert result.returncode == 2, result.stderr
    assert "512" in result.stderr and "1024" in result.stderr and "objective.ppo.rewards[0].path" in result.stderr
    assert not list((e2e_workdir / "runs").glob("ppo-rm-vocab-*"))
