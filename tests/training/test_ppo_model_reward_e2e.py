"""PPO with a trained reward model: as its reward and as its critic's starting point.

A 4-step reward-model run (tests/configs/e2e-rm.yaml) and its Hugging Face export are

- the critic's source (``objective.ppo.critic``): the critic's trunk is the reward model's and its
  value head the score head (bias 0), so before any update its value at a sequence's last token is
  the reward model's score of the sequence, from the run and from the export alike;
- a reward of the guarantee table's PPO row (tests/configs/e2e-ppo.yaml; ``{name: model, path}``
  beside exact_answer, tests/reward_models.py ``with_model_reward``, run for 6 steps): its score
  enters the completions' rewards, its identity (path and sha256) is recorded in the checkpoint,
  and on 2 CPU ranks SIGKILL at random moments (in the rollouts, the scoring, between two of a
  step's four updates) + resume by run ID gives the ledger of an uninterrupted run, line for line;
  that run resumed on 1 rank keeps the ledger, the batches, the rollouts and the rewards (its
  scores do not depend on the world size: training/objectives/model_reward.py); changed on disk,
  it refuses the resume (exit 4, naming both hashes); of another vocabulary, it is refused before
  any run dir (exit 2, naming both sizes).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from core import config as config_lib
from models.qwen.forward import ModelInputs
from tests import launch, reward_models
from tests.guarantees import Kill, one_rank_resume_keeps_the_batches, sigkill_then_resume_is_identical
from tests.methods import PPO
from training.objectives.critic import build_critic
from training.objectives.model_reward import ScoreShape, build_model_reward
from training.objectives.reward_model_io import read_score_weight

pytestmark = pytest.mark.slow

PPO_CONFIG = PPO.config_path
LENGTHS = (40, 23, 31)
STEPS = 6


@pytest.fixture(scope="module")
def reward_model(e2e_workdir, tmp_path_factory):
    """A 4-step reward-model run on one rank, and its export."""
    run_dir = reward_models.train_reward_model(e2e_workdir, "rm-ppo")
    return run_dir, reward_models.export(e2e_workdir, run_dir, tmp_path_factory.mktemp("rm") / "rm-hf")


@pytest.fixture(scope="module")
def method(reward_model):
    """The PPO row with the exported reward model, for 6 steps (a checkpoint every 2); the kills as
    this file always made them, the 1-rank resume from the step-4 checkpoint (two steps on 1 rank)."""
    _, export = reward_model
    return reward_models.with_model_reward(PPO, kind="ppo", path=str(export), steps=STEPS, kill=Kill(seed=47),
                                           one_rank_step=4)


@pytest.fixture(scope="module")
def reference(reference_runs, method):
    return reference_runs.run(method)


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


def test_sigkill_at_random_moments_then_resume_is_identical(reference_runs, method):
    sigkill_then_resume_is_identical(reference_runs, method)


def test_the_two_rank_run_resumed_on_one_rank_keeps_the_batches_and_the_rewards(reference_runs, method):
    one_rank_resume_keeps_the_batches(reference_runs, method)


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
