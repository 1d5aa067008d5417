"""GRPO with a trained reward model as its reward keeps the guarantees, end to end on 2 CPU ranks.

A 4-step reward-model run (tests/configs/e2e-rm.yaml) is the reward ``{name: model, path:
run:RUN_DIR}`` of tests/configs/e2e-grpo.yaml's run, beside exact_answer. The reward model's
score enters every completion's reward (the rewards are not the rule rewards alone), its identity
(path and sha256) is recorded in the checkpoint like a reference's, and SIGKILL at random
moments + resume by run ID gives a ledger identical line for line (rollout_hash included), and
replay of a step verifies. A reward model of another vocabulary is refused before any run dir
(exit 2), one changed on disk refuses the resume (exit 4).
"""

from __future__ import annotations

import json

import pytest

from tests import launch

pytestmark = pytest.mark.slow

STEPS = 5
GRPO_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-grpo.yaml"
RM_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-rm.yaml"


def _run_dir(workdir, result):
    return result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir


@pytest.fixture(scope="module")
def reward_model(e2e_workdir):
    result = launch.train(e2e_workdir, ["--config", str(RM_CONFIG), "run.name=rm-reward", "train.max_steps=4"],
                          nproc=1)
    assert result.returncode == 0, result.stderr
    return _run_dir(e2e_workdir, result)


def grpo_args(reward_model, *, name: str) -> list[str]:
    rewards = f"[{{name: exact_answer, weight: 1.0}}, {{name: model, path: 'run:{reward_model}', weight: 0.5}}]"
    return ["--config", str(GRPO_CONFIG), f"run.name={name}", f"train.max_steps={STEPS}",
            f"objective.grpo.rewards={rewards}"]


@pytest.fixture(scope="module")
def reference(e2e_workdir, reward_model):
    result = launch.train(e2e_workdir, grpo_args(reward_model, name="grpo-rm"), nproc=2)
    assert result.returncode == 0, result.stderr
    return _run_dir(e2e_workdir, result)


def test_the_reward_model_scores_every_completion_and_is_recorded(reference, reward_model):
    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    # exact_answer gives 0 or 1 per completion: a mean that is no multiple of 1/16 holds model scores.
    assert any(abs(r["reward_mean"] * 16 - round(r["reward_mean"] * 16)) > 1e-6 for r in lines)
    from training.checkpoint.manifest import state_file_name
    from training.checkpoint.load import OBJECTIVE_PART

    state = json.loads((reference / "checkpoints" / "step_00000002" / state_file_name(OBJECTIVE_PART)).read_text())
    recorded = state["frozen"]["reward"]
    assert recorded["path"] == f"run:{reward_model}" and len(recorded["sha256"]) == 64


def test_sigkill_at_random_moments_then_resume_is_identical(e2e_workdir, reference, reward_model):
    run_dir = launch.kill_and_resume(e2e_workdir, grpo_args(reward_model, name="grpo-rm-killed"),
                                     name="grpo-rm-killed", seed=47)
    assert launch.ledger(run_dir) == launch.ledger(reference)


def test_replay_verifies_with_the_reward_model(e2e_workdir, reference):
    launch.replay_verifies(e2e_workdir, reference, steps=(2, 3))


def test_a_reward_model_of_another_vocabulary_is_refused_before_any_run_dir(e2e_workdir, reward_model):
    args = [*grpo_args(reward_model, name="grpo-rm-vocab"), "model.vocab_size=1024"]
    result = launch.train(e2e_workdir, args, nproc=1)
    assert result.returncode == 2, result.stderr
    assert "512" in result.stderr and "1024" in result.stderr and "objective.grpo.rewards[1].path" in result.stderr
    assert not list((e2e_workdir / "runs").glob("grpo-rm-vocab-*"))


def test_a_reward_model_changed_on_disk_refuses_the_resume_naming_both_hashes(e2e_workdir, reward_model, tmp_path):
    from safetensors.torch import load_file, save_file

    export = tmp_path / "rm-hf"
    done = launch.run_module(e2e_workdir, ["training", "export", "--run", str(reward_model), "--to", str(export)])
    assert done.returncode == 0, done.stderr
    rewards = f"[{{name: exact_answer, weight: 1.0}}, {{name: model, path: '{export}', weight: 0.5}}]"
    args = ["--config", str(GRPO_CONFIG), "run.name=grpo-rm-changed", "train.max_steps=2",
            f"objective.grpo.rewards={rewards}"]
    result = launch.train(e2e_workdir, args, nproc=1)
    assert result.returncode == 0, result.stderr
    run_dir = _run_dir(e2e_workdir, result)
    tensors = load_file(str(export / "model.safetensors"))
    tensors["score.weight"] = tensors["score.weight"] * 2  # the reward model changes on disk
    save_file(tensors, str(export / "model.safetensors"), metadata={"format": "pt"})
    resumed = launch.train(e2e_workdir, ["--resume", run_dir.name, "train.max_steps=4"], nproc=1)
    assert resumed.returncode == 4, resumed.stderr
    from training.checkpoint.manifest import state_file_name
    from training.checkpoint.load import OBJECTIVE_PART

    state = json.loads((run_dir / "checkpoints" / "step_00000002" / state_file_name(OBJECTIVE_PART)).read_text())
    from types import SimpleNamespace

    import torch

    from core import config as config_lib
    from training.objectives.model_reward import build_model_reward

    dist = SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=torch.device("cpu"), backend="gloo")
    now = build_model_reward(config_lib.load(str(GRPO_CONFIG)), str(export), dist=dist,
                             key="objective.grpo.rewards[1].path").identity["sha256"]
    before = state["frozen"]["reward"]["sha256"]
    assert before != now and before in resumed.stderr and now in resumed.stderr  # both hashes named
    assert "reward" in resumed.stderr


def test_a_sharded_reward_model_scores_as_the_replicated_one(e2e_workdir, reference, reward_model):
    """Under fsdp the reward model is fully sharded like the policy (its forward collective): the
    same identity, and the first step's rollouts and rewards match the ddp run's (reward_mean within
    fp32 noise of the sharded reduction order)."""
    from training.checkpoint.manifest import state_file_name
    from training.checkpoint.load import OBJECTIVE_PART

    args = [*grpo_args(reward_model, name="grpo-rm-fsdp"), "parallel.strategy=fsdp", "train.max_steps=2"]
    result = launch.train(e2e_workdir, args, nproc=2)
    assert result.returncode == 0, result.stderr
    run_dir = _run_dir(e2e_workdir, result)
    name = state_file_name(OBJECTIVE_PART)
    sharded = json.loads((run_dir / "checkpoints" / "step_00000002" / name).read_text())["frozen"]["reward"]
    replicated = json.loads((reference / "checkpoints" / "step_00000002" / name).read_text())["frozen"]["reward"]
    assert sharded == replicated
    first, theirs = launch.ledger(run_dir)[0], launch.ledger(reference)[0]
    assert first["rollout_hash"] == theirs["rollout_hash"]
    assert first["reward_mean"] == pytest.approx(theirs["reward_mean"], abs=1e-5)
