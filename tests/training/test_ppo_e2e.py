"""PPO keeps every guarantee of the loop, end to end on 2 CPU ranks (tests/configs/e2e-ppo.yaml:
two completions per prompt, a critic, an adaptive k3 KL penalty, two PPO epochs of two
minibatches, so four updates per rollout batch):

- the critic is trained, hashed and checkpointed as its own part (``grad_norm_critic``,
  ``param_hash_critic``, DCP keys ``parts.critic.*``), the adaptive KL coefficient moves and the
  ledger holds the rollout, KL, value and clipping statistics;
- SIGKILL of the whole job at random moments (most of a step is its four updates: kills land in
  the middle of the epochs over one rollout batch), then resume by run ID, ends with a ledger
  identical line for line to an uninterrupted run's, ``rollout_hash`` and ``kl_coef`` included;
- replay of a step before and after a checkpoint verifies;
- a 2-rank run resumed on 1 rank consumes the same prompts, and its first step rolls out the same
  completions into the same batch (the old log-probs, values, advantages and returns are extras:
  they are in the batch hash), whatever the world size;
- accumulation (micro-batches of 1 vs 4) changes no update's loss beyond rounding;
- a critic path that does not exist is exit 2 before any run dir.
"""

from __future__ import annotations

import pytest

from tests import launch

pytestmark = pytest.mark.slow

STEPS = 8
PPO_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-ppo.yaml"


def ppo_args(*, name: str = "ppo", overrides=()) -> list[str]:
    return ["--config", str(PPO_CONFIG), f"run.name={name}", f"train.max_steps={STEPS}", *overrides]


@pytest.fixture(scope="module")
def reference(e2e_workdir):
    result = launch.train(e2e_workdir, ppo_args(), nproc=2, timeout=600)
    assert result.returncode == 0, result.stderr
    return result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir


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
    assert lines[0]["kl"] == 0.0  # the policy is the reference at its first rollouts
    assert lines[0]["approx_kl"] == 0.0  # and the first update's ratio is exactly 1
    assert len({r["kl_coef"] for r in lines}) > 1  # the adaptive coefficient moved
    hashed = [r for r in lines if "param_hash" in r]
    assert [r["step"] for r in hashed] == [4, 8]
    assert hashed[0]["param_hash_critic"] != hashed[1]["param_hash_critic"]
    saved = SafeFileSystemReader(str(reference / "checkpoints" / "step_00000004" / "dcp")).read_metadata()
    assert saved_part_names(saved.state_dict_metadata) == {"critic"}


def test_ppo_sigkill_in_the_middle_of_the_epochs_then_resume_is_identical(e2e_workdir, reference):
    run_dir = launch.kill_and_resume(e2e_workdir, ppo_args(name="ppo-killed"), name="ppo-killed", seed=47,
                                     delay_s=1.0)
    assert launch.ledger(run_dir) == launch.ledger(reference)


def test_ppo_sigkill_between_two_updates_of_one_step_then_resume_is_identical(e2e_workdir, reference):
    # Step 6 (after the step-4 checkpoint): killed as its third update (epoch 2, minibatch 1) begins.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(launch.ENTRY_ENV, "tests/training/ppo_kill_train.py")
        patch.setenv("LOCKSTEP_TEST_PPO_KILL_AT", "6:2")
        job = launch.start(e2e_workdir, ppo_args(name="ppo-mid-epoch"))
        job.communicate(timeout=600)
        assert job.returncode != 0 and (e2e_workdir / "ppo-killed-once").is_file()
        run_dir = next((e2e_workdir / "runs").glob("ppo-mid-epoch-*"))
        assert [r["step"] for r in launch.ledger(run_dir)] == [1, 2, 3, 4, 5]
        resumed = launch.train(e2e_workdir, ["--resume", run_dir.name], nproc=2, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert launch.ledger(run_dir) == launch.ledger(reference)


def test_ppo_replay_verifies_before_and_after_a_checkpoint(e2e_workdir, reference):
    launch.replay_verifies(e2e_workdir, reference)  # steps 3 and 6: checkpoints every 4 steps


def test_ppo_resume_on_one_rank_keeps_the_batches_and_rollouts(e2e_workdir, reference):
    # Cut back to the step-4 checkpoint and resume on one rank: every step consumes the same
    # prompts (data_state_hash), and step 5 rolls out from the checkpoint's weights, so its
    # rollouts and its whole batch (old log-probs, values, advantages, returns) are the same.
    # Later steps start from weights the two world sizes reduced in a different order (equal up
    # to rounding): their extras differ in the last bits, so only step 5 is bitwise comparable
    # (docs/contracts.md, elastic), as for GRPO.
    copy = launch.cut_back_copy(reference, 4, "-one-rank")
    resumed = launch.train(e2e_workdir, ["--resume", copy.name], nproc=1, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    ref, got = launch.ledger(reference), launch.ledger(copy)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["data_state_hash"] for r in got] == [r["data_state_hash"] for r in ref]
    for field in ("rollout_hash", "batch_hash", "reward_mean", "kl_coef", "kl", "explained_variance"):
        assert got[4][field] == ref[4][field], field
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)
        assert b["value_loss"] == pytest.approx(a["value_loss"], rel=1e-4, abs=1e-6)


def test_ppo_accumulation_does_not_change_the_updates(e2e_workdir):
    # One step on one rank, micro-batches of 1 (4 per minibatch) and of 4 (1 per minibatch): the
    # same rollouts, and every update's loss (two epochs of two minibatches) equal up to the
    # order of the sums.
    runs = [launch.train(e2e_workdir, ppo_args(name=f"ppo-acc{m}", overrides=[
        f"train.micro_batch_size={m}", "parallel.strategy=none", "train.max_steps=1"]), nproc=1, timeout=600)
        for m in (1, 4)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr + runs[1].stderr
    [a], [b] = (launch.ledger(r.run_dir if r.run_dir.is_absolute() else e2e_workdir / r.run_dir) for r in runs)
    assert a["rollout_hash"] == b["rollout_hash"] and a["reward_mean"] == b["reward_mean"]
    assert b["inner_losses"] == pytest.approx(a["inner_losses"], rel=1e-4, abs=1e-6)
    for key in ("value_loss", "policy_loss", "kl", "explained_variance"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_a_critic_path_that_does_not_exist_exits_2_before_any_run_dir(e2e_workdir, tmp_path):
    missing = tmp_path / "no-critic"
    result = launch.train(e2e_workdir, ppo_args(name="ppo-no-critic", overrides=[f"objective.ppo.critic={missing}"]),
                          nproc=1)
    assert result.returncode == 2, result.stderr
    assert "objective.ppo.critic" in result.stderr
    assert not list((e2e_workdir / "runs").glob("ppo-no-critic-*"))
