"""What is particular to the reward model, end to end on 2 CPU ranks (tests/configs/e2e-rm.yaml):
its score head is a trained part of its own (``parts.score.*``), the ledger records pairs,
accuracy and margin per pair, and the eval event the held-out pairs' preference accuracy. The
four guarantees (SIGKILL + resume, replay, 2 -> 1 ranks, accumulation) are its row of the
guarantee table (tests/methods.py, ``REWARD_MODEL``).
"""

from __future__ import annotations

import pytest

from tests import launch
from tests.methods import REWARD_MODEL

pytestmark = pytest.mark.slow

STEPS = 8


@pytest.fixture(scope="module")
def reference(reference_runs):
    return reference_runs.run(REWARD_MODEL)


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
