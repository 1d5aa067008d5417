"""PPO with a trained reward model: as its reward and as its critic's starting point.

A 4-step reward-model run (tests/configs/e2e-rm.yaml) and its Hugging Face export are

- the critic's source (``objective.ppo.critic``): the critic's trunk is the reward model's and its
  value head the score head (bias 0), so before any update its value at a sequence's last token is
  the reward model's score of the sequence, from the run and from the export alike;
- a reward of tests/configs/e2e-ppo.yaml's run (``{name: model, path}``, beside exact_answer):
  its score enters the completions' rewards, its identity (path and sha256) is recorded in the
  checkpoint, and on 2 CPU ranks SIGKILL at random moments (in the rollouts, the scoring, between
  two of a step's four updates) + resume by run ID gives the ledger of an uninterrupted run, line
  for line; changed on disk, it refuses the resume (exit 4, naming both hashes); of
  another vocabulary, it is refused before any run dir (exit 2, naming both sizes).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from core import config as config_lib
from models.qwen.forward import ModelInputs
from tests import launch
from training.checkpoint.load import OBJECTIVE_PART
from training.checkpoint.manifest import state_file_name
from training.objectives.critic import build_critic
from training.objectives.model_reward import ScoreShape, build_model_reward
from training.objectives.reward_model_io import read_score_weight

pytestmark = pytest.mark.slow

PPO_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-ppo.yaml"
RM_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-rm.yaml"
LENGTHS = (40, 23, 31)
STEPS = 6


def _run_dir(workdir, result):
    return result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir


def _dist():
    return SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=torch.device("cpu"), backend="gloo")


@pytest.fixture(scope="module")
def reward_model(e2e_workdir, tmp_path_factory):
    """A 4-step reward-model run on one rank, and its export."""
    result = launch.train(e2e_workdir, ["--config", str(RM_CONFIG), "run.name=rm-ppo", "train.max_steps=4"], nproc=1)
    assert result.returncode == 0, result.stderr
    run_dir = _run_dir(e2e_workdir, result)
    export = tmp_path_factory.mktemp("rm") / "rm-hf"
    done = launch.run_module(e2e_workdir, ["training", "export", "--run", str(run_dir), "--to", str(export)])
    assert done.returncode == 0, done.stderr
    return run_dir, export


@pytest.mark.parametrize("source", ["run", "export"])
def test_a_critic_from_a_reward_model_values_a_sequence_at_its_score(reward_model, source):
    run_dir, export = reward_model
    path = f"run:{run_dir}" if source == "run" else str(export)
    config = config_lib.load(str(PPO_CONFIG), [f"objective.ppo.critic={path}"])
    critic = build_critic(config)
    head = read_score_weight(export, config.model.hidden_size)
    assert torch.equal(critic.value_head.weight.detach(), head) and torch.equal(critic.value_head.bias.detach(),
                                                                              torch.zeros(1))
    reward = build_model_reward(config, path, dist=_dist(), key="objective.ppo.rewards[0].path")
    for name, theirs in reward.trunk.module.state_dict().items():  # the trunk is the reward model's
        assert torch.equal(critic.trunk.state_dict()[name], theirs), name
    sequences = [list(range(3, 3 + n)) for n in LENGTHS]
    scores = reward.scores(sequences, shape=ScoreShape(rows=4, width=128), device=torch.device("cpu"), pad_id=257)
    with torch.no_grad():
        values = [critic(ModelInputs(torch.tensor([s]), torch.arange(len(s))[None],
                                     torch.zeros(1, len(s), dtype=torch.long)))[0, -1].item() for s in sequences]
    assert values == pytest.approx(scores, abs=1e-6)


def ppo_args(export, *, name: str, steps: int) -> list[str]:
    rewards = f"[{{name: exact_answer, weight: 1.0}}, {{name: model, path: '{export}', weight: 0.5}}]"
    return ["--config", str(PPO_CONFIG), f"run.name={name}", f"train.max_steps={steps}", "checkpoint.interval=2",
            f"objective.ppo.rewards={rewards}"]


@pytest.fixture(scope="module")
def reference(e2e_workdir, reward_model):
    _, export = reward_model
    result = launch.train(e2e_workdir, ppo_args(export, name="ppo-rm", steps=STEPS), nproc=2)
    assert result.returncode == 0, result.stderr
    return _run_dir(e2e_workdir, result)


def test_the_reward_model_scores_every_completion_and_is_recorded(reference, reward_model):
    _, export = reward_model
    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    # exact_answer gives 0 or 1 per completion: a mean that is no multiple of 1/8 holds model scores
    assert any(abs(r["reward_mean"] * 8 - round(r["reward_mean"] * 8)) > 1e-6 for r in lines)
    state = json.loads((reference / "checkpoints" / "step_00000002" / state_file_name(OBJECTIVE_PART)).read_text())
    config = config_lib.load(str(PPO_CONFIG))
    expected = build_model_reward(config, str(export), dist=_dist(), key="objective.ppo.rewards[1].path").identity
    assert state["frozen"]["reward"] == expected == {"path": str(export), "sha256": expected["sha256"]}


def test_sigkill_at_random_moments_then_resume_is_identical(e2e_workdir, reference, reward_model):
    _, export = reward_model
    run_dir = launch.kill_and_resume(e2e_workdir, ppo_args(export, name="ppo-rm-killed", steps=STEPS),
                                     name="ppo-rm-killed", seed=47)
    assert launch.ledger(run_dir) == launch.ledger(reference)


def test_a_reward_model_changed_on_disk_refuses_the_resume_naming_both_hashes(e2e_workdir, reward_model, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, export = reward_model
    changed = tmp_path / "rm-changed"
    shutil.copytree(export, changed)
    result = launch.train(e2e_workdir, ppo_args(changed, name="ppo-rm-changed", steps=2), nproc=1)
    assert result.returncode == 0, result.stderr
    run_dir = _run_dir(e2e_workdir, result)
    tensors = load_file(str(changed / "model.safetensors"))
    tensors["score.weight"] = tensors["score.weight"] * 2  # the reward model changes on disk
    save_file(tensors, str(changed / "model.safetensors"), metadata={"format": "pt"})
    resumed = launch.train(e2e_workdir, ["--resume", run_dir.name, "train.max_steps=4"], nproc=1)
    assert resumed.returncode == 4, resumed.stderr
    state = json.loads((run_dir / "checkpoints" / "step_00000002" / state_file_name(OBJECTIVE_PART)).read_text())
    before = state["frozen"]["reward"]["sha256"]
    after = build_model_reward(config_lib.load(str(PPO_CONFIG)), str(changed), dist=_dist(),
                               key="objective.ppo.rewards[1].path").identity["sha256"]
    assert before != after and before in resumed.stderr and after in resumed.stderr


def test_a_reward_model_of_another_vocabulary_is_refused_before_any_run_dir(e2e_workdir, reward_model):
    run_dir, _ = reward_model
    rewards = f"[{{name: model, path: 'run:{run_dir}'}}]"
    args = ["--config", str(PPO_CONFIG), "run.name=ppo-rm-vocab", f"objective.ppo.rewards={rewards}",
            "model.vocab_size=1024"]
    result = launch.train(e2e_workdir, args, nproc=1)
    assert result.returncode == 2, result.stderr
    assert "512" in result.stderr and "1024" in result.stderr and "objective.ppo.rewards[0].path" in result.stderr
    assert not list((e2e_workdir / "runs").glob("ppo-rm-vocab-*"))
