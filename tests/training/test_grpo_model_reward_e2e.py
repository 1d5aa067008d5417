"""GRPO with a trained reward model as its reward keeps the guarantees, end to end on 2 CPU ranks.

A 4-step reward-model run (tests/configs/e2e-rm.yaml) is the reward ``{name: model, path:
run:RUN_DIR}`` of the guarantee table's GRPO row (tests/configs/e2e-grpo.yaml), beside exact_answer
(tests/reward_models.py, ``with_model_reward``). The reward model's score enters every
completion's reward (the rewards are not the rule rewards alone), its identity (path and sha256)
is recorded in the checkpoint like a reference's, and SIGKILL at random moments + resume by run ID
gives a ledger identical line for line (rollout_hash included), replay of a step verifies, and the
2-rank run resumed on 1 rank keeps the ledger, the batches, the rollouts and the rewards (its scores
do not depend on the world size: training/objectives/model_reward.py). A reward model of another
vocabulary is refused before any run dir (exit 2), one changed on disk refuses the resume (exit 4).
"""

from __future__ import annotations

import pytest

from tests import launch, reward_models
from tests.guarantees import Kill, one_rank_resume_keeps_the_batches, run_dir, sigkill_then_resume_is_identical
from tests.methods import GRPO

pytestmark = pytest.mark.slow

STEPS = GRPO.steps
GRPO_CONFIG = GRPO.config_path


@pytest.fixture(scope="module")
def reward_model(e2e_workdir):
    return reward_models.train_reward_model(e2e_workdir, "rm-reward")


@pytest.fixture(scope="module")
def method(reward_model):
    """The GRPO row with the reward model; the kills as this file always made them, the 1-rank resume
    from the last checkpoint (step 4: one step on 1 rank)."""
    return reward_models.with_model_reward(GRPO, kind="grpo", path=f"run:{reward_model}", kill=Kill(seed=47),
                                           one_rank_step=4)


@pytest.fixture(scope="module")
def reference(reference_runs, method):
    return reference_runs.run(method)


def test_the_reward_model_scores_every_completion_and_is_recorded(reference, reward_model):
    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    # exact_answer gives 0 or 1 per completion: a mean that is no multiple of 1/16 holds model scores.
    assert any(abs(r["reward_mean"] * 16 - round(r["reward_mean"] * 16)) > 1e-6 for r in lines)
    recorded = reward_models.checkpoint_frozen(reference, 2)["reward"]
    assert recorded["path"] == f"run:{reward_model}" and len(recorded["sha256"]) == 64


def test_sigkill_at_random_moments_then_resume_is_identical(reference_runs, method):
    sigkill_then_resume_is_identical(reference_runs, method)


def test_the_two_rank_run_resumed_on_one_rank_keeps_the_batches_and_the_rewards(reference_runs, method):
    one_rank_resume_keeps_the_batches(reference_runs, method)


def test_replay_verifies_with_the_reward_model(e2e_workdir, reference):
    launch.replay_verifies(e2e_workdir, reference, steps=(2, 3))


def test_a_reward_model_of_another_vocabulary_is_refused_before_any_run_dir(e2e_workdir, reference_runs, method):
    args = reference_runs.args(method, name="grpo-rm-vocab", overrides=["model.vocab_size=1024"])
    result = launch.train(e2e_workdir, args, nproc=1)
    assert result.returncode == 2, result.stderr
    assert "512" in result.stderr and "1024" in result.stderr and "objective.grpo.rewards[1].path" in result.stderr
    assert not list((e2e_workdir / "runs").glob("grpo-rm-vocab-*"))


def test_a_reward_model_changed_on_disk_refuses_the_resume_naming_both_hashes(e2e_workdir, reward_model, tmp_path):
    hf_dir = reward_models.export(e2e_workdir, reward_model, tmp_path / "rm-hf")
    args = ["--config", str(GRPO_CONFIG), "run.name=grpo-rm-changed", "train.max_steps=2",
            reward_models.rewards_override("grpo", str(hf_dir))]
    reward_models.changed_on_disk_refuses_the_resume(e2e_workdir, args, hf_dir, config=GRPO_CONFIG,
                                                     key="objective.grpo.rewards[1].path")


def test_a_sharded_reward_model_scores_as_the_replicated_one(e2e_workdir, reference_runs, method, reference):
    """Under fsdp the reward model is fully sharded like the policy (its forward collective): the
    same identity, and the first step's rollouts and rewards match the ddp run's (reward_mean within
    fp32 noise of the sharded reduction order)."""
    args = reference_runs.args(method, name="grpo-rm-fsdp", max_steps=2, overrides=["parallel.strategy=fsdp"])
    result = launch.train(e2e_workdir, args, nproc=2)
    assert result.returncode == 0, result.stderr
    run = run_dir(e2e_workdir, result)
    assert reward_models.checkpoint_frozen(run, 2)["reward"] == reward_models.checkpoint_frozen(reference, 2)["reward"]
    first, theirs = launch.ledger(run)[0], launch.ledger(reference)[0]
    assert first["rollout_hash"] == theirs["rollout_hash"]
    assert first["reward_mean"] == pytest.approx(theirs["reward_mean"], abs=1e-5)
