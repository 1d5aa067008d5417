"""The reward model keeps every guarantee of the loop, end to end on CPU ranks
(tests/configs/e2e-rm.yaml): its score head is a trained part of its own (``parts.score.*``).

- the ledger records pairs, accuracy and margin per pair, and the eval event the held-out pairs'
  preference accuracy;
- SIGKILL of the 2-rank job at random moments, then resume by run ID, gives a ledger identical line
  for line to an uninterrupted run's;
- replay of a step before and after a checkpoint verifies;
- 2 ranks -> resume on 1 rank keeps the batch hashes.
"""

from __future__ import annotations

import pytest

from tests import launch

pytestmark = pytest.mark.slow

STEPS = 8
RM_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-rm.yaml"
EVAL = ("train.eval_interval=8", "train.eval_batches=2")


def rm_args(*, name: str = "rm", overrides=EVAL) -> list[str]:
    return ["--config", str(RM_CONFIG), f"run.name={name}", f"train.max_steps={STEPS}", *overrides]


@pytest.fixture(scope="module")
def reference(e2e_workdir):
    result = launch.train(e2e_workdir, rm_args(), nproc=2)
    assert result.returncode == 0, result.stderr
    return result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir


def test_the_ledger_records_pairs_accuracy_and_margin_and_eval_the_held_out_accuracy(reference):
    from distributed.safe_dcp import SafeFileSystemReader
    from training.checkpoint.manager import saved_part_names
    from training.objectives.reward_model import SCORE_PART

    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    for line in lines:
        assert line["pairs"] == line["target_tokens"] > 0
        assert 0.0 <= line["accuracy"] <= 1.0
        assert line["grad_norm_score"] > 0
    hashed = [r for r in lines if "param_hash" in r]
    assert [r["step"] for r in hashed] == [4, 8]
    assert hashed[0]["param_hash_score"] != hashed[1]["param_hash_score"]  # the score head trained
    assert len({line["margin"] for line in lines}) == STEPS  # the scores move
    evals = [e for e in launch.events(reference) if e["event"] == "eval"]
    assert evals and evals[-1]["unit"] == "pair"
    assert {"accuracies", "margins"} <= set(evals[-1]["metrics"])
    assert 0.0 <= evals[-1]["metrics"]["accuracies"] <= 1.0
    saved = SafeFileSystemReader(str(reference / "checkpoints" / "step_00000004" / "dcp")).read_metadata()
    assert saved_part_names(saved.state_dict_metadata) == {SCORE_PART}


def test_sigkill_at_random_moments_then_resume_is_identical(e2e_workdir, reference):
    run_dir = launch.kill_and_resume(e2e_workdir, rm_args(name="rm-killed"), name="rm-killed", seed=47)
    assert launch.ledger(run_dir) == launch.ledger(reference)


def test_replay_verifies_before_and_after_a_checkpoint(e2e_workdir, reference):
    launch.replay_verifies(e2e_workdir, reference)


def test_resume_on_one_rank_keeps_the_batch_hashes(e2e_workdir, reference):
    got = launch.one_rank_resume_keeps_the_batches(e2e_workdir, reference, same=("pairs",))
    for a, b in zip(launch.ledger(reference), got):
        assert b["accuracy"] == a["accuracy"]
