"""What is particular to PPO, end to end on 2 CPU ranks (tests/configs/e2e-ppo.yaml:
two completions per prompt, a critic, an adaptive k3 KL penalty, two PPO epochs of two
minibatches, so four updates per rollout batch). The four guarantees (random SIGKILLs, which land
mid-epoch, + resume; replay; 2 -> 1 ranks; accumulation) are its row of the guarantee table
(tests/methods.py, ``PPO``):

- the critic is trained, hashed and checkpointed as its own part (``grad_norm_critic``,
  ``param_hash_critic``, DCP keys ``parts.critic.*``), the adaptive KL coefficient moves and the
  ledger holds the rollout, KL, value and clipping statistics;
- a kill at a known point, between two updates of one step (in the middle of the epochs over
  one rollout batch), then resume by run ID, ends with a ledger identical line for line to an
  uninterrupted run's;
- a critic path that does not exist is exit 2 before any run dir.
"""

from __future__ import annotations

import pytest

from tests import launch
from tests.methods import PPO

pytestmark = pytest.mark.slow

STEPS = PPO.steps  # 4, with a checkpoint every 2 steps (the row's overrides)
PPO_CONFIG = PPO.config_path


def ppo_args(*, name: str = "ppo", overrides=()) -> list[str]:
    """The row's run (tests/methods.py, ``PPO``) under another name, with ``overrides``."""
    return ["--config", str(PPO_CONFIG), f"run.name={name}", f"train.max_steps={STEPS}", *PPO.overrides, *overrides]


@pytest.fixture(scope="module")
def reference(reference_runs):
    return reference_runs.run(PPO)


def test_ppo_trains_actor_and_critic_with_its_ledger_fields(reference):
    from distributed.safe_dcp import SafeFileSystemReader
    from training.checkpoint.manager import saved_part_names

    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert len({r["rollout_hash"] for r in lines}) == STEPS
    for line in lines:
        assert len(line["inner_losses"]) == 4 == len(line["inner_grad_norms"])  # 2 epochs x 2 minibatches
        assert line["grad_norm_critic"] > 0 and line["reward_errors"] == 0
        assert 0.0 <= line["clip_fraction"] <= 1.0 and 0.0 <= line["value_clip_fraction"] <= 1.0
        assert line["score_min"] <= line["reward_mean"] <= line["score_max"]
        for key in ("kl", "kl_coef", "value_loss", "policy_loss", "approx_kl", "dual_clip_fraction"):
            assert isinstance(line[key], float), key
    # The stock kernels' gap between the sampler's log-probs and the old ones (a statistic outside
    # determinism.batch_invariant, as GRPO's): small in fp32, never absent.
    assert all(0.0 <= line["logprob_parity"] < 1e-4 for line in lines)
    assert lines[0]["kl"] == 0.0  # the policy is the reference at its first rollouts
    # approx_kl and the clip fractions are means over all four updates (ledger_over_updates): the
    # first update's ratio is exactly 1 on the CPU, the later ones' are not.
    assert all(line["approx_kl"] > 0.0 for line in lines)
    assert len({r["kl_coef"] for r in lines}) > 1  # the adaptive coefficient moved
    hashed = [r for r in lines if "param_hash" in r]
    assert [r["step"] for r in hashed] == [2, 4]
    assert hashed[0]["param_hash_critic"] != hashed[1]["param_hash_critic"]
    saved = SafeFileSystemReader(str(reference / "checkpoints" / "step_00000002" / "dcp")).read_metadata()
    assert saved_part_names(saved.state_dict_metadata) == {"critic"}


def test_ppo_sigkill_between_two_updates_of_one_step_then_resume_is_identical(e2e_workdir, reference):
    # Step 3 (after the step-2 checkpoint): killed as its third update (epoch 2, minibatch 1) begins.
    entry = "tests/training/ppo_kill_train.py"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOCKSTEP_TEST_PPO_KILL_AT", "3:2")
        job = launch.start(e2e_workdir, ppo_args(name="ppo-mid-epoch"), entry=entry)
        job.communicate(timeout=600)
        assert job.returncode != 0 and (e2e_workdir / "ppo-killed-once").is_file()
        run_dir = next((e2e_workdir / "runs").glob("ppo-mid-epoch-*"))
        assert [r["step"] for r in launch.ledger(run_dir)] == [1, 2]
        resumed = launch.train(e2e_workdir, ["--resume", run_dir.name], nproc=2, timeout=600, entry=entry)
    assert resumed.returncode == 0, resumed.stderr
    assert launch.ledger(run_dir) == launch.ledger(reference)


def test_a_critic_path_that_does_not_exist_exits_2_before_any_run_dir(e2e_workdir, tmp_path):
    missing = tmp_path / "no-critic"
    result = launch.train(e2e_workdir, ppo_args(name="ppo-no-critic", overrides=[f"objective.ppo.critic={missing}"]),
                          nproc=1)
    assert result.returncode == 2, result.stderr
    assert "objective.ppo.critic" in result.stderr
    assert not list((e2e_workdir / "runs").glob("ppo-no-critic-*"))
