"""What is particular to a run that trains two parts, end to end on 2 CPU ranks.

The test objective (two_part_objective.py) trains the policy and a value model with its own
optimizer settings (training/parts.py). Its ranks run two_part_train.py, train.py with that
objective registered (the row's ``entry``). The four guarantees are its row of the guarantee
table (tests/methods.py, ``TWO_PART``): SIGKILL at random moments + resume by run ID gives a
ledger identical line for line to the uninterrupted run's (the value part's norm and hash
included), replay of a step before and after a checkpoint verifies, 2 ranks -> resume on 1 rank
keeps the batch hashes and both parts' losses within fp32 noise (``one_rank_close``), and
accumulation keeps the batches and the loss. Here, on the row's run: each part is trained,
hashed and checkpointed as its own part (``grad_norm_value``, ``param_hash_value``; DCP keys
``parts.value.*``).
"""

from __future__ import annotations

import pytest

from tests import launch
from tests.methods import TWO_PART
from tests.training.two_part_objective import VALUE_PART

pytestmark = pytest.mark.slow

STEPS = TWO_PART.steps


@pytest.fixture(scope="module")
def reference(reference_runs):
    return reference_runs.run(TWO_PART)


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
