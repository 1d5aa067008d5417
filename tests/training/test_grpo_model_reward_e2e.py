"""GRPO with a trained reward model as its reward keeps the guarantees, end to end on 2 CPU ranks.

The guarantee table's ``grpo-model-reward`` row (tests/methods.py, tests/reward_models.py) is
tests/configs/e2e-grpo.yaml with a 4-step reward-model run (tests/configs/e2e-rm.yaml) as the
reward ``{name: model, path: run:RUN_DIR}`` beside exact_answer; the table checks that SIGKILL at
random moments + resume by run ID gives a ledger identical line for line (rollout_hash included),
that replay of a step verifies, that the 2-rank run resumed on 1 rank keeps the ledger, the
batches, the rollouts and the rewards, and that micro-batch sizes 1 and 4 agree (a reward model's
scores depend on neither: training/objectives/model_reward.py). This file reads the row's run:
the reward model's score enters every completion's reward (the rewards are not the rule rewards
alone), its identity (path and sha256) is recorded in the checkpoint like a reference's, and
sharded under fsdp it scores as the replicated one. A reward model of another vocabulary is
refused before any run dir (exit 2), one changed on disk refuses the resume (exit 4).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import launch, reward_models
from tests.guarantees import run_dir
from tests.methods import GRPO_MODEL_REWARD as METHOD

pytestmark = pytest.mark.slow

STEPS = METHOD.steps
GRPO_CONFIG = METHOD.config_path


@pytest.fixture(scope="module")
def reward_model(reference_runs):
    """The reward-model run the row's ``prepare`` trained."""
    return Path(reward_models.reward_model_path(reference_runs, METHOD, kind="grpo").removeprefix("run:"))


@pytest.fixture(scope="module")
def reference(reference_runs):
    return reference_runs.run(METHOD)


def test_the_reward_model_scores_every_completion_and_is_recorded(reference, reward_model):
    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    # exact_answer gives 0 or 1 per completion: a mean that is no multiple of 1/16 holds model scores.
    assert any(abs(r["reward_mean"] * 16 - round(r["reward_mean"] * 16)) > 1e-6 for r in lines)
    recorded = reward_models.checkpoint_frozen(reference, 2)["reward"]
    assert recorded["path"] == f"run:{reward_model}" and len(recorded["sha256"]) == 64


def test_a_reward_model_of_another_vocabulary_is_refused_before_any_run_dir(e2e_workdir, reference_runs):
    args = reference_runs.args(METHOD, name="grpo-rm-vocab", overrides=["model.vocab_size=1024"])
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


def test_a_sharded_reward_model_scores_as_the_replicated_one(e2e_workdir, reference_runs, reference):
    """Under fsdp the reward model is fully sharded like the policy (its forward collective): the
    same identity, and the first step's rollouts and rewards match the ddp run's (reward_mean within
    fp32 noise of the sharded reduction order)."""
    args = reference_runs.args(METHOD, name="grpo-rm-fsdp", max_steps=2, overrides=["parallel.strategy=fsdp"])
    result = launch.train(e2e_workdir, args, nproc=2)
    assert result.returncode == 0, result.stderr
    run = run_dir(e2e_workdir, result)
    assert reward_models.checkpoint_frozen(run, 2)["reward"] == reward_models.checkpoint_frozen(reference, 2)["reward"]
    first, theirs = launch.ledger(run)[0], launch.ledger(reference)[0]
    assert first["rollout_hash"] == theirs["rollout_hash"]
    assert first["reward_mean"] == pytest.approx(theirs["reward_mean"], abs=1e-5)
