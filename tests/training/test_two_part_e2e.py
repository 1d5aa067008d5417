"""A run that trains two parts keeps every guarantee, end to end on 2 CPU ranks.

The test objective (two_part_objective.py) trains the policy and a value model with its own
optimizer settings (training/parts.py). Its ranks run two_part_train.py, train.py with that
objective in place (``launch.ENTRY_ENV``).

- each part is trained, hashed and checkpointed as its own part (``grad_norm_value``,
  ``param_hash_value``; DCP keys ``parts.value.*``);
- SIGKILL of the whole job at random moments, then resume by run ID, gives a ledger identical
  line for line to an uninterrupted run's (the value part's norm and hash included);
- replay of a step before and after a checkpoint verifies;
- 2 ranks -> resume on 1 rank keeps the batch hashes, and both parts' losses within fp32 noise.
"""

from __future__ import annotations

import pytest

from tests import launch
from tests.e2e_config import e2e_args
from tests.training.two_part_objective import VALUE_PART

pytestmark = pytest.mark.slow

STEPS = 8


def two_part_args(*, name: str = "two-part") -> list[str]:
    return [*e2e_args(max_steps=STEPS, name=name), "objective.kind=two_part"]


@pytest.fixture(scope="module", autouse=True)
def two_part_entry():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(launch.ENTRY_ENV, "tests/training/two_part_train.py")
        yield


@pytest.fixture(scope="module")
def reference(e2e_workdir, two_part_entry):
    result = launch.train(e2e_workdir, two_part_args(), nproc=2)
    assert result.returncode == 0, result.stderr
    return result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir


def test_both_parts_train_and_are_checkpointed_as_parts(reference):
    from distributed.safe_dcp import SafeFileSystemReader
    from training.checkpoint.manager import saved_part_names

    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    for line in lines:
        assert line["grad_norm_value"] > 0 and line["grad_norm"] > 0
    hashed = [r for r in lines if "param_hash" in r]
    assert [r["step"] for r in hashed] == [4, 8]
    assert all("param_hash_value" in r for r in hashed)
    assert hashed[0]["param_hash_value"] != hashed[1]["param_hash_value"]  # the value part trained
    assert lines[-1]["value_loss"] < lines[0]["value_loss"]
    assert lines[-1]["loss"] < lines[0]["loss"]
    saved = SafeFileSystemReader(str(reference / "checkpoints" / "step_00000004" / "dcp")).read_metadata()
    assert saved_part_names(saved.state_dict_metadata) == {VALUE_PART}


def test_two_parts_sigkill_at_random_moments_then_resume_is_identical(e2e_workdir, reference):
    run_dir = launch.kill_and_resume(e2e_workdir, two_part_args(name="two-part-killed"), name="two-part-killed",
                                     seed=45)
    assert launch.ledger(run_dir) == launch.ledger(reference)


def test_two_parts_replay_verifies_before_and_after_a_checkpoint(e2e_workdir, reference):
    launch.replay_verifies(e2e_workdir, reference)  # steps 3 and 6: checkpoints every 4 steps


def test_two_parts_resume_on_one_rank_keeps_the_batch_hashes(e2e_workdir, reference):
    got = launch.one_rank_resume_keeps_the_batches(e2e_workdir, reference)
    for a, b in zip(launch.ledger(reference), got):
        assert b["value_loss"] == pytest.approx(a["value_loss"], rel=1e-4, abs=1e-6)
        assert b["grad_norm_value"] == pytest.approx(a["grad_norm_value"], rel=1e-3, abs=1e-6)
